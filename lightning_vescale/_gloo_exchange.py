"""Layer 2: a process group's small gloo collectives, fused into one all-to-all.

Design note [gloo-fused-exchange]
---------------------------------
On gloo every collective is a rendezvous: a tiny all-gather, all-to-all or all-reduce between
two ranks costs 0.25-0.55 ms on the project's 2-core VM however few its bytes (after a barrier,
median of 100 calls), and each one also makes the rank that arrives first wait for the other.
A model sharded into one group per block issues several per step (all-gathers forward and
backward, a reduce-scatter per group, the gradient-flag all-reduce), where DDP issues one
bucketed all-reduce: at toy sizes that count, not the bytes, set the step time
(``benchmarks/RESULTS_trainer_vs_ddp.md``: 8 collectives per step against DDP's 2).

So on gloo a DBuffer collective of at most :data:`FUSE_MAX_BYTES` (DDP's first bucket) is not
issued when it is submitted: it is queued on its process group, and the queue is issued as ONE
``all_to_all_single`` (bytes, uneven splits; each rank sends every other rank the pieces that
rank needs, 16-byte aligned) the first time one of its handles is waited. What each kind sends
and does with what it receives:

* all-gather: its shard to every rank; the received shards are copied into their slots of the
  full buffer (the own slot from the shard);
* SUM reduce-scatter: rank ``r``'s slice of the input to rank ``r``; the received slices and the
  own one are summed in gloo's ring order, as :func:`gloo_reduce_scatter_sum` does, so the
  result is bitwise the unfused one;
* MAX all-reduce (the gradient flags): the tensor to every rank; the maximum is taken locally.

A queue holding a single operation issues that operation's own form instead (no copies), so a
step that never has two collectives pending pays nothing. Larger operations are issued at once
(the bytes, not the rendezvous, dominate them, and they keep their overlap with compute); they
may overtake queued ones, which is safe because every rank submits and waits in the same program
order, as for any collective: the engine never waits a queued handle on one rank only (the
gradient flags are waited on every rank in the root's final callback when they are fused, design
note [fsdp-gloo-fusion] in ``fsdp/_root.py``).

What the engine does so that operations meet in the queue (design note [fsdp-gloo-fusion] in
``fsdp/_root.py``): the forward prefetch gathers small groups ahead within one exchange's bytes,
``auto`` resharding keeps the small groups at the end of the forward gathered into backward,
queued reduce-scatters stay in flight together, and the final callback issues the remaining
reduce-scatters and the flags before waiting for any. A 2-block model then needs 2 exchanges
per step instead of 8. Results are bitwise those of the unfused collectives
(``tests/distributed/test_gloo_exchange.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning_vescale._labels import label

__all__ = ["FUSE_MAX_BYTES", "FusedWork", "fusable", "ring_sum_", "submit_all_gather",
           "submit_max_all_reduce", "submit_reduce_scatter_sum", "unfused"]

#: An operation of at most this many bytes (on this rank's side of the wire) is queued to be
#: fused; DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``) for the same
#: reason: below it, latency, not bandwidth, is the cost.
FUSE_MAX_BYTES = 1 << 20
#: A queue that would grow past this many bytes is issued first (bounds the fused temporaries).
_QUEUE_MAX_BYTES = 4 << 20
_ALIGN = 16


def fusable(nbytes: int) -> bool:
    """Whether an operation moving ``nbytes`` is queued (design note [gloo-fused-exchange])."""
    return nbytes <= FUSE_MAX_BYTES


@contextlib.contextmanager
def unfused() -> Iterator[None]:
    """Inside, nothing is queued: every collective leaves on its own, as on an accelerator
    (tests of the accelerator paths on gloo, and the unfused reference of a comparison)."""
    global FUSE_MAX_BYTES
    saved, FUSE_MAX_BYTES = FUSE_MAX_BYTES, -1
    try:
        yield
    finally:
        FUSE_MAX_BYTES = saved


@dataclasses.dataclass(eq=False)
class _Op:
    """One queued collective: the tensor it sends each rank (``None``: nothing, e.g. itself),
    how many elements of ``dtype`` it receives from each, how it finishes with the received
    parts (``None`` where nothing came), and how it runs alone (a work whose ``wait`` also
    finishes it)."""

    sends: list[torch.Tensor | None]
    recv_numel: list[int]
    dtype: torch.dtype
    finish: Callable[[list[torch.Tensor | None]], None]
    alone: Callable[[], Any]
    nbytes: int
    batch: _Batch | None = None
    work: Any = None  # set when issued alone


class _Batch:
    """Queued operations issued as one all-to-all; waited once, each operation finished once."""

    def __init__(self, ops: list[_Op], group: Any) -> None:
        self.ops = ops
        W = len(ops[0].sends)
        # what goes to rank r: every operation's piece for r, in queue order, 16-byte aligned
        pieces: list[torch.Tensor] = []
        in_splits = []
        for r in range(W):
            n_in = 0
            for op in ops:
                piece = op.sends[r]
                if piece is not None and piece.numel():
                    b = piece.reshape(-1).view(torch.uint8)
                    pad = -b.numel() % _ALIGN
                    pieces += [b, b.new_zeros(pad)] if pad else [b]
                    n_in += b.numel() + pad
            in_splits.append(n_in)
        # what comes from rank r: the same, so operation i's part from r is at offsets[i][r]
        self.offsets: list[list[tuple[int, int] | None]] = [[] for _ in ops]
        out_splits, pos = [], 0
        for r in range(W):
            start = pos
            for i, op in enumerate(ops):
                nb = op.recv_numel[r] * op.dtype.itemsize
                self.offsets[i].append((pos, nb) if nb else None)
                pos += nb + (-nb % _ALIGN)
            out_splits.append(pos - start)
        self.send = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
        self.recv = torch.empty(pos, dtype=torch.uint8, device=self.send.device)
        with label("vescale::fused_exchange"):
            self.work = dist.all_to_all_single(self.recv, self.send, out_splits, in_splits,
                                               group=group, async_op=True)

    def wait(self) -> None:
        if self.work is not None:
            with label("vescale::comm_wait"):
                self.work.wait()
            self.work = None
            self.send = None  # type: ignore[assignment]

    def parts_of(self, op: _Op) -> list[torch.Tensor | None]:
        i = next(i for i, o in enumerate(self.ops) if o is op)
        return [None if o is None else self.recv[o[0]:o[0] + o[1]].view(op.dtype)
                for o in self.offsets[i]]


class _Queue:
    """The operations of one process group submitted and not yet issued, in program order."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.ops: list[_Op] = []
        self.nbytes = 0

    def add(self, op: _Op) -> None:
        if self.ops and self.nbytes + op.nbytes > _QUEUE_MAX_BYTES:
            self.issue()
        self.ops.append(op)
        self.nbytes += op.nbytes

    def issue(self) -> None:
        ops, self.ops, self.nbytes = self.ops, [], 0
        if not ops:
            return
        if len(ops) == 1:  # alone: its own collective, no copies
            ops[0].work = ops[0].alone()
            return
        batch = _Batch(ops, self.group)
        for op in ops:
            op.batch = batch


