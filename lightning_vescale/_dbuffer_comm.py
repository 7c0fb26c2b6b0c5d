"""Layer 2: the handles and collective forms behind :class:`~lightning_vescale.dbuffer.DBuffer`.

Split out of ``dbuffer`` (one responsibility each): :class:`CommHandle` (what every DBuffer
collective returns), the flat collectives' names, and the gloo SUM reduce-scatter as an
all-to-all plus one local sum (design note [dbuffer-collectives] in ``dbuffer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

if TYPE_CHECKING:
    from lightning_vescale.mesh import MeshInfo
    from lightning_vescale.planner import LayoutPlan

__all__ = ["CommHandle", "gloo_reduce_scatter_sum", "group_rank_and_size",
           "wire_all_reduce_sum"]


class _Finished:
    """A work-like object whose ``wait()`` runs ``finish`` once (a collective plus its local
    completion, e.g. the sum after gloo's all-to-all reduce-scatter)."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return True


class CommHandle:
    """Handle of a (possibly asynchronous) DBuffer collective; :meth:`wait` is idempotent."""

    __slots__ = ("_work", "_epilogue", "_done")

    def __init__(self, work: Any, epilogue: Callable[[], None] | None = None) -> None:
        self._work = work
        self._epilogue = epilogue
        self._done = False

    def wait(self) -> None:
        """Block until the collective finished and its buffer epilogue ran."""
        if self._done:
            return
        if self._work is not None:
            with record_function("vescale::comm_wait"):  # waiting, not engine work
                self._work.wait()
        self._work = None
        if self._epilogue is not None:
            epilogue, self._epilogue = self._epilogue, None
            epilogue()
        self._done = True


# torch >= 2.13 names the flat collectives ``*_single`` (the old names warn as deprecated).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _resolve_op(op: str | dist.ReduceOp) -> dist.ReduceOp:
    if isinstance(op, str):
        table = {"avg": dist.ReduceOp.AVG, "mean": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}
        if op.lower() not in table:
            raise ValueError(f"op={op!r} is not supported; use 'avg' or 'sum'")
        return table[op.lower()]
    return op


def gloo_reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, *, rank: int, world_size: int,
                            group: Any, async_op: bool,
                            release: Callable[[], None]) -> _Finished | None:
    """``out = sum over ranks of inp[rank slice]`` as an all-to-all plus one local sum (the
    fast form on gloo, design note [dbuffer-collectives]). Returns a work whose ``wait()``
    also sums (``None`` when ``async_op`` is false: done); ``inp`` must stay unchanged until
    then. ``release`` runs once the input-sized temporary is no longer needed. When ``out`` is
    wider than ``inp`` (a wire dtype), the sum is taken in ``out``'s dtype."""
    W = world_size
    S = out.numel()
    received = torch.empty(W * S, dtype=inp.dtype, device=inp.device)
    work = dist.all_to_all_single(received, inp, group=group, async_op=True)

    # gloo's ring order for this rank's slice: x[r-1] + x[r-2] + ... + x[r] (measured;
    # any order is a correct sum, this one keeps the bits of gloo's own reduce-scatter)
    order = [(rank - k) % W for k in range(1, W)] + [rank]

    def finish() -> None:
        work.wait()
        parts = received.view(W, S)
        if out.dtype == inp.dtype:
            torch.add(parts[order[0]], parts[order[1]], out=out)
        else:  # a narrower wire dtype: every partial sum in out's (wider) dtype
            out.copy_(parts[order[0]]).add_(parts[order[1]])
        for k in order[2:]:
            out.add_(parts[k])
        release()

    if not async_op:
        finish()
        return None
    return _Finished(finish)


def group_rank_and_size(plan: "LayoutPlan", mesh_info: "MeshInfo | None", *, is_meta: bool,
                        name: str) -> tuple[int, int]:
    """This rank's index and the group size; the plan must be for that many ranks."""
    if mesh_info is not None:
        rank, size = mesh_info.shard_rank, mesh_info.shard_size
    elif dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        rank, size = 0, 1
    if is_meta:  # planned without storage: no collective will run
        size = plan.world_size
    elif mesh_info is None and not dist.is_initialized() and plan.world_size != 1:
        raise ValueError(
            f"DBuffer {name!r}: plan.world_size={plan.world_size} needs an initialised "
            "process group; call torch.distributed.init_process_group first."
        )
    if plan.world_size != size:
        raise ValueError(
            f"DBuffer {name!r}: plan.world_size={plan.world_size} does not match the "
            f"process group size {size}; plan with world_size={size}."
        )
    return rank, size


def wire_all_reduce_sum(out: torch.Tensor, wire: torch.dtype, *, group: Any, size: int,
                        async_op: bool) -> _Finished | None:
    """``out`` (fp32) summed over the ``size`` ranks of ``group``, moving ``wire``-dtype bytes
    and adding in ``out``'s dtype: an all-to-all of ``out`` cast to ``wire`` (each rank gets its
    ``1/size`` chunk from every rank), a local sum, then an all-gather of the summed chunks in
    ``wire``. The same bytes as a ring all-reduce in ``wire``; the total is rounded to ``wire``
    once instead of every partial sum (HSDP's replica stage with a ``reduce_scatter_dtype``).
    Returns a work whose ``wait()`` finishes it (``None`` when ``async_op`` is false: done)."""
    n = out.numel()
    chunk = -(-n // size)
    send = torch.zeros(size * chunk, dtype=wire, device=out.device)
    send[:n].copy_(out)
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received, send, group=group, async_op=True)

    def finish() -> None:
        work.wait()
        parts = received.view(size, chunk)
        total = parts[0].to(out.dtype)
        for k in range(1, size):
            total.add_(parts[k])
        gathered = torch.empty_like(send)
        _all_gather_flat(gathered, total.to(wire), group=group)
        out.copy_(gathered[:n])

    if not async_op:
        finish()
        return None
    return _Finished(finish)

