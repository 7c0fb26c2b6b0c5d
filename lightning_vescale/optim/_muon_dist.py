"""Layer 4: Muon's orthogonalisation step: Newton–Schulz on whole matrices, sharded or not.

Steps 3-5 of design note [distributed-muon] (``muon.py``): :func:`orthogonalize` takes the
step's bf16 momentum updates (:class:`MatrixUpdate`), runs Newton–Schulz directly on matrices a
rank holds whole, and sends each sharded matrix to its owner rank (:class:`CommPlan` from
``_muon_plan.py``) with one ``all_to_all_single`` per bucket, orthogonalises it there (batched over
same-shape matrices) while the next bucket is in flight, and sends the owner's result back the
same way. It fills each update's ``result`` (this rank's part of the orthogonalised matrix) and
returns what it cost (:class:`OrthogonalizeCost`); applying the results is the optimizer's.
:func:`split_matrices` cuts a parameter's update into its matrices (one per expert of a stacked
weight, design note [muon-stacked-experts] in ``_muon_groups.py``), each with its own ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_vescale.mesh import all_to_all_single_anywhere
from lightning_vescale.optim._base import ShardLayout
from lightning_vescale.optim._muon_plan import Bucket, CommPlan, build_plan
from lightning_vescale.optim._newton_schulz import newton_schulz, newton_schulz_flops
from lightning_vescale.optim._owner_failure import StepFailures

__all__ = ["NSArgs", "MatrixUpdate", "OrthogonalizeCost", "orthogonalize", "split_matrices"]


class NSArgs(NamedTuple):
    """A Muon group's Newton–Schulz settings (matrices batch together only when equal)."""

    coefficients: tuple[float, float, float]
    steps: int
    eps: float


@dataclass(kw_only=True, eq=False)
class MatrixUpdate:
    """One Muon matrix in one step (mutable: :func:`orthogonalize` sets ``result``)."""

    param: Tensor
    update: Tensor  # bf16: flat local slice (sharded) or the whole 2-D update (local)
    rows: int
    cols: int
    lr: float
    weight_decay: float
    adjusted_lr: float
    ns_args: NSArgs  # of its group
    layout: ShardLayout | None = None  # the parameter's, when it is sharded over > 1 rank
    ranges: tuple[tuple[int, int], ...] | None = None  # with layout: each rank's range of it
    local: tuple[int, int] | None = None  # its slice of the param's flat local tensor; None: all
    result: Tensor | None = None  # bf16 NS output: local flat slice / whole matrix
    name: str = ""  # for messages: the parameter's name (and which matrix of a stack)


def split_matrices(update: Tensor, layout: ShardLayout | None, count: int, rows: int,
                   cols: int) -> list[tuple[Tensor, tuple | None, tuple[int, int] | None]]:
    """A parameter's bf16 local ``update`` as ``count`` consecutive ``rows x cols`` matrices:
    per matrix ``(its update, every shard rank's range of it, its local slice)``.

    Whole parameter (``layout`` ``None``): each update is the ``(rows, cols)`` matrix, ranges
    ``None``, and the slice ``None`` for a single matrix. Sharded: each update is this rank's
    flat part of the matrix (possibly empty), the ranges are in the matrix's own flat
    coordinates (``[k*m, (k+1)*m)`` of the tensor clipped to each rank's range).
    """
    m = rows * cols
    if layout is None:
        if count == 1:
            return [(update.reshape(rows, cols), None, None)]
        stack = update.reshape(count, rows, cols)
        return [(stack[k], None, (k * m, (k + 1) * m)) for k in range(count)]
    flat, start = update.reshape(-1), layout.start
    if count == 1:
        return [(flat, layout.ranges, None)]
    out = []
    for k in range(count):
        lo, hi = k * m, (k + 1) * m
        ranges = tuple(_clip(s, e, lo, hi) for s, e in layout.ranges)
        a, b = ranges[layout.rank]
        here = a + lo - start
        out.append((flat[here:here + b - a], ranges, (here, here + b - a)))
    return out


def _clip(start: int, end: int, lo: int, hi: int) -> tuple[int, int]:
    """``[start, end)`` intersected with ``[lo, hi)``, shifted to start at ``lo``; empty ranges
    keep a position inside ``[0, hi - lo]``."""
    s = min(max(start, lo), hi)
    return s - lo, max(min(max(end, lo), hi), s) - lo


class OrthogonalizeCost(NamedTuple):
    """What one :func:`orthogonalize` call did on this rank."""

    comm_bytes: int  # bytes sent to other ranks
    ns_flops: int  # Newton–Schulz FLOPs run here


