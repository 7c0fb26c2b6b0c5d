"""Stacked experts through the rest of the stack: FlatParamOptimizer, sharding_summary, the
MemoryProfiler's accounting and AdamW8bit's blocks, on ``examples/moe.py``'s MoE GPT sharded by
the strategies' path with experts whole (``granularity={"*.experts.*": "matrix"}``) at 3 ranks
(6 experts over 3 ranks; the dense tensors 256-aligned; the experts in a DBuffer of their own,
design note [plan-buckets]).

References: the flat optimizer step equals the per-parameter ``torch.optim.AdamW`` step bitwise
(design note [flat-params]); both equal one process training the same model on the same batch
within reduction-order noise (``atol=1e-4``: data parallel averages 3 equal gradients, and
AdamW turns the noise-only gradient of the attention key bias, ~0 in exact arithmetic, into
updates up to ~1e-5 after 2 steps at ``lr=1e-2``); the
summary's and the profiler's figures are checked against the layouts themselves.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from examples.moe import MoEConfig, MoEGPT
from lightning_vescale.fsdp import iter_param_groups
from lightning_vescale.sharding_summary import sharding_summary
from lightning_vescale._lightning.sharding import ShardGranularity, parse_granularity, shard_model
from lightning_vescale.callbacks._memory_accounting import account, collect_training_tensors
from lightning_vescale.mesh import init_mesh
from lightning_vescale.optim import AdamW8bit, flat_param_optimizer
from lightning_vescale.optim._base import param_layout

CFG = MoEConfig(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=32, n_expert=6,
                top_k=2, expert_ffn=32)
EXPERT_SIZES = {2048, 1024}  # w_in (64, 32) and w_out (32, 32) per expert


def _model(sharded: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MoEGPT(CFG)
    if sharded:
        policy = ShardGranularity(granularity=parse_granularity({"*.experts.*": "matrix"}),
                                  optimizer_block_size=256, min_block_numel=4096)
        shard_model(model, units=None, mesh=init_mesh("cpu", dist.get_world_size()),
                    device=torch.device("cpu"), mp_policy=None, granularity=policy,
                    reshard_after_forward=True)
    return model


def _train(model, opt, steps=2):
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _flat_equals_per_param_and_one_process():
    flat_model, plain_model = _model(True), _model(True)
    assert sum(len(g.buffers) == 2 for _, g in iter_param_groups(flat_model)) == CFG.n_layer
    flat = _train(flat_model, flat_param_optimizer(torch.optim.AdamW(flat_model.parameters(),
                                                                     lr=1e-2)))
    plain = _train(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-2))
    reference = _model(False)
    ref = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    for n in ref:
        assert torch.equal(flat[n], plain[n]), n
        torch.testing.assert_close(flat[n], ref[n], atol=1e-4, rtol=1e-5,
                                   msg=lambda m, n=n: f"{n}: {m}")
    return True


def _summary_and_accounting():
    model = _model(True)
    summary = sharding_summary(model)
    world = dist.get_world_size()
    expert_grans = {size for g in summary.groups for size, _ in g.granularities}
    assert EXPERT_SIZES <= expert_grans, expert_grans
    # at 3 ranks the experts have a DBuffer of their own ([plan-buckets]); the summary lists both
    split = [g for g in summary.groups if g.buffers]
    assert len(split) == CFG.n_layer and all(
        [b.name for b in g.buffers] == ["[torch.float32]", "[torch.float32, matrix]"]
        for g in split), str(summary)
    assert sum(summary.rank_elements) == summary.elements
    total = sum(p.numel() for p in model.parameters())
    assert summary.elements == total
    # every expert lies whole on one rank, and the profiler counts exactly the local shards
    local = 0
    for name, p in model.named_parameters():
        layout = param_layout(p, where=name)
        if ".experts." in name:
            unit = p.shape[-2] * p.shape[-1]
            assert all(a % unit == 0 and b % unit == 0 for a, b in layout.ranges), name
        local += p.to_local().numel()
    opt = AdamW8bit(model.parameters())  # blocks never straddle experts (1024 | 2048 | 256)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size))
    model(x, x).backward()
    opt.step()
    tensors = collect_training_tensors([model], [opt])
    breakdown = account(device="cpu", **tensors)
    assert breakdown.params_sharded == local * 4
    assert summary.rank_elements[dist.get_rank()] == local
    return breakdown.optimizer_states, world


@pytest.mark.parametrize("world", [3])
def test_flat_param_optimizer_on_stacked_experts(worlds, world):
    assert worlds(world).run(_flat_equals_per_param_and_one_process) == [True] * world


@pytest.mark.parametrize("world", [3])
def test_summary_profiler_and_8bit_states_on_stacked_experts(worlds, world):
    results = worlds(world).run(_summary_and_accounting)
    assert all(states > 0 for states, _ in results)
