"""Layer 2: the handles and collective forms behind :class:`~lightning_vescale.dbuffer.DBuffer`.

Split out of ``dbuffer`` (one responsibility each): :class:`CommHandle` (what every DBuffer
collective returns), the flat collectives' names, and the gloo SUM reduce-scatter as an
all-to-all plus one local sum (design note [dbuffer-collectives], below).

Design note [dbuffer-collectives]
---------------------------------
* ``all_gather``: ``all_gather_into_tensor(full, shard)`` (or, with a lower ``param_dtype``,
  one whole-shard cast first). The output *is* every parameter: no copy-out.
* ``reduce_scatter``: ``reduce_scatter_tensor(grad_shard, grad_full)``. The input *is* every
  gradient (autograd accumulated into the views): no copy-in. One whole-buffer cast when the
  reduce dtype differs, one whole-shard add when accumulating onto existing sharded gradients.
* Group operations (zero, scale, cast) are one kernel per buffer, never per tensor.
* fp16 reductions divide by about ``sqrt(ranks)`` before the SUM and by the rest after, as
  FSDP2's ``_get_gradient_divide_factors`` (a SUM of fp16 gradients over many ranks overflows);
  fp32/bf16 use the collective's AVG (or SUM and one scale).
* HSDP: the replica all-reduce of the reduced shard is issued from a side stream ordered after
  the reduce-scatter (FSDP2's ``all_reduce_stream``), so later backward kernels on the current
  stream do not queue behind the reduce-scatter; the handle's ``wait`` orders the current stream
  after the all-reduce. With a ``reduce_scatter_dtype`` the whole replica stage (the
  reduce-scatter's local sum, the wire all-to-all, the fp32 sum, the all-gather, the copy out)
  is issued on that side stream at reduce time, every step ordered by ``Work.wait`` in stream
  order (no host wait on NCCL), and ``wait`` orders the current stream after an event recorded
  behind it (FSDP2's ``all_reduce_event``). The works holding the tensors the side stream reads
  (and the reduce-scatter's input, which NCCL stops holding at a ``Work.wait`` issued under the
  side stream) live until then, so the current stream cannot reuse their memory early.
* gloo (CPU): a SUM reduce-scatter is an ``all_to_all_single`` of ``grad_full`` into an
  input-sized temporary (each rank receives every rank's copy of its own slice) and one local
  ``sum`` over ranks. gloo's ``reduce_scatter_tensor`` moves the same bytes but was 1.7-2.4x
  slower than this whole path here (``python -m benchmarks.gloo_reduce_scatter``: 2.78 vs
  1.41 ms for 640k fp32 elements at 2 ranks, 4.18 vs 2.43 ms at 3) and allocates an
  input-sized temporary too. The local sum adds the ranks' parts in gloo's ring order, so
  the result is bitwise gloo's (checked at 2, 3 and 4 ranks, fp32 and bf16:
  ``tests/distributed/test_dbuffer_gloo_reduce_scatter.py``). NCCL keeps its native
  reduce-scatter.
* ``wire_dtype`` (``CommPolicy.reduce_scatter_dtype``): gradients are cast to it once (fp16:
  scaled by a power of two per rank first, so nothing overflows: ``pack_scaled``) and always
  take the all-to-all form (any backend), the local sum is taken in fp32, and AVG is a SUM then
  a divide; so only the transport is narrow (NCCL's bf16 reduce-scatter would round every
  partial sum to bf16). HSDP's replica all-reduce moves the wire dtype too, as an all-to-all,
  an fp32 sum and an all-gather (``wire_all_reduce_sum``): one rounding, of the total.
* HSDP gradient accumulation with ``set_requires_all_reduce(False)`` (FSDP2's): each such
  micro-batch is reduce-scattered within the shard group and its output added to
  ``grad_partial`` (one shard, ``reduce_dtype``; FSDP2's ``partial_reduce_output``), counted as
  ``grad_shard`` memory; ``grad_shard`` and the published gradients are left alone. The next
  reduce with the all-reduce adds ``grad_partial`` to its reduce-scatter output and all-reduces
  the total across the replicas once, so only the last micro-batch pays the replica traffic.
  The divisions (``pre`` on the input, ``post`` and ``scale`` on the output) are linear: the
  total is divided once.
* Gradient accumulation without sync (``set_requires_gradient_sync(False)``) in mixed
  precision: each backward's ``grad_full`` holds one micro-batch's gradient in ``param_dtype``;
  :meth:`accumulate_grad` adds it into ``grad_acc`` (``reduce_dtype``, e.g. fp32) and frees it,
  so the sum over micro-batches is taken in ``reduce_dtype`` (as FSDP2's
  ``unsharded_accumulated_grad``), not in bf16. The next reduce-scatter adds the last
  micro-batch into ``grad_acc`` in place and reduces that (no extra cast buffer).

Design note [dbuffer-offload]
-----------------------------
With ``offload=True`` (``CPUOffloadPolicy``) ``shard`` and ``grad_shard`` live in CPU memory
(pinned when ``pin_memory`` and an accelerator exist), so the sharded parameters, their
gradients and the optimizer states built from them are CPU tensors, as with FSDP2. ``full`` and
``grad_full`` stay on ``device``: the all-gather input is one copy of the whole shard to
``device`` per group (cast to ``param_dtype`` on the way), and the reduce-scatter writes a
device tensor that its epilogue copies (or adds) into the host ``grad_shard``. Both copies are
made even when ``device`` is the CPU, so the offload path is the same code everywhere. Into
pinned memory from an accelerator the gradient copy is asynchronous (``non_blocking``, one event
per buffer that the root's final callback synchronises: FSDP2's ``grad_offload_event``); when
gradients accumulate the reduced shard is copied to the host first and added there, never added
across devices. The host shard is not zeroed before a copy that overwrites it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning_vescale._gloo_exchange import (
    fusable,
    ring_sum_,
    submit_all_gather,
    submit_reduce_scatter_sum,
)
from lightning_vescale._labels import label

if TYPE_CHECKING:
    from lightning_vescale.mesh import MeshInfo
    from lightning_vescale.planner import LayoutPlan

__all__ = ["CommHandle", "all_gather_into", "gloo_reduce_scatter_sum", "gloo_serves",
           "gradient_divide_factors", "group_rank_and_size", "offload_copy", "reduce_factors",
           "reduce_scatter_fuses", "replica_all_reduce", "wire_all_reduce_sum",
           "wire_needs_scale", "wire_reduce_scatter_sum"]


class _Finished:
    """A work-like object whose ``wait()`` runs ``finish`` once (a collective plus its local
    completion, e.g. the sum after gloo's all-to-all reduce-scatter)."""

    def __init__(self, finish: Callable[[], None], keep: Any = None) -> None:
        self._finish: Callable[[], None] | None = finish
        self._ran: Callable[[], None] | None = None
        # the collective's input: NCCL (avoiding record_stream) drops its own reference at
        # ``Work.wait``, which under a side stream does not order the stream it was allocated on
        self._keep = keep

    def wait(self) -> bool:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
            # its tensors stay referenced while this work is: when ``finish`` enqueued kernels
            # on a side stream, the holder releases them only after ordering its stream there
            self._ran = finish
        return True


class _StreamDone:
    """A work whose ``wait()`` orders the current stream after ``event``, recorded on a side
    stream after the kernels it stands for (FSDP2's ``all_reduce_event``). It holds ``keep``
    (the works and tensors those kernels read) until then: memory allocated on the current
    stream and freed earlier could be reused by it while the side stream still reads it."""

    def __init__(self, event: "torch.Event", device: torch.device, keep: tuple) -> None:
        self._event, self._device, self._keep = event, device, keep

    def wait(self) -> bool:
        if self._keep is not None:
            torch.accelerator.current_stream(self._device).wait_event(self._event)
            self._keep = None
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
            with label("vescale::comm_wait"):  # waiting, not engine work
                self._work.wait()
        self._work = None
        if self._epilogue is not None:
            epilogue, self._epilogue = self._epilogue, None
            epilogue()
        self._done = True


# torch >= 2.13 names the flat collectives ``*_single`` (the old names warn as deprecated).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(full: torch.Tensor, inp: torch.Tensor, *, rank: int, world_size: int,
                    group: Any, async_op: bool, fuse: bool) -> Any:
    """``full = every rank's inp`` in rank order (``all_gather_single``); ``fuse`` (gloo): a
    small one is queued with the group's other small collectives ([gloo-fused-exchange])."""
    if fuse and fusable(full.numel() * full.element_size()):
        return submit_all_gather(full, inp, rank=rank, world_size=world_size, group=group,
                                 alone=lambda: _all_gather_flat(full, inp, group=group,
                                                                async_op=True))
    return _all_gather_flat(full, inp, group=group, async_op=async_op)