def orthogonalize(items: Sequence[MatrixUpdate], *, plans: dict[Any, CommPlan],
                  cap_numel: int, batch: bool) -> OrthogonalizeCost:
    """Set every item's ``result`` to its part of ``newton_schulz(whole update)``.

    Args:
        items: the step's Muon matrices; sharded ones (``layout`` set) are grouped by shard
            group, and every rank of a group must pass the same parameters (with gradients).
        plans: a cache of communication plans per shard group (kept by the optimizer; an entry
            is rebuilt when its parameters, placements, shapes, bucket size or steps change).
        cap_numel: bf16 elements of whole matrices per all-to-all bucket.
        batch: run same-shape matrices as one batched Newton–Schulz call.

    A Newton–Schulz call that raises on some ranks makes every rank of the group raise the same
    ``RuntimeError`` after the last bucket (design note [owner-failure]); the caller has applied
    nothing yet, so no parameter changes.
    """
    failures = StepFailures("Muon")
    local = [it for it in items if it.ranges is None]
    outs, flops = _ns_or_zeros(failures, [it.update for it in local], local, batch)
    for it, out in zip(local, outs):
        it.result = out
    comm = 0
    by_group: dict[Any, list[MatrixUpdate]] = {}
    for it in items:
        if it.ranges is not None:
            by_group.setdefault(it.layout.mesh_info.shard_group, []).append(it)
    for group, dist_items in by_group.items():
        plan = _plan(plans, group, dist_items, cap_numel)
        cost = _orthogonalize_distributed(plan, group, dist_items, batch, failures)
        comm, flops = comm + cost.comm_bytes, flops + cost.ns_flops
    failures.raise_if_failed()
    return OrthogonalizeCost(comm_bytes=comm, ns_flops=flops)


def _ns_or_zeros(failures: StepFailures, inputs: list[Tensor], items: Sequence[MatrixUpdate],
                 batch: bool) -> tuple[list[Tensor], int]:
    """:func:`_newton_schulz_many` under ``failures`` (design note [owner-failure]): zeros of
    the inputs' shapes once this rank has failed in this step."""
    names = [it.name or f"matrix {k}" for k, it in enumerate(items[:3])]
    what = ", ".join(names) + (f" and {len(items) - 3} more" if len(items) > 3 else "")
    done = failures.run(f"in Newton–Schulz of {what}", _newton_schulz_many, inputs, items, batch)
    return done if done is not None else ([torch.zeros_like(x) for x in inputs], 0)


def _newton_schulz_many(inputs: list[Tensor], items: Sequence[MatrixUpdate],
                        batch: bool) -> tuple[list[Tensor], int]:
    """NS of each whole bf16 matrix ``inputs[k]`` (any layout of ``items[k]``'s numel), and the
    FLOPs; same-shape matrices run as one batched call when ``batch``."""
    outs: list[Tensor] = [None] * len(items)  # type: ignore[list-item]
    batches: dict[Any, list[int]] = {}
    for k, it in enumerate(items):
        key = (it.rows, it.cols, it.ns_args) if batch else k
        batches.setdefault(key, []).append(k)
    flops = 0
    for ks in batches.values():
        first = ks[0]
        it, ns = items[first], items[first].ns_args
        if len(ks) == 1:
            outs[first] = newton_schulz(inputs[first].view(it.rows, it.cols), ns.coefficients,
                                        ns.steps, ns.eps)
        else:
            stacked = torch.stack([inputs[k].view(it.rows, it.cols) for k in ks])
            for k, o in zip(ks, newton_schulz(stacked, ns.coefficients, ns.steps,
                                              ns.eps).unbind(0)):
                outs[k] = o
        flops += len(ks) * newton_schulz_flops(it.rows, it.cols, ns.steps)
    return outs, flops


def _plan(plans: dict[Any, CommPlan], group: Any, items: Sequence[MatrixUpdate],
          cap_numel: int) -> CommPlan:
    info = items[0].layout.mesh_info
    steps = items[0].ns_args.steps
    key = (tuple((id(it.param), it.rows, it.cols, it.ranges) for it in items), cap_numel, steps)
    plan = plans.get(group)
    if plan is None or plan.key != key:
        rank, world = info.shard_rank, info.shard_size
        if dist.get_rank(group) != rank:  # pragma: no cover - exotic mesh orders
            raise ValueError(f"mesh coordinate {rank} differs from its process-group rank "
                             f"{dist.get_rank(group)}; build the mesh with ranks in order")
        plan = build_plan(key, [(it.rows, it.cols) for it in items],
                          [it.ranges for it in items], rank, world, steps, cap_numel)
        plans[group] = plan
    return plan


