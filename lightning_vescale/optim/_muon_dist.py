"""Layer 4: Muon's orthogonalisation step: Newton–Schulz on whole matrices, sharded or not.

Steps 3-5 of design note [distributed-muon] (``muon.py``): :func:`orthogonalize` takes the
step's bf16 momentum updates (:class:`MatrixUpdate`), runs Newton–Schulz directly on matrices a
rank holds whole, and sends each sharded matrix to its owner rank (:class:`CommPlan` from
``_muon_plan.py``) with one ``all_to_all_single`` per bucket, orthogonalises it there (batched over
same-shape matrices) while the next bucket is in flight, and sends the owner's result back the
same way. It fills each update's ``result`` (this rank's part of the orthogonalised matrix) and
returns what it cost (:class:`OrthogonalizeCost`); applying the results is the optimizer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_vescale.optim._base import ShardLayout
from lightning_vescale.optim._muon_plan import Bucket, CommPlan, build_plan
from lightning_vescale.optim._newton_schulz import newton_schulz, newton_schulz_flops

__all__ = ["NSArgs", "MatrixUpdate", "OrthogonalizeCost", "orthogonalize"]


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
    result: Tensor | None = None  # bf16 NS output: local flat slice / whole matrix


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
    """
    local = [it for it in items if it.layout is None]
    outs, flops = _newton_schulz_many([it.update for it in local], local, batch)
    for it, out in zip(local, outs):
        it.result = out
    comm = 0
    by_group: dict[Any, list[MatrixUpdate]] = {}
    for it in items:
        if it.layout is not None:
            by_group.setdefault(it.layout.mesh_info.shard_group, []).append(it)
    for group, dist_items in by_group.items():
        plan = _plan(plans, group, dist_items, cap_numel)
        cost = _orthogonalize_distributed(plan, group, dist_items, batch)
        comm, flops = comm + cost.comm_bytes, flops + cost.ns_flops
    return OrthogonalizeCost(comm_bytes=comm, ns_flops=flops)


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
    key = (tuple(id(it.param) for it in items), tuple(it.param.placements for it in items),
           tuple(tuple(it.param.shape) for it in items), cap_numel, steps)
    plan = plans.get(group)
    if plan is None or plan.key != key:
        rank, world = info.shard_rank, info.shard_size
        if dist.get_rank(group) != rank:  # pragma: no cover - exotic mesh orders
            raise ValueError(f"mesh coordinate {rank} differs from its process-group rank "
                             f"{dist.get_rank(group)}; build the mesh with ranks in order")
        plan = build_plan(key, [(it.rows, it.cols) for it in items],
                          [it.layout.ranges for it in items], rank, world, steps, cap_numel)
        plans[group] = plan
    return plan


def _orthogonalize_distributed(plan: CommPlan, group: Any, items: Sequence[MatrixUpdate],
                               batch: bool) -> OrthogonalizeCost:
    rank, world = plan.rank, plan.world_size
    dtype, device = torch.bfloat16, items[0].update.device
    comm, flops = 0, 0

    def launch_gather(b: Bucket):
        nonlocal comm
        send = [items[i].update for d in range(world) for i in b.items if plan.owners[i] == d]
        send_t = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(b.to_owner_recv), dtype=dtype, device=device)
        comm += 2 * (sum(b.to_owner_send) - b.to_owner_send[rank])
        work = dist.all_to_all_single(recv, send_t, list(b.to_owner_recv),
                                      list(b.to_owner_send), group=group, async_op=True)
        return work, recv

    def finish_scatter(b: Bucket, work, recv: Tensor) -> None:
        work.wait()
        off = 0
        for s in range(world):  # chunks from owner s: my slices of its matrices, in order
            for i in b.items:
                if plan.owners[i] == s:
                    n = plan.numel(i, rank)
                    items[i].result = recv[off:off + n]
                    off += n

    pending_scatter = None
    gather = launch_gather(plan.buckets[0]) if plan.buckets else None
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
            full[i] = torch.cat(pieces)
        outs, ns_flops = _newton_schulz_many([full[i] for i in b.owned],
                                             [items[i] for i in b.owned], batch)
        flops += ns_flops
        results = {i: o.reshape(-1) for i, o in zip(b.owned, outs)}
        send = []
        for d in range(world):
            for i in b.owned:
                s_, e_ = plan.ranges[i][d]
                send.append(results[i][s_:e_])
        send_t = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
        recv_back = torch.empty(sum(b.to_owner_send), dtype=dtype, device=device)
        comm += 2 * (sum(b.to_owner_recv) - b.to_owner_recv[rank])
        work_back = dist.all_to_all_single(recv_back, send_t, list(b.to_owner_send),
                                           list(b.to_owner_recv), group=group, async_op=True)
        if pending_scatter is not None:
            finish_scatter(*pending_scatter)
        pending_scatter = (b, work_back, recv_back)
    if pending_scatter is not None:
        finish_scatter(*pending_scatter)
    return OrthogonalizeCost(comm_bytes=comm, ns_flops=flops)
