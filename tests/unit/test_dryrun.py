"""``lightning_vescale.dryrun`` at toy size: the fake group, both engines, the tracker, the CLI.

Each dry run makes this process rank r of N under torch's fake process group (destroyed at the
end) and runs the real engine and torch's FSDP2 on FakeTensors. The byte figures are checked
against what the layout implies (shards of 1/N, AdamW's two fp32 moments, one all-gather per
group in forward and one per block in backward) and against each other; the real-vs-fake
agreement is ``tests/distributed/test_dryrun_vs_gloo.py``.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.distributed as dist

from lightning_vescale.planner.presets import (
    PRESETS,
    TransformerConfig,
    transformer_groups,
    with_overrides,
)

TOY = TransformerConfig(hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, vocab=5000)


def _toy(name: str) -> TransformerConfig:
    c = PRESETS[name]
    extra: dict = {}
    if c.experts:
        extra.update(experts=8, moe_ffn=32)
    if c.kv_heads:
        extra.update(kv_heads=2)
    if c.head_dim:
        extra.update(head_dim=16)
    if c.attention == "mla":
        extra.update(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                     v_head_dim=8)
    return with_overrides(c, layers=min(c.layers, 4), hidden=64, heads=4, vocab=100, ffn=96,
                          **extra)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_module_has_the_planner_shapes_and_trains(name):
    from lightning_vescale.dryrun._models import PresetTransformer

    cfg = _toy(name)
    model = PresetTransformer(cfg)
    got = sorted((n, tuple(p.shape)) for n, p in model.named_parameters())
    want = sorted(t for _, g in transformer_groups(cfg, "model") for t in g)
    assert got == want
    model(torch.randint(0, 100, (2, 8))).float().mean().backward()
    assert all(p.grad is not None for p in model.parameters()), "every parameter is used"


def test_toy_dry_run_world_16_both_engines():
    from lightning_vescale.dryrun import dry_run, format_report

    world, rank = 16, 5
    rep = dry_run(TOY, world_size=world, rank=rank, seq_len=32)
    assert not dist.is_initialized(), "the fake group is destroyed"
    total = sum(math.prod(s) for _, g in transformer_groups(TOY, "model") for _, s in g)
    for name in ("vescale", "fsdp2"):
        e = rep.engines[name]
        shard = e.after_step["params_sharded"]
        # fp32 master shards: 1/N of the model (plus at most the layout's padding)
        assert 4 * total / world * 0.9 <= shard <= 4 * total / world + e.padding_bytes + 4096
        assert e.after_step["grads"] == shard  # fp32 gradient shards, same layout
        assert e.after_step["optimizer_states"] >= 2 * shard  # AdamW: two fp32 moments
        assert e.after_step["params_unsharded"] == 0
        assert e.max_at_boundaries["params_unsharded"] > 0
        assert e.peak_bytes > sum(e.after_step.values())
        # one all-gather per group in forward, one per block again in backward
        assert e.collectives["all_gather"][0] == 2 * TOY.layers + 1
        assert e.collectives["reduce_scatter"][0] == TOY.layers + 1
    ours, theirs = rep.engines["vescale"], rep.engines["fsdp2"]
    assert ours.collectives["all_gather"][2] >= 2 * total  # bf16, every group at least once
    assert rep.ratio("peak_bytes") == ours.peak_bytes / theirs.peak_bytes
    text = format_report(rep)
    assert "ours/FSDP2" in text and "peak live bytes" in text


def test_dry_run_adamw8bit_runs_and_leaves_real_constants():
    """AdamW8bit's code books are computed (and cached) with real tensors under the fake mode;
    FSDP2's Shard(0) parameters are refused by it and reported as skipped."""
    from lightning_vescale.dryrun import dry_run
    from lightning_vescale.optim._quant import codebook, zero_code

    codebook.cache_clear()
    zero_code.cache_clear()
    rep = dry_run(TOY, world_size=8, rank=1, seq_len=16, optimizer="adamw8bit")
    ours = rep.engines["vescale"]
    # 8-bit moments: ~2 bytes per parameter vs the fp32 shard's 4 (small tensors stay fp32)
    assert ours.after_step["optimizer_states"] < ours.after_step["params_sharded"]
    assert "fsdp2" in rep.skipped and "Shard(dim=0)" in rep.skipped["fsdp2"]
    from torch._subclasses.fake_tensor import is_fake
    assert not is_fake(codebook(True).code)


def test_tracker_freed_storage_stays_freed_under_fake_views():
    """A view of a FakeTensor whose storage was resized to 0 grows the (meta) storage; the
    tracker shrinks it back, as a device would allocate nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_vescale.dryrun._tracker import StepTracker

    with FakeTensorMode():
        tracker = StepTracker()
        with tracker:
            base = torch.empty(1000)
            view = torch.empty(0)
            with torch.no_grad():
                view.set_(base.untyped_storage(), 0, (10,), (1,))
            assert tracker.live == 4000
            base.untyped_storage().resize_(0)
            assert tracker.live == 0
            view.detach()  # grows the meta storage to 40 bytes without the tracker
            assert base.untyped_storage().nbytes() == 0
            assert tracker.live == 0 and tracker.peak == 4000
            base.untyped_storage().resize_(4000)
            assert tracker.live == 4000


def test_accounting_counts_fake_tensor_storages():
    """The MemoryProfiler's ``account`` counts FakeTensors by their storages (once per storage)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lightning_vescale.callbacks._memory_accounting import account

    with FakeTensorMode():
        a = torch.empty(100)
        out = account(device="cpu", params_sharded=[a, a[10:20]], grads=[torch.empty(50)])
    assert out.params_sharded == 400 and out.grads == 200


