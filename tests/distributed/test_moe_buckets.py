"""Whole-matrix experts in a DBuffer of their own (design note [plan-buckets]) through the engine.

``examples/moe.py``'s MoE GPT sharded per block with experts whole (``expert_granularity``), as
``test_moe_parity.py`` does, with the decision forced (layout ``"stacks"``: ``SPLIT_MARGIN=-1``,
one buffer per expert stack; ``"two"``: ``-1`` with ``MAX_STACK_BUFFERS=0``, the stacks in one
buffer beside the rest; ``"one"``: ``inf``, never split) or left to the rule:

* the engine builds exactly :func:`~lightning_vescale.planner.plan_buckets`' plans (the figures
  the planner CLI and ``benchmarks/moe.py`` print): at 3 ranks the rule's two buffers lower the
  blocks' padding from 4.0% to 0.1% (one buffer before [plan-buckets]); at 2 ranks one buffer
  per stack lowers it from 3.6% to 0 (two buffers would pad 6.3%: one buffer before this
  candidate, the test fails there);
* parity with one process at 2-4 ranks on split groups with AdamW (bitwise at 2 ranks, as
  before the split), AdamW8bit and Muon (``torch.optim.Muon`` per expert), reusing
  ``test_moe_parity``'s reference and tolerance;
* checkpoints saved under one layout load under another (names and global boxes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import test_moe_parity as parity


#: forced layouts: (SPLIT_MARGIN, MAX_STACK_BUFFERS)
LAYOUTS = {"one": (float("inf"), 8), "two": (-1, 0), "stacks": (-1, 8)}


def _with_layout(layout: str | None, fn, *args):
    """Run ``fn`` in this rank with the decision forced to ``layout`` (``None``: the rule)."""
    from lightning_vescale.planner import _buckets

    saved = _buckets.SPLIT_MARGIN, _buckets.MAX_STACK_BUFFERS
    if layout is not None:
        _buckets.SPLIT_MARGIN, _buckets.MAX_STACK_BUFFERS = LAYOUTS[layout]
    try:
        return fn(*args)
    finally:
        _buckets.SPLIT_MARGIN, _buckets.MAX_STACK_BUFFERS = saved


def _groups(model):
    from lightning_vescale.fsdp import iter_param_groups

    return [g for _, g in iter_param_groups(model)]


def _engine_is_the_planner():
    from lightning_vescale.callbacks.memory import engine_tensors
    from lightning_vescale.planner import plan_buckets
    from lightning_vescale.sharding_summary import sharding_summary

    model = parity._sharded_model(dist.get_world_size())
    splits = stacks = 0
    for group in _groups(model):
        mps = sorted(group.params, key=lambda mp: len(mp.shape) < 2)
        want = plan_buckets([(mp.name, mp.shape, group.granularity[mp.name]) for mp in mps],
                            dist.get_world_size())
        assert tuple(buf.plan for buf in group.buffers.values()) == want.plans
        assert list(group.buffers) == [(torch.float32, True, *s) for s in want.suffixes]
        splits += want.split
        stacks += want.per_stack
    found, _ = engine_tensors(model)  # the memory profiler walks every buffer
    assert len(found["params_sharded"]) == sum(len(g.buffers) for g in _groups(model))
    summary = sharding_summary(model)
    listed = [b.name for g in summary.groups for b in g.buffers]
    blocks = [g.padding_ratio for g in summary.groups if g.buffers]
    return splits, stacks, blocks, listed, str(summary)


def test_engine_builds_plan_buckets_layout_and_pads_less(worlds):
    splits, stacks, blocks, listed, table = worlds(3).run(_engine_is_the_planner)[0]
    assert splits == 2 and stacks == 0  # both blocks (the root has no experts)
    assert len(blocks) == 2 and max(blocks) < 0.002, table  # one buffer per bucket: 4.0%
    assert listed == ["[torch.float32]", "[torch.float32, matrix]"] * 2, table
    assert "  [torch.float32, matrix]" in table


def test_engine_builds_one_buffer_per_stack_where_only_that_pays(worlds):
    splits, stacks, blocks, listed, table = worlds(2).run(_engine_is_the_planner)[0]
    assert splits == stacks == 2, table  # one buffer: 3.6%; two buffers: 6.3%
    assert len(blocks) == 2 and max(blocks) == 0.0, table
    assert listed == ["[torch.float32]", "[torch.float32, matrix, mlp.experts.w_in]",
                      "[torch.float32, matrix, mlp.experts.w_out]"] * 2, table


def _split_parity(kind: str, layout: str):
    model = parity._sharded_model(dist.get_world_size())
    blocks = [g for g in _groups(model) if any(".experts." in mp.name for mp in g.params)]
    want = {"two": [(torch.float32, True), (torch.float32, True, "matrix")],
            "stacks": [(torch.float32, True), (torch.float32, True, "matrix", "mlp.experts.w_in"),
                       (torch.float32, True, "matrix", "mlp.experts.w_out")]}[layout]
    assert len(blocks) == 2 and all(list(g.buffers) == want for g in blocks)
    opt = parity._optimizer(model, kind)
    steps = 2 if kind == "muon" else parity.STEPS
    parity._train(model, opt, range(steps))
    return parity._full_params(model), parity._reference_model(kind, dist.get_world_size(), steps)


@pytest.mark.parametrize("world,kind,layout", [
    (2, "adamw", "two"), (2, "muon", "two"), (3, "adamw8bit", "two"), (4, "muon", "two"),
    (2, "adamw", "stacks"), (2, "muon", "stacks"), (3, "adamw8bit", "stacks"),
    (4, "muon", "stacks")])
def test_split_groups_match_single_process(worlds, world, kind, layout):
    got, want = worlds(world).run(_with_layout, layout, _split_parity, kind, layout)[0]
    parity._assert_close(got, want)
    if world == 2 and kind == "adamw":  # bitwise before the split, bitwise with it
        for n in want:
            assert torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("save_layout,load_layout", [("one", "two"), ("two", "one"),
                                                     ("stacks", "one"), ("two", "stacks")])
def test_checkpoint_loads_across_the_split(worlds, tmp_path, save_layout, load_layout):
    path = str(tmp_path / "ckpt")
    worlds(2).run(_with_layout, save_layout, parity._save_body, path, "adamw8bit")
    got, want = worlds(3).run(_with_layout, load_layout, parity._load_body, path, "adamw8bit",
                              2)[0]
    parity._assert_close(got, want)


def _quantized_train():
    from torch.distributed.device_mesh import init_device_mesh

    from examples.moe import expert_granularity
    from lightning_vescale.fsdp import CommPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parity._moe_model()
    # min_numel=512: the expert stacks and the attention weights all-gather int8, so the
    # quantized bucket holds both kinds and splits too
    policy = CommPolicy(all_gather="int8", reduce_scatter_dtype="bf16", min_numel=512)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, granularity=expert_granularity, comm_policy=policy)
    fully_shard(model, mesh=mesh, granularity=expert_granularity, comm_policy=policy)
    parity._train(model, torch.optim.AdamW(model.parameters(), **parity.ADAMW_HP), range(3))
    return parity._full_params(model), sorted(map(str, _groups(model)[1].buffers))


def test_split_changes_no_value_with_quantized_comm(worlds):
    """Split or not, every element sees the same collectives' arithmetic: bitwise equal, here
    with int8 all-gathers and bf16 reduce-scatters (a quantized bucket split too)."""
    world = worlds(3)
    one, one_keys = world.run(_with_layout, "one", _quantized_train)[0]
    assert len(one_keys) == 2
    for layout, key in (("two", "'matrix')"), ("stacks", "'matrix', 'mlp.experts.w_in')")):
        split, split_keys = world.run(_with_layout, layout, _quantized_train)[0]
        assert f"(torch.float32, True, True, {key}" in split_keys, split_keys
        for n in one:
            assert torch.equal(split[n], one[n]), (layout, n)