_QUEUES: dict[int, _Queue] = {}


def _queue(group: Any) -> _Queue:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    q = _QUEUES.get(id(pg))
    if q is None or q.group is not pg:  # a new group at a dead one's address: a fresh queue
        q = _QUEUES[id(pg)] = _Queue(pg)
    return q


class FusedWork:
    """The work of a submitted operation: ``wait()`` issues its queue if it is still queued,
    waits for the exchange (or the operation's own collective) and finishes the operation."""

    def __init__(self, op: _Op, queue: _Queue) -> None:
        self._op: _Op | None = op
        self._queue = queue

    def wait(self) -> bool:
        op, self._op = self._op, None
        if op is None:
            return True
        if op.batch is None and op.work is None:
            self._queue.issue()  # this operation is still queued: issue all of them now
        if op.work is not None:  # issued alone: its own work finishes it
            op.work.wait()
            return True
        batch, op.batch = op.batch, None  # no cycle left: the batch's buffers go with its ops
        assert batch is not None
        batch.wait()
        op.finish(batch.parts_of(op))
        return True


def _submit(op: _Op, group: Any) -> FusedWork:
    q = _queue(group)
    q.add(op)
    return FusedWork(op, q)


# -- the three kinds ------------------------------------------------------------------------------
def submit_all_gather(full: torch.Tensor, inp: torch.Tensor, *, rank: int, world_size: int,
                      group: Any, alone: Callable[[], Any]) -> FusedWork:
    """``full = cat of every rank's inp`` (in rank order), queued; ``alone()`` issues the
    unfused all-gather (a work)."""
    W, S = world_size, inp.numel()

    def finish(parts: list[torch.Tensor | None]) -> None:
        slots = full.view(W, S)
        for r, part in enumerate(parts):
            slots[r].copy_(inp.reshape(-1) if r == rank else part)

    return _submit(_Op(sends=[None if r == rank else inp for r in range(W)],
                       recv_numel=[0 if r == rank else S for r in range(W)],
                       dtype=inp.dtype, finish=finish, alone=alone,
                       nbytes=(W - 1) * S * inp.element_size()), group)


