"""The engine's per-step host work in its hooks, counted (never timed), so it cannot grow unnoticed.

``python -m benchmarks.hook_overhead --groups 8 64 256 --wall`` times the forward and backward
hooks and the final callback against FSDP2's on a model of many small groups (issue 36: ours
at most half of FSDP2's). These tests count what that time is made of on the same model, on
every rank of a world of 2: the Python calls of one forward + backward (``sys.setprofile``)
and the profiler labels entered while no profiler records (none: ``record_function`` cost
~5-17 us per label whether or not anyone recorded, 8 labels per group and step).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from lightning_vescale._gloo_exchange import unfused
from benchmarks.hook_overhead import _calls_body, shard_layers


@unfused()  # the hooks' own work, without the gloo exchange's (design note [gloo-fused-exchange])
def _step_calls(groups: int) -> dict:
    """Python calls of one steady-state forward + backward of ``groups`` small groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4 * world, 16, generator=g), torch.randn(4 * world, generator=g)
    x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    model = shard_layers("vescale", groups, 16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):  # the first steps record the orders and build caches
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    counts = {"calls": 0, "ours": 0, "record_function": 0}

    def prof(frame, event, arg):
        if event == "call":
            counts["calls"] += 1
            code = frame.f_code
            if "lightning_vescale" in code.co_filename:
                counts["ours"] += 1
            elif code.co_name == "__enter__" and code.co_filename.endswith(
                    "autograd/profiler.py"):
                counts["record_function"] += 1

    sys.setprofile(prof)
    try:
        model(x, y).backward()
    finally:
        sys.setprofile(None)
    opt.zero_grad()
    return counts


def _counts(worlds, groups: int) -> dict:
    results = worlds(2).run(_step_calls, groups)
    return {k: max(r[k] for r in results) for k in results[0]}


def test_hook_work_is_pinned(worlds):
    """8 groups at 2 ranks: our Python calls per forward + backward at most the pin, no
    profiler label entered without a profiler."""
    got = _counts(worlds, 8)
    assert got["record_function"] == 0, got
    assert got["ours"] <= PINNED["ours"] + SLACK, (got, PINNED)
    assert got["calls"] <= PINNED["calls"] + SLACK, (got, PINNED)


def test_hook_calls_at_most_half_of_fsdp2(worlds):
    """Issue 36's target, in the measure load does not change: our Python calls per forward +
    backward above the unsharded model's are at most half of torch's FSDP2's on the same
    model (8 small groups, 2 ranks: 0.55x before issue 36's changes, 0.30x after)."""
    for r in worlds(2).run(_calls_body, 8, 16):
        ours, fsdp2 = r["vescale"] - r["plain"], r["fsdp2"] - r["plain"]
        assert ours <= 0.5 * fsdp2, r


#: Our Python calls and all Python calls of one forward + backward, 8 small groups (torch
#: 2.13, CPU, 2 ranks, the slowest rank). Before issue 36's changes: PINNED_BEFORE. 1714 ->
#: 1724 when merged with the once-per-forward quantized-gather check (the root's post-forward
#: asks whether any gather has unread marks) and per-parameter meshes (``mesh_of``). 1724 ->
#: 1858 (17 per group) with the schedule of design note [fsdp-gloo-fusion], measured unfused:
#: each group's own all-gather issued before its prefetch and waited after, the reduce-scatter
#: asynchronous on gloo (its wait in the next group's reduce), the all-gather's queue check.
#: It bought 8 -> 4 gloo rendezvous per step of a 2-block model (benchmarks/trainer_vs_ddp).
PINNED = {"ours": 1858, "calls": 2412}
PINNED_BEFORE = {"ours": 2090, "calls": 4048}  # and 77 labels entered
#: a cache warmed by an earlier test in the same forked rank may save or cost a few calls;
#: a regression costs a call per group and parameter (tens here)
SLACK = 8