def reduce_scatter_fuses(world_size: int, gloo: bool, wire: torch.dtype | None,
                         nbytes: int) -> bool:
    """Whether a reduce-scatter of ``nbytes`` is queued with the group's other small gloo
    collectives ([gloo-fused-exchange]; the engine then issues it asynchronously on CPU too):
    on gloo, more than one rank, not a wire dtype with a scale (fp16: its own message form)."""
    return world_size > 1 and gloo and not wire_needs_scale(wire) and fusable(nbytes)


def _resolve_op(op: str | dist.ReduceOp) -> dist.ReduceOp:
    if isinstance(op, str):
        table = {"avg": dist.ReduceOp.AVG, "mean": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM}
        if op.lower() not in table:
            raise ValueError(f"op={op!r} is not supported; use 'avg' or 'sum'")
        return table[op.lower()]
    return op


def gloo_reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, *, rank: int, world_size: int,
                            group: Any, async_op: bool, release: Callable[[], None],
                            fuse: bool = False) -> _Finished | None:
    """``out = sum over ranks of inp[rank slice]`` as an all-to-all plus one local sum (the
    fast form on gloo, design note [dbuffer-collectives]). Returns a work whose ``wait()``
    also sums (``None`` when ``async_op`` is false: done); ``inp`` must stay unchanged until
    then. ``release`` runs once the input-sized temporary is no longer needed. When ``out`` is
    wider than ``inp`` (a wire dtype), the sum is taken in ``out``'s dtype. ``fuse`` (gloo
    only): a small one is queued to travel with the group's other small collectives (design
    note [gloo-fused-exchange])."""
    W = world_size
    S = out.numel()
    if not (fuse and fusable((W - 1) * S * inp.element_size())):
        work = _all_to_all_sum(out, inp, rank=rank, world_size=W, group=group, after=release)
        if not async_op:
            work.wait()
            return None
        return work
    inner = submit_reduce_scatter_sum(out, inp, rank=rank, world_size=W, group=group,
                                      alone=lambda: _all_to_all_sum(out, inp, rank=rank,
                                                                    world_size=W, group=group))

    def finish() -> None:
        inner.wait()
        release()

    if not async_op:
        finish()
        return None
    return _Finished(finish, keep=inp)


