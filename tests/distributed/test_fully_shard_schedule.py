"""The schedule: prefetching (recorded on the first iteration, used from the second), the
backward prefetch never re-gathering a group that finished its backward, the iteration
boundary (an extra forward in between costs nothing), and the profiler labels of every hook
and collective."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lightning_vescale._gloo_exchange import unfused
from tests.distributed._fully_shard_helpers import (
    assert_params_match_reference,
    batches,
    build,
    local_pieces,
    micro,
    shard,
    train_step,
)


# -- prefetch ------------------------------------------------------------------------------------
@unfused()  # the schedule's collectives one by one (design note [gloo-fused-exchange])
def _prefetch_body():
    from lightning_vescale.fsdp import get_state

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    shard(model)
    calls = []
    for i, b in enumerate(model.blocks):
        g = get_state(b).group
        orig = g.unshard

        def spy(async_op=False, _orig=orig, _i=i):
            calls.append((_i, async_op, g.is_unsharded))
            return _orig(async_op=async_op)
        g.unshard = spy
    x, y = batches("gpt", 1, 2 * world)[0]
    step_calls = []
    for _ in range(2):
        calls.clear()
        model(micro(x, rank, world), micro(y, rank, world)).backward()
        step_calls.append([(i, a) for i, a, _ in calls])
    root = get_state(model).ctx
    order = [type(s.module).__name__ for s in root.forward_order]
    return step_calls, order, len(root.backward_order)


def test_prefetch_after_first_iteration(worlds):
    step_calls, order, nbwd = worlds(2).run(_prefetch_body)[0]
    assert order[0].endswith("GPT") and order[1:] == ["VeScaleFSDPBlock"] * 2
    assert nbwd == 3
    assert not any(a for _, a in step_calls[0])  # first iteration records, no prefetch
    # second iteration: block 1 is prefetched in forward (while block 0 computes) and block 0 in
    # backward (while block 1 computes)
    assert (1, True) in step_calls[1] and (0, True) in step_calls[1]


# -- backward prefetch skips groups already through their backward -----------------------------


class InputRoot(nn.Module):
    """The root group owns only the input layer, so all its gradients arrive last."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inp(x))


@unfused()  # the schedule's collectives one by one (design note [gloo-fused-exchange])
def _allgathers_per_step_body(steps):
    from lightning_vescale.fsdp import fully_shard
    from lightning_vescale.testing import CopyCommCounter

    torch.manual_seed(0)
    model = InputRoot()
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    x = torch.randn(4, 16)
    counts = []
    for _ in range(steps):
        with CopyCommCounter() as c:
            model(x).sum().backward()
        model.zero_grad()
        counts.append(c.by_op.get("c10d._allgather_base_", 0))
    return counts, len(model.blocks)


def test_backward_prefetch_skips_groups_already_done(worlds):
    for counts, n_blocks in worlds(2).run(_allgathers_per_step_body, 3):
        # forward: the root + every block; backward: every block again (the root stays
        # gathered). The root's gradients arrive at the very end of backward; their prefetch
        # must not re-gather a block that already finished its backward. From the second step
        # on (the forward order is recorded) the last block keeps its parameters from its
        # forward to its backward, which comes first: one all-gather less.
        assert counts == [1 + 2 * n_blocks] + [2 * n_blocks] * 2, counts


# -- an evaluation between training steps ------------------------------------------------------


def _extra_forward_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = build("gpt"), build("gpt")
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches("gpt", 2, 2 * world):
        with torch.no_grad():
            model(micro(x, rank, world), micro(y, rank, world))  # an evaluation in between
        train_step(model(micro(x, rank, world), micro(y, rank, world)), opt)
        train_step(ref(x, y), ref_opt)
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


def test_parity_still_holds_after_an_extra_forward(worlds):
    """The reshard at the root's pre-forward costs nothing in a normal loop: same parameters."""
    res = worlds(2).run(_extra_forward_body)
    assert_params_match_reference(res, rtol=1e-4, atol=1e-5)


# -- profiler labels ------------------------------------------------------------------------------
#: Labels one training step must show (design note [fsdp-profiling]).
STEP_LABELS = {
    "vescale::lazy_init", "vescale::root_pre_forward", "vescale::pre_forward",
    "vescale::post_forward", "vescale::pre_backward", "vescale::grad_arrival",
    "vescale::post_backward", "vescale::post_backward_final_callback",
    "vescale::grad_flags_all_reduce", "vescale::all_gather", "vescale::reduce_scatter",
}


def _profiled_step_body():
    from torch.profiler import ProfilerActivity, profile

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    shard(model)
    x, y = batches("gpt", 1, 2 * world)[0]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(micro(x, rank, world), micro(y, rank, world)).backward()
    return sorted({e.key for e in prof.key_averages() if e.key.startswith("vescale::")})


def test_profiler_shows_every_hook_and_collective(worlds):
    for labels in worlds(2).run(_profiled_step_body):
        assert STEP_LABELS <= set(labels), sorted(STEP_LABELS - set(labels))
