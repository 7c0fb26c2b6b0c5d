"""The CUDA path's fixes that a gloo world can show (issue 28); the rest is in
``tests/unit/test_cuda_path.py`` and in ``python -m benchmarks.gpu_check``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tests.distributed._fsdp2_compat import MLP, full_params, micro, shard_mlp


def _fp16_large_body():
    from lightning_vescale.dbuffer import DBuffer
    from lightning_vescale.planner import plan_layout

    plan = plan_layout([("w", (4, 8), 1)], dist.get_world_size())
    buf = DBuffer(plan, dtype=torch.float16, device="cpu")
    buf.materialize_grad()
    buf.grad_full.fill_(40000.0)  # every rank: a sum over 2 ranks (80000) overflows fp16
    buf.reduce_scatter(op="avg")
    return buf.grad_shard.clone()


def test_fp16_reduce_scatter_does_not_overflow(worlds):
    """fp16 divides before and after the SUM (FSDP2's factors): the average of two gradients of
    40000 is 40000, not ``inf`` (SUM then divide overflowed before the fix)."""
    for shard in worlds(2).run(_fp16_large_body):
        assert torch.isfinite(shard).all(), shard
        torch.testing.assert_close(shard, torch.full_like(shard, 40000.0))


def _offload_accumulate_body():
    from lightning_vescale.fsdp import CPUOffloadPolicy

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    shard_mlp("ours", model, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        for _ in range(2):  # two synced backwards before a step: the gradients accumulate
            x = torch.randn(2 * world, 16, generator=g)
            model(micro(x)).square().mean().backward()
            ref(x).square().mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=False)  # kept (zeroed) shards: accumulate onto them
        ref_opt.zero_grad(set_to_none=False)
    on_cpu = all(p.grad.to_local().device.type == "cpu" for p in model.parameters())
    return full_params(model), {n: p.detach() for n, p in ref.named_parameters()}, on_cpu


def test_offload_with_gradient_accumulation(worlds):
    got, want, on_cpu = worlds(2).run(_offload_accumulate_body)[0]
    assert on_cpu
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


class _Event(torch.Event):
    """A stand-in for a CUDA event recorded after an optimizer step on a side stream."""

    device = torch.device("cuda")

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, stream=None) -> None:  # noqa: ANN001
        self.waits += 1


def _post_optim_event_body():
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(MLP())
    x = torch.randn(2, 16)
    model(x).sum().backward()
    event = _Event()
    model.set_post_optim_event(event)
    model(x).sum().backward()  # the root's pre-forward waits on it, then drops it
    model(x).sum().backward()
    model.set_post_optim_event(torch.Event())  # a CPU event: CPU work is ordered, not kept
    model(x).sum().backward()
    try:
        model.set_post_optim_event(3)
    except TypeError:
        return event.waits
    return "no TypeError"


def test_set_post_optim_event_is_waited_on(worlds):
    """Waited on once, at the next root pre-forward (before the fix: never)."""
    assert worlds(2).run(_post_optim_event_body) == [1, 1]


def _grad_flags_body(unnamed_hsdp: bool = False):
    from lightning_vescale._gloo_exchange import unfused

    # the accelerator path; on gloo the flags travel with the final reduce-scatters instead
    # (design note [fsdp-gloo-fusion]: tests/distributed/test_gloo_exchange.py)
    with unfused():
        return _grad_flags_run(unnamed_hsdp)


def _grad_flags_run(unnamed_hsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale.fsdp._root import get_state

    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    # a 2-D mesh without names: torch cannot flatten it, the flags go dim by dim
    kw = {"mesh": init_device_mesh("cpu", (2, 2))} if unnamed_hsdp else {}
    shard_mlp("ours", model, **kw)
    if unnamed_hsdp:
        assert get_state(model.l1).group.mesh_info.data_parallel_group is None
    x = torch.randn(2 * dist.get_world_size(), 16)
    model(micro(x)).sum().backward()
    ctx = get_state(model).ctx
    pending = ctx.pending_flags is not None  # dense: no host read of the flags
    ref(x).sum().div(dist.get_world_size()).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    model(micro(x)).sum()  # the next pre-forward finishes the all-reduce
    return pending, ctx.pending_flags is None, grads, {
        n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("world,unnamed_hsdp", [(2, False), (4, True)], ids=["fsdp", "hsdp"])
def test_dense_gradient_flags_need_no_host_sync(worlds, world, unnamed_hsdp):
    for pending, finished, grads, want in worlds(world).run(_grad_flags_body, unnamed_hsdp):
        assert pending and finished
        for name in want:
            torch.testing.assert_close(grads[name], want[name])