def test_dry_run_errors_name_the_argument():
    from lightning_vescale.dryrun import dry_run

    with pytest.raises(ValueError, match="world_size"):
        dry_run(TOY, world_size=0)
    with pytest.raises(ValueError, match="rank"):
        dry_run(TOY, world_size=4, rank=4)
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        dry_run(TOY, world_size=4, optimizer="sgd")
    with pytest.raises(ValueError, match="replicas=3"):
        dry_run(TOY, world_size=4, replicas=3)
    with pytest.raises(ValueError, match="unknown preset"):
        dry_run("llama-7", world_size=4)


def test_cli_json_hsdp_and_hf_config(tmp_path, capsys):
    """``python -m lightning_vescale.dryrun`` on a transformers config (Llama, 2 layers) with
    an HSDP mesh of 2 replicas."""
    import transformers

    from lightning_vescale.dryrun.cli import main

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=1000)
    cfg.save_pretrained(tmp_path)
    assert main(["--hf-config", str(tmp_path), "--world-size", "8", "--replicas", "2",
                 "--seq-len", "16", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["replicas"] == 2 and set(rep["engines"]) == {"vescale", "fsdp2"}
    ours = rep["engines"]["vescale"]
    assert ours["collectives"]["all_reduce"][0] >= 3  # gradient shards across the replicas
    assert main(["--preset", "llama3-70b", "--model", "x:y", "--world-size", "2"]) == 2


def test_dry_run_is_exported_from_the_package():
    import lightning_vescale
    from lightning_vescale.dryrun import dry_run

    assert lightning_vescale.dry_run is dry_run and "dry_run" in lightning_vescale.__all__


def test_dry_run_of_a_lightning_module_built_on_meta():
    """``--model pkg.module:Class``: the planner's loader builds it on the meta device (its
    ``configure_model`` too); the dry run allocates it as FakeTensors and runs its ``.model``
    (the LightningModule has no forward of its own)."""
    from lightning_vescale.dryrun import dry_run

    rep = dry_run("examples.llama:LlamaModule", world_size=4, rank=1, seq_len=8,
                  engines=("vescale",),
                  init_args={"n_layers": 2, "dim": 64, "vocab_size": 100, "n_heads": 4,
                             "n_kv_heads": 2, "ffn_dim": 96})
    ours = rep.engines["vescale"]
    assert ours.collectives["all_gather"][0] == 5 and ours.after_step["params_sharded"] > 0


@pytest.mark.slow  # matplotlib's import and both engines: ~10 s on a busy machine
def test_cli_chart_writes_a_png_of_both_engines(tmp_path, capsys, monkeypatch):
    """``--chart out.png``: grouped bars of the report's categories (a real PNG); without
    matplotlib the CLI stops before the dry run with the extra to install."""
    from lightning_vescale.dryrun.cli import main

    small = json.dumps({"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 96,
                        "vocab": 500})
    out = tmp_path / "chart.png"
    assert main(["--preset", "llama3-70b", "--config", small, "--world-size", "4",
                 "--seq-len", "8", "--chart", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "chart:" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["--preset", "llama3-70b", "--world-size", "4", "--chart",
                 str(tmp_path / "no.png")]) == 2
    assert "lightning_vescale[plot]" in capsys.readouterr().err


@pytest.mark.slow  # both engines on a 2-layer MoE: ~10 s on a busy machine
def test_fsdp2_splits_stacked_experts_as_torchtitan_does():
    """More ranks than experts: FSDP2 runs with torchtitan's placement (``Shard(1)`` for the
    ``(E, ...)`` stacks), not ``Shard(0)``, which would leave 3 of 4 ranks a padded, empty
    chunk of each stack (4x the expert bytes per rank here) and overstate our lead."""
    import dataclasses

    from lightning_vescale.dryrun import dry_run

    cfg = dataclasses.replace(PRESETS["gpt-oss-120b"], layers=2, hidden=64, heads=4,
                              kv_heads=2, head_dim=16, ffn=96, moe_ffn=96, vocab=500, experts=8)
    rep = dry_run(cfg, world_size=32, seq_len=16)
    ours, theirs = (rep.engines[n] for n in ("vescale", "fsdp2"))
    assert theirs.after_step["params_sharded"] < 1.1 * ours.after_step["params_sharded"]
    assert theirs.padding_bytes < 0.1 * theirs.after_step["params_sharded"]


def test_fsdp2_expert_placement_only_splits_evenly():
    """FSDP2 refuses uneven ``Shard(d > 0)``: GPT-OSS's ``(128, 2880, 5760)`` stacks at 1,024
    ranks keep ``Shard(0)`` (no dim divides), DeepSeek-V3's split along dim 1."""
    from torch.distributed.tensor import Shard

    from lightning_vescale.dryrun._run import _fsdp2_placement

    def place(shape, shards):
        return _fsdp2_placement(torch.empty(shape, device="meta"), shards=shards)

    assert place((128, 2880, 5760), 1024) is None
    assert place((256, 7168, 4096), 1024) == Shard(1)
    assert place((8, 40, 192), 32) == Shard(2)
    assert place((256, 7168, 4096), 64) is None  # as many experts as shards: Shard(0) is even
    assert place((4096, 7168), 1024) is None  # not a stack
