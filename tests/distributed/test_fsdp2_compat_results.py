"""FSDP2 behaviours whose results were wrong (issue 15, items 1-4): each case runs on torch's
FSDP2 (the reference side) and on ``lightning_vescale.fsdp``, and against a single process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.distributed._fsdp2_compat import IMPLS, MLP, full_grads, micro, shard_mlp


# -- 1. gradient accumulation without sync: summed in reduce_dtype (fp32), not in bf16 ------------
def _accumulate_body(impl: str, n_micro: int):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model).to(torch.bfloat16)  # what every rank computes in
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_mlp(impl, model, mp_policy=mp)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4 * world, 16, generator=g) * 3 for _ in range(n_micro)]
    for i, x in enumerate(xs):
        model.set_requires_gradient_sync(i == n_micro - 1)
        model(micro(x)).float().square().mean().backward()
    got = full_grads(model)
    # Single process: every rank's bf16 micro-batch gradient, summed in fp32, averaged over ranks.
    want = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    b = xs[0].shape[0] // world
    for x in xs:
        for r in range(world):
            ref.zero_grad()
            ref(x[r * b:(r + 1) * b].to(torch.bfloat16)).float().square().mean().backward()
            for n, p in ref.named_parameters():
                want[n] += p.grad.float() / world
    return got, want


@pytest.mark.parametrize("impl", IMPLS)
def test_no_sync_accumulation_sums_in_reduce_dtype(worlds, impl):
    got, want = worlds(2).run(_accumulate_body, impl, 8)[0]
    for n in want:
        assert got[n].dtype == torch.float32
        # fp32 summation order differs from the reference: 1e-5; bf16 accumulation: ~1e-3
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{impl} {n}")