def _all_to_all_sum(out: torch.Tensor, inp: torch.Tensor, *, rank: int, world_size: int,
                    group: Any, after: Callable[[], None] | None = None) -> _Finished:
    """Issue :func:`gloo_reduce_scatter_sum`'s all-to-all; the work's ``wait`` sums in
    gloo's ring order, then runs ``after``."""
    W, S = world_size, out.numel()
    received = torch.empty(W * S, dtype=inp.dtype, device=inp.device)
    work = dist.all_to_all_single(received, inp, group=group, async_op=True)

    def finish() -> None:
        work.wait()
        ring_sum_(out, list(received.view(W, S)), rank)
        if after is not None:
            after()

    return _Finished(finish, keep=inp)


# -- a narrow wire dtype (fp16): one power-of-two scale per sender --------------------------------
def wire_needs_scale(wire: torch.dtype | None) -> bool:
    """Whether gradients travel in ``wire`` with a per-sender scale: a float dtype whose range
    is far narrower than fp32's (fp16, max 65504; bf16 has fp32's range and needs none)."""
    return wire is not None and torch.finfo(wire).max < 1e38


def pack_scaled(src: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    """``src`` (``(rows, C)``, scaled in place) as a ``(rows, C + 1)`` ``wire`` message: every
    value times ``2**-k``, then the exponent ``k`` in the last column (one ``k`` for the whole
    message: the smallest ``k >= 0`` that keeps its absmax within ``wire``'s range).

    Powers of two keep the scaling exact (a value only loses what ``wire`` itself cannot hold
    at that exponent) and ``k = 0`` leaves the values' bits alone. A non-finite absmax makes
    ``k`` non-finite, so the receiver's gradient is non-finite too: an overflow stays visible
    (a grad scaler skips the step), never a silent Inf in place of a finite gradient. No host
    sync: ``k`` stays on the device."""
    rows, C = src.shape
    k = torch.ceil(torch.log2(src.abs().amax().float() / torch.finfo(wire).max)).clamp_(min=0)
    src.mul_(torch.exp2(-k).to(src.dtype))
    msg = torch.empty(rows, C + 1, dtype=wire, device=src.device)
    msg[:, :C].copy_(src)
    msg[:, C].copy_(k)
    return msg


def _unpack_add(out: torch.Tensor, part: torch.Tensor, first: bool) -> None:
    """``out (+)= part's values * 2**k`` in ``out``'s dtype (``part``: one row of a
    :func:`pack_scaled` message)."""
    C = part.numel() - 1
    factor = torch.exp2(part[C].to(out.dtype))
    if first:
        out.copy_(part[:C]).mul_(factor)
    else:
        out.addcmul_(part[:C], factor)


def wire_reduce_scatter_sum(out: torch.Tensor, inp: torch.Tensor, *, wire: torch.dtype | None,
                            rank: int, world_size: int, group: Any, async_op: bool,
                            release: Callable[[], None], fuse: bool = False) -> _Finished | None:
    """``out = sum over ranks of inp[rank slice]``, moving ``wire``-dtype values and adding in
    ``out``'s dtype (a ``reduce_scatter_dtype``, design note [dbuffer-collectives]): ``inp``
    cast to ``wire`` through :func:`gloo_reduce_scatter_sum`'s all-to-all, or, for a wire that
    needs a scale (:func:`wire_needs_scale`: fp16), a :func:`pack_scaled` message per rank (its
    exponent beside every chunk; ``inp`` is scaled in place), each rank's chunk then multiplied
    by its sender's ``2**k`` before the sum. Works at a world of one too. ``wire=None``: plain
    :func:`gloo_reduce_scatter_sum` of ``inp``."""
    W, S = world_size, out.numel()
    if wire is None:
        return gloo_reduce_scatter_sum(out, inp, rank=rank, world_size=W, group=group,
                                       async_op=async_op, release=release, fuse=fuse)
    if not wire_needs_scale(wire):
        send = inp if inp.dtype == wire else inp.to(wire)
        if W == 1:
            out.copy_(send[:S])
            release()
            return None
        return gloo_reduce_scatter_sum(out, send, rank=rank, world_size=W, group=group,
                                       async_op=async_op, release=release, fuse=fuse)
    send = pack_scaled(inp.view(W, S), wire)
    if W == 1:
        _unpack_add(out, send[0], first=True)
        release()
        return None
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)
    order = [(rank - k) % W for k in range(1, W)] + [rank]  # as gloo_reduce_scatter_sum

    def finish() -> None:
        work.wait()
        for i, k in enumerate(order):
            _unpack_add(out, received[k], first=i == 0)
        release()

    if not async_op:
        finish()
        return None
    return _Finished(finish, keep=send)