def _orthogonalize_distributed(plan: CommPlan, group: Any, items: Sequence[MatrixUpdate],
                               batch: bool, failures: StepFailures) -> OrthogonalizeCost:
    rank, world = plan.rank, plan.world_size
    dtype, device = torch.bfloat16, items[0].update.device
    mesh = items[0].layout.mesh_info.mesh  # offloaded (CPU) updates travel via its device
    comm, flops = 0, 0

    def launch_gather(b: Bucket):
        nonlocal comm
        send = [items[i].update for d in range(world) for i in b.items if plan.owners[i] == d]
        send_t = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(b.to_owner_recv), dtype=dtype, device=device)
        comm += 2 * (sum(b.to_owner_send) - b.to_owner_send[rank])
        work = all_to_all_single_anywhere(recv, send_t, list(b.to_owner_recv),
                                          list(b.to_owner_send), group=group, mesh=mesh,
                                          async_op=True)
        return work, recv

    def finish_scatter(b: Bucket, work, recv: Tensor) -> None:
        work.wait()
        off, marks = 0, []
        for s in range(world):  # chunks from owner s: its marker, my slices of its matrices
            marks.append(recv[off:off + 1])
            off += 1
            for i in b.items:
                if plan.owners[i] == s:
                    n = plan.numel(i, rank)
                    items[i].result = recv[off:off + n]
                    off += n
        failures.note(group, torch.cat(marks))  # design note [owner-failure]

    pending_scatter = None
    gather = launch_gather(plan.buckets[0]) if plan.buckets else None
    # Matrices one rank holds whole: orthogonalised there while the first bucket moves.
    for i in sorted(set(plan.whole) - set(plan.local_owned)):
        items[i].result = items[i].update  # this rank holds none of it: nothing to apply
    outs, ns_flops = _ns_or_zeros(failures, [items[i].update for i in plan.local_owned],
                                  [items[i] for i in plan.local_owned], batch)
    flops += ns_flops
    for i, o in zip(plan.local_owned, outs):
        items[i].result = o.reshape(-1)
    for k, b in enumerate(plan.buckets):
        work, recv = gather
        work.wait()
        if k + 1 < len(plan.buckets):  # overlap: next bucket moves while NS runs here
            gather = launch_gather(plan.buckets[k + 1])
        full: dict[int, Tensor] = {}
        offs = [0] * world  # per source: running offset inside its chunk
        starts = [sum(b.to_owner_recv[:s]) for s in range(world)]
        for i in b.owned:
            pieces = []
            for s in range(world):
                n = plan.numel(i, s)
                pieces.append(recv[starts[s] + offs[s]: starts[s] + offs[s] + n])
                offs[s] += n
            tp = items[i].layout.tp  # design note [tp-matrix-optim]: pieces in virtual order
            full[i] = tp.gather(pieces, plan.ranges[i]) if tp is not None else torch.cat(pieces)
        outs, ns_flops = _ns_or_zeros(failures, [full[i] for i in b.owned],
                                      [items[i] for i in b.owned], batch)
        flops += ns_flops
        results = {i: _virtual(items[i], o.reshape(-1)) for i, o in zip(b.owned, outs)}
        send, mark = [], failures.marker(recv)
        for d in range(world):
            send.append(mark)  # one marker per destination: design note [owner-failure]
            for i in b.owned:
                s_, e_ = plan.ranges[i][d]
                send.append(results[i][s_:e_])
        send_t = torch.cat(send)
        recv_back = torch.empty(sum(b.to_owner_send) + world, dtype=dtype, device=device)
        comm += 2 * (sum(b.to_owner_recv) - b.to_owner_recv[rank])
        work_back = all_to_all_single_anywhere(recv_back, send_t,
                                               [n + 1 for n in b.to_owner_send],
                                               [n + 1 for n in b.to_owner_recv], group=group,
                                               mesh=mesh, async_op=True)
        if pending_scatter is not None:
            finish_scatter(*pending_scatter)
        pending_scatter = (b, work_back, recv_back)
    if pending_scatter is not None:
        finish_scatter(*pending_scatter)
    return OrthogonalizeCost(comm_bytes=comm, ns_flops=flops)


def _virtual(item: MatrixUpdate, flat: Tensor) -> Tensor:
    """An owner's result in the flat order its ranges use (a TP parameter's virtual order:
    design note [tp-matrix-optim]); the matrix's own row-major order otherwise."""
    tp = item.layout.tp if item.layout is not None else None
    return tp.from_global(flat) if tp is not None else flat