def ring_sum_(out: torch.Tensor, parts: list[torch.Tensor], rank: int) -> None:
    """``out = sum of parts`` in gloo's ring order for ``rank``: ``x[r-1] + x[r-2] + ... +
    x[r]`` (measured; it keeps the bits of gloo's own reduce-scatter), each partial sum in
    ``out``'s dtype when that is wider than the parts'."""
    W = len(parts)
    order = [(rank - k) % W for k in range(1, W)] + [rank]
    if out.dtype == parts[order[0]].dtype:
        torch.add(parts[order[0]], parts[order[1]], out=out)
    else:  # a narrower wire dtype: every partial sum in out's (wider) dtype
        out.copy_(parts[order[0]]).add_(parts[order[1]])
    for k in order[2:]:
        out.add_(parts[k])


def submit_reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, *, rank: int,
                              world_size: int, group: Any,
                              alone: Callable[[], Any]) -> FusedWork:
    """``out = sum over ranks of inp[rank slice]`` (gloo's ring order), queued; ``alone()``
    issues the unfused all-to-all form (a work whose ``wait`` also sums)."""
    W, S = world_size, out.numel()
    chunks = inp.view(W, S)

    def finish(parts: list[torch.Tensor | None]) -> None:
        ring_sum_(out, [chunks[r] if r == rank else p for r, p in enumerate(parts)], rank)

    return _submit(_Op(sends=[None if r == rank else chunks[r] for r in range(W)],
                       recv_numel=[0 if r == rank else S for r in range(W)],
                       dtype=inp.dtype, finish=finish, alone=alone,
                       nbytes=(W - 1) * S * inp.element_size()), group)


def submit_max_all_reduce(t: torch.Tensor, *, rank: int, world_size: int,
                          group: Any) -> FusedWork:
    """``t = max over ranks of t`` (elementwise, in place), queued."""
    W = world_size

    def finish(parts: list[torch.Tensor | None]) -> None:
        for r, part in enumerate(parts):
            if r != rank:
                torch.maximum(t, part, out=t)

    def alone() -> Any:
        return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)

    return _submit(_Op(sends=[None if r == rank else t for r in range(W)],
                       recv_numel=[0 if r == rank else t.numel() for r in range(W)],
                       dtype=t.dtype, finish=finish, alone=alone,
                       nbytes=(W - 1) * t.numel() * t.element_size()), group)
