"""DBuffer's reduce-scatter on gloo (an all-to-all plus one local sum, design note
[dbuffer-collectives]) gives bitwise what gloo's own ``reduce_scatter_tensor`` gives.

The reference is ``torch.distributed.reduce_scatter_tensor`` on a copy of the same flat input,
so any difference in summation order or in the rank slicing shows up as a bit difference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_vescale.dbuffer import DBuffer
from lightning_vescale.planner import plan_layout

SHAPES = [("w", (37, 11)), ("b", (11,)), ("e", (5, 3, 2)), ("s", ())]


def _body(reduce_dtype, op: str, async_op: bool, accumulate: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = plan_layout([(n, s, 1) for n, s in SHAPES], world)
    buf = DBuffer(plan, dtype=torch.float32, device="cpu", reduce_dtype=reduce_dtype)
    g = torch.Generator().manual_seed(100 + rank)
    # mixed magnitudes: many rounding cases for the order of the sum
    full = (torch.randn(buf.buffer_size, generator=g)
            * torch.logspace(-3, 3, buf.buffer_size)[torch.randperm(buf.buffer_size, generator=g)])
    rounds = 2 if accumulate else 1
    for _ in range(rounds):
        buf.materialize_grad()
        buf.grad_full.copy_(full)
        buf.reduce_scatter(async_op=async_op, op=op, accumulate=accumulate).wait()
        buf.free_grad()
    # reference: gloo's own reduce-scatter on the same flat input, same dtype path
    inp = full.to(reduce_dtype or torch.float32)
    ref = torch.empty(buf.shard_size, dtype=inp.dtype)
    dist.reduce_scatter_tensor(ref, inp, op=dist.ReduceOp.SUM)
    if op == "avg":
        ref = ref / world
    ref = ref.float()
    if accumulate:
        ref = ref + ref
    return {"same": torch.equal(buf.grad_shard, ref),
            "max_diff": (buf.grad_shard - ref).abs().max().item(),
            "comm": buf.memory_bytes()["comm"]}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("reduce_dtype,op,async_op,accumulate", [
    (None, "sum", False, False), (None, "avg", True, False), (torch.bfloat16, "avg", False, False),
    (None, "sum", False, True)])
def test_bitwise_equal_to_gloo_reduce_scatter(worlds, world_size, reduce_dtype, op, async_op,
                                              accumulate):
    for r in worlds(world_size).run(_body, reduce_dtype, op, async_op, accumulate):
        assert r["same"], r
        assert r["comm"] == 0, r  # the all-to-all's temporary is released


def _gloo_serves_body() -> dict:
    from lightning_vescale._dbuffer_comm import gloo_serves

    group = dist.new_group(backend="cpu:gloo,cuda:nccl") if dist.is_nccl_available() else None
    return {"cpu": gloo_serves(None, torch.device("cpu")),
            # two processes sharing one GPU over plain gloo: gloo runs the CUDA tensors too
            "cuda on gloo": gloo_serves(None, torch.device("cuda")),
            "cuda on cpu:gloo,cuda:nccl": (None if group is None
                                           else gloo_serves(group, torch.device("cuda")))}


def test_the_gloo_forms_follow_the_backend_serving_the_device(worlds):
    """The all-to-all reduce-scatter (gloo has no ``reduce_scatter_tensor`` of its own for CUDA
    tensors) is chosen by the backend that serves the buffer's device, not by ``device.type``
    (it was ``cpu`` only: CUDA tensors on gloo took gloo's missing collective)."""
    out = worlds(1).run(_gloo_serves_body)[0]
    assert out["cpu"] and out["cuda on gloo"], out
    assert out["cuda on cpu:gloo,cuda:nccl"] in (None, False), out