def gloo_serves(group: Any, device: torch.device) -> bool:
    """Whether ``group`` runs collectives on ``device``'s tensors with gloo: CPU tensors on
    gloo or ``cpu:gloo,cuda:nccl``, and CUDA tensors on a plain gloo group (two processes
    sharing one GPU), where gloo has no ``reduce_scatter_tensor`` of its own. Backends that do
    not say fall back to the group's backend name (CPU tensors only)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return pg._get_backend(torch.device(device.type)).name() == "gloo"
    except (AttributeError, RuntimeError, ValueError):
        return device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def group_rank_and_size(plan: "LayoutPlan", mesh_info: "MeshInfo | None", is_meta: bool,
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
    if wire_needs_scale(wire):  # fp16: every message carries its sender's exponent
        padded = torch.zeros(size * chunk, dtype=out.dtype, device=out.device)
        padded[:n].copy_(out)
        send = pack_scaled(padded.view(size, chunk), wire)
    else:
        send = torch.zeros(size * chunk, dtype=wire, device=out.device)
        send[:n].copy_(out)
    received = torch.empty_like(send)
    work = dist.all_to_all_single(received.view(-1), send.view(-1), group=group, async_op=True)

    def finish() -> None:
        work.wait()
        if send.dim() == 2:
            total = torch.empty(chunk, dtype=out.dtype, device=out.device)
            for k in range(size):
                _unpack_add(total, received[k], first=k == 0)
            mine = pack_scaled(total.view(1, chunk), wire)
            gathered = torch.empty(size, chunk + 1, dtype=wire, device=out.device)
            _all_gather_flat(gathered.view(-1), mine.view(-1), group=group, async_op=True).wait()
            full = torch.empty(size, chunk, dtype=out.dtype, device=out.device)
            for k in range(size):
                _unpack_add(full[k], gathered[k], first=True)
            out.copy_(full.view(-1)[:n])
            return
        parts = received.view(size, chunk)
        total = parts[0].to(out.dtype)
        for k in range(1, size):
            total.add_(parts[k])
        gathered = torch.empty_like(send)
        _all_gather_flat(gathered, total.to(wire), group=group, async_op=True).wait()
        out.copy_(gathered[:n])

    if not async_op:
        finish()
        return None
    return _Finished(finish)


# -- reduce-scatter pieces (design notes [dbuffer-collectives], [dbuffer-offload]) ----------------
def gradient_divide_factors(ranks: int, reduce_dtype: torch.dtype,
                            factor: float | None = None) -> tuple[float | None, float]:
    """``(pre, post)``: divide the reduce input by ``pre`` and the output by ``post`` so that a
    SUM reduction over ``ranks`` gives the sum divided by ``factor`` (default ``ranks``).

    FSDP2's ``_get_gradient_divide_factors``: fp16 (any dtype but fp32/bf16) risks overflow in
    a SUM over many ranks, so it divides by about ``sqrt(factor)`` (the largest power of two
    that divides it and stays below its square root) before and by the rest after; fp32 and
    bf16 divide once, after (``pre`` is ``None``).
    """
    factor = float(ranks if factor is None else factor)
    if reduce_dtype in (torch.float32, torch.bfloat16, torch.float64):
        return None, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


def reduce_factors(rop: dist.ReduceOp, scale: float | None, *, ranks: int,
                   reduce_dtype: torch.dtype, gloo: bool
                   ) -> tuple[dist.ReduceOp, float | None, float | None, float | None]:
    """``(op, pre, post, scale)`` of a gradient reduce-scatter over ``ranks`` data-parallel
    ranks: the collectives' op, the divisions before and after it and a multiplier after
    (``None``: none).

    fp16 divides before and after a SUM (:func:`gradient_divide_factors`; a divide factor's
    ``scale`` too); gloo has no native AVG, so it sums and divides after (bitwise gloo's own
    AVG); otherwise the op as given, and ``scale`` after."""
    fp16 = gradient_divide_factors(ranks, reduce_dtype)[0] is not None
    if rop == dist.ReduceOp.AVG and (fp16 or (ranks > 1 and gloo)):
        pre, post = gradient_divide_factors(ranks, reduce_dtype)
        return dist.ReduceOp.SUM, pre, post, None
    if rop == dist.ReduceOp.SUM and scale is not None and fp16:
        pre, post = gradient_divide_factors(ranks, reduce_dtype, 1.0 / scale)
        return rop, pre, post, None
    return rop, None, None, scale


def offload_copy(gs: torch.Tensor, out: torch.Tensor, *, accumulate: bool,
                 non_blocking: bool) -> "torch.Event | None":
    """Write a reduced gradient shard ``out`` (on the compute device) into the offloaded
    ``gs`` (CPU): copy, or with ``accumulate`` add (design note [dbuffer-offload]).

    A copy into pinned memory from an accelerator is asynchronous (``non_blocking``): the
    returned event is recorded after it, and must be synchronised before anyone reads ``gs``
    (the root's final callback does, as FSDP2 does with its ``grad_offload_event``). Adding
    needs the values on the host: ``out`` is copied there first, blocking (FSDP2 too), never
    added across devices.
    """
    if accumulate:
        gs.add_(out if out.device == gs.device else out.to(gs.device))
        return None
    asynchronous = non_blocking and out.device != gs.device and out.device.type != "cpu"
    gs.copy_(out, non_blocking=asynchronous)
    if not asynchronous:
        return None
    event = torch.Event(device=out.device)
    event.record()
    return event


# one side stream per device for HSDP's replica all-reduce (FSDP2's ``all_reduce_stream``)
_ALL_REDUCE_STREAMS: dict[torch.device, torch.Stream] = {}


def replica_all_reduce(rs_work: Any, out: torch.Tensor, *, op: dist.ReduceOp, group: Any,
                       async_op: bool, wire: torch.dtype | None = None, size: int = 1) -> Any:
    """HSDP: all-reduce the reduce-scatter's output ``out`` across the replicas.

    On an accelerator the all-reduce is issued from a side stream that waits for the
    reduce-scatter (``Work.wait`` under that stream orders that stream, not the current one),
    so the backward kernels issued next on the current stream are not queued behind the
    reduce-scatter; the returned work's ``wait`` orders the current stream after the
    all-reduce. On the CPU (gloo) the reduce-scatter is simply finished first. With a ``wire``
    dtype (a ``reduce_scatter_dtype``) it is :func:`wire_all_reduce_sum` over the ``size``
    replicas, after the reduce-scatter: on an accelerator all of it (the reduce-scatter's
    local sum, the all-to-all, the fp32 sum, the all-gather and the copy into ``out``) is
    issued at once on the same side stream, and the returned work's ``wait`` orders the
    current stream after an event recorded behind it (FSDP2's ``all_reduce_event``).
    """
    if out.device.type == "cpu" or not async_op:
        if rs_work is not None:
            with label("vescale::comm_wait"):
                rs_work.wait()
        with label("vescale::all_reduce"):
            if wire is not None:
                return wire_all_reduce_sum(out, wire, group=group, size=size, async_op=async_op)
            return dist.all_reduce(out, op=op, group=group, async_op=async_op)
    stream = _ALL_REDUCE_STREAMS.get(out.device)
    if stream is None:
        stream = _ALL_REDUCE_STREAMS[out.device] = torch.Stream(device=out.device)
    stream.wait_stream(torch.accelerator.current_stream(out.device))
    with stream, label("vescale::all_reduce"):
        if rs_work is not None:
            rs_work.wait()  # orders the side stream after the reduce-scatter (and its sum)
        if wire is None:
            return dist.all_reduce(out, op=op, group=group, async_op=True)
        # every step waits in stream order: the host does not block on NCCL
        wire_all_reduce_sum(out, wire, group=group, size=size, async_op=False)
        event = stream.record_event()
    return _StreamDone(event, out.device, keep=(rs_work, out))
