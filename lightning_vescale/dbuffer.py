"""Layer 2: ``DBuffer``, one group's flat, sharded storage; collectives run in place on it.

The collective forms and CPU offload (design notes [dbuffer-collectives], [dbuffer-offload]) are
described in ``_dbuffer_comm``, beside the code that runs them.

Design note [dbuffer-memory]
----------------------------
A :class:`~lightning_vescale.planner.LayoutPlan` puts every tensor of a group at an offset of a
flat buffer of ``W * S`` elements (``W`` ranks, ``S`` elements per rank). A ``DBuffer`` holds
four tensors of that layout:

=================  =========  ===============  ==============================================
storage            elements   dtype            lifetime
=================  =========  ===============  ==============================================
``shard``          ``S``      ``dtype``        persistent: the rank's owned slice (master data)
``full``           ``W * S``  ``param_dtype``  materialised for compute, freed after
``grad_full``      ``W * S``  ``param_dtype``  materialised when the first gradient arrives,
                                               freed after reduce-scatter
``grad_shard``     ``S``      ``dtype``        from a reduce-scatter until every sharded
                                               gradient was dropped (``zero_grad``)
``partial``        ``W*S/k``  ``param_dtype``  ``reshard_after_forward=k``: from forward to
                                               backward, this rank's chunk (``reshard_to``)
``grad_acc``       ``W * S``  ``reduce_dtype`` only while gradient sync is off and
                                               ``reduce_dtype != param_dtype``: the unsharded
                                               gradients of the unsynced backwards, summed in
                                               the reduce dtype (:meth:`accumulate_grad`)
``quantized``      ``~S``,    ``uint8``        ``CommPolicy(all_gather=...)`` only: the codes
                   ``~W*S``                    and scales sent (persistent) and received
                                               (during an all-gather): [quantized-all-gather]
=================  =========  ===============  ==============================================

The owned slice is separate storage (not a slice of ``full``), so freeing ``full`` never frees
the shard. Every per-tensor view (:meth:`param_view`, :meth:`local_view`, :meth:`grad_view`,
:meth:`grad_local_view`) is created once and stays valid forever: freeing uses
``untyped_storage().resize_(0)`` and re-materialising ``resize_(nbytes)`` on the *same* storage
object, exactly as PyTorch FSDP2 does, so tensors that autograd saved in forward see the
re-gathered data in backward.

Design note [dbuffer-views]
---------------------------
Unsharded views are built with ``Tensor.set_(storage, offset, shape, stride)``, not by slicing
``full``: a slice would share ``full``'s autograd version counter, and the all-gather that
re-materialises the buffer in backward would then trip autograd's "modified by an inplace
operation" check on every saved parameter. ``set_`` views share the memory but have their own
version counter. (FSDP2 instead wraps its copy-out in ``_unsafe_preserve_version_counter``.)

Design note [dbuffer-published-grads]
-------------------------------------
Whoever hands the rank's gradients out as tensors (``fully_shard``: a DTensor per parameter
over :meth:`grad_local_view`) records them with :meth:`record_published_grads` under an opaque
int key (``id(parameter)``). A reader needing one flat view of many gradients
(``FlatParamOptimizer``, [flat-params]) then checks identity, ``p.grad is published[key]``, and
slices ``grad_shard`` itself, instead of reading every gradient's pointer, size and strides.
:meth:`published_grads` answers only while ``grad_shard`` is the storage they view;
:meth:`release_grad_shard` forgets them (they would keep the old storage alive).

Async ops return a :class:`CommHandle` (``wait()`` also runs the epilogue: cast back,
accumulate, free temporaries); synchronous ones an already-waited one: callers treat both alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from lightning_vescale._labels import label

from lightning_vescale._dbuffer_comm import (
    CommHandle,
    _reduce_scatter_flat,
    _resolve_op,
    all_gather_into,
    gloo_serves,
    group_rank_and_size,
    offload_copy,
    reduce_factors,
    reduce_scatter_fuses,
    replica_all_reduce,
    wire_reduce_scatter_sum,
)
from lightning_vescale._dbuffer_registry import dbuffer_of, live_dbuffers, register
from lightning_vescale._dbuffer_quant import QuantizedGather
from lightning_vescale._gloo_exchange import fusable
from lightning_vescale.mesh import MeshInfo
from lightning_vescale.placement import RaggedShard, local_slice
from lightning_vescale.planner import LayoutPlan

__all__ = ["DBuffer", "CommHandle", "dbuffer_of", "live_dbuffers"]

def _storage_view(base: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over ``base``'s storage at element ``offset`` with its own version counter.

    See design note [dbuffer-views]. ``base`` must be materialised (else ``set_`` would grow
    the storage); callers create all views at construction time.
    """
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if base.device.type == "meta":
        return base.detach()[offset: offset + math.prod(shape)].view(shape)
    out = torch.empty(0, dtype=base.dtype, device=base.device)
    with torch.no_grad():
        out.set_(base.untyped_storage(), base.storage_offset() + offset, shape, stride)
    return out


class DBuffer:
    """Flat sharded storage for one group of tensors, laid out by a ``LayoutPlan``.

    Args:
        plan: the group's layout (from :func:`~lightning_vescale.planner.plan_layout`); its
            ``world_size`` must equal the shard group's size.
        dtype: dtype of the persistent shard and sharded gradients (the master copy).
        device: where all storage lives (``"meta"`` allowed: no storage, no collectives).
        mesh_info: the group's :class:`~lightning_vescale.mesh.MeshInfo`; collectives run in its
            shard group and this rank's slice is its ``shard_rank``. ``None``: the default
            process group (or, without one, a single process), for a buffer used on its own.
        param_dtype: dtype of the unsharded parameters/gradients and of the all-gather
            (default ``dtype``).
        reduce_dtype: dtype of the reduce-scatter (default ``param_dtype``).
        offload: keep the persistent shard and the sharded gradients in CPU memory (FSDP2's
            ``CPUOffloadPolicy``); ``device`` is then where the unsharded buffers and the
            collectives live. See design note [dbuffer-offload].
        pin_memory: pin the offloaded CPU storage (when an accelerator exists), so that the
            copies to and from ``device`` can run asynchronously.
        quantize: ``"int8"``/``"fp8"``: all-gather block-quantized codes and scales (design
            note [quantized-all-gather] in ``_dbuffer_quant``); ``quant_block_size`` elements
            per block, which the plan's granularities must keep whole on each rank.
        wire_dtype: the dtype gradients travel in for the reduce-scatter (and HSDP's
            all-reduce); the partial sums are added in fp32 (see [dbuffer-collectives]).

    See design notes [dbuffer-memory], [dbuffer-views] and [dbuffer-collectives].
    """

    def __init__(
        self,
        plan: LayoutPlan,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        mesh_info: MeshInfo | None = None,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        name: str = "",
        offload: bool = False,
        pin_memory: bool = False,
        quantize: str | None = None,
        quant_block_size: int = 256,
        wire_dtype: torch.dtype | None = None,
    ) -> None:
        self.plan = plan
        self.name = name
        self.mesh_info = mesh_info
        self.group = mesh_info.shard_group if mesh_info is not None else None
        # HSDP ([hsdp] in mesh.py): the reduced shard is all-reduced across replicas; 1-D: None
        self.replicate_group = (mesh_info.replicate_group
                                if mesh_info is not None and mesh_info.is_hsdp else None)
        self.replicate_size = mesh_info.replicate_size if mesh_info is not None else 1
        self.device = torch.device(device)
        self.is_meta = self.device.type == "meta"
        self.offload = offload
        #: where the persistent shard and sharded gradients live (CPU when offloading)
        self.shard_device = torch.device("cpu") if offload and not self.is_meta else self.device
        self._pin = (offload and pin_memory and not self.is_meta
                     and torch.accelerator.is_available())
        # reshard_after_forward=<int>: this rank's chunk of the unsharded buffer, kept between
        # forward and backward, and the smaller group backward all-gathers it in
        self.partial: torch.Tensor | None = None
        self._partial_group: dist.ProcessGroup | None = None
        self.rank, self.world_size = group_rank_and_size(plan, mesh_info, self.is_meta, name)
        self.dtype, self.wire_dtype = dtype, wire_dtype
        self.param_dtype = param_dtype or dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.quantize, self.quant_block_size = quantize, quant_block_size
        self.quantized = None if quantize is None or self.is_meta else QuantizedGather(
            plan, rank=self.rank, fmt=quantize, block_size=quant_block_size, device=self.device,
            name=name)
        S, N = plan.shard_size, plan.buffer_size
        self.shard_size, self.buffer_size = S, N
        self._shapes = {spec.name: tuple(spec.shape) for spec in plan.entries}
        # persistent owned slice (zero so padding stays zero through every collective)
        self.shard = torch.zeros(S, dtype=dtype, device=self.shard_device, pin_memory=self._pin)
        self.full = torch.empty(N, dtype=self.param_dtype, device=self.device)
        self.grad_full = torch.empty(N, dtype=self.param_dtype, device=self.device)
        self.grad_shard: torch.Tensor | None = None
        #: unsynced gradients summed in reduce_dtype (see [dbuffer-collectives]); usually None
        self.grad_acc: torch.Tensor | None = None
        #: HSDP, ``reduce_scatter(all_reduce=False)``: the shard-group sums of the micro-batches
        #: not yet all-reduced across replicas (FSDP2's ``partial_reduce_output``); usually None
        self.grad_partial: torch.Tensor | None = None
        self._grad_fresh = True  # grad_full holds no gradient (zero it on materialise)
        self._build_views()
        self._grad_local_views: dict[str, torch.Tensor] = {}
        # (grad_shard, {key: tensor}) of record_published_grads; see [dbuffer-published-grads]
        self._published: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None
        self._comm_bytes = 0  # bytes of live temporaries (casts) owned by in-flight ops
        self._gloo: bool | None = None  # the group's backend is gloo (see _on_gloo)
        self._cpu = self.device.type == "cpu"  # gloo's fused exchange: CPU tensors only
        #: the pending asynchronous gradient copy to the host (offload; see wait_offload)
        self._offload_event: torch.Event | None = None
        self.free()
        self.free_grad()
        register(self)  # dbuffer_of, live_dbuffers

    def _build_views(self) -> None:
        """Every tensor's views, made once and valid forever ([dbuffer-memory]): unsharded
        parameter/gradient views of ``full``/``grad_full``, the owned range of ``shard``."""
        plan, S, lo = self.plan, self.shard_size, self.rank * self.shard_size
        self._local: dict[str, tuple[int, int]] = {}
        self._param_views: dict[str, torch.Tensor] = {}
        self._grad_views: dict[str, torch.Tensor] = {}
        self._local_views: dict[str, torch.Tensor] = {}
        for name_, shape in self._shapes.items():
            off = plan.offsets[name_]
            a, b = plan.local_range(name_, self.rank)
            start = min(max(off + a - lo, 0), S)  # ranks owning none of it get an empty range
            end = max(start, min(off + b - lo, S))
            assert end - start == b - a, (name_, a, b, start, end)
            self._local[name_] = (start, end)
            self._param_views[name_] = _storage_view(self.full, off, shape)
            self._grad_views[name_] = _storage_view(self.grad_full, off, shape)
            self._local_views[name_] = self.shard[start:end]

    # -- introspection ---------------------------------------------------------------------------
    def placement(self, name: str) -> RaggedShard:
        """The tensor's ``RaggedShard`` placement (from the plan)."""
        return self.plan.placement(name)

    def __repr__(self) -> str:
        return (f"DBuffer({self.name!r}, tensors={len(self._shapes)}, S={self.shard_size}, "
                f"world={self.world_size}, dtype={self.dtype}, param_dtype={self.param_dtype}, "
                f"materialized={self.is_materialized})")

    # -- views -----------------------------------------------------------------------------------
    def param_view(self, name: str) -> torch.Tensor:
        """The unsharded tensor (global shape) inside :attr:`full`; valid while materialised."""
        return self._param_views[name]

    def grad_view(self, name: str) -> torch.Tensor:
        """The unsharded gradient (global shape) inside :attr:`grad_full`."""
        return self._grad_views[name]

    def local_view(self, name: str) -> torch.Tensor:
        """The rank's owned part of tensor ``name`` (1-D view into :attr:`shard`)."""
        return self._local_views[name]

    def grad_local_view(self, name: str) -> torch.Tensor:
        """The rank's owned part of ``name``'s reduced gradient (1-D view into grad_shard)."""
        if name not in self._grad_local_views:
            gs = self._ensure_grad_shard()
            a, b = self._local[name]
            self._grad_local_views[name] = gs[a:b]
        return self._grad_local_views[name]

    def _ensure_grad_shard(self, zero: bool = True) -> torch.Tensor:
        if self.grad_shard is None:
            make = torch.zeros if zero else torch.empty
            self.grad_shard = make(self.shard_size, dtype=self.dtype, device=self.shard_device,
                                   pin_memory=self._pin)
            self._grad_local_views.clear()
        return self.grad_shard

    def release_grad_shard(self) -> None:
        """Drop the sharded gradients (when no parameter refers to them any more). The storage
        is dropped, not resized: views users still hold stay valid (they keep the old storage
        alive); the next :meth:`reduce_scatter` allocates a fresh one."""
        self.grad_shard = None
        self._grad_local_views.clear()
        self._published = None

    def record_published_grads(self, grads: dict[int, torch.Tensor]) -> None:
        """Remember the gradient tensors handed out for this buffer (design note
        [dbuffer-published-grads]); each must be (a DTensor over) its tensor's
        :meth:`grad_local_view` of the current ``grad_shard``."""
        assert self.grad_shard is not None or not grads
        self._published = (self.grad_shard, grads) if self.grad_shard is not None else None

    def published_grads(self) -> dict[int, torch.Tensor] | None:
        """The tensors of the last :meth:`record_published_grads`, by key, while ``grad_shard``
        is still the storage they view; otherwise ``None``."""
        pub = self._published
        if pub is None or pub[0] is not self.grad_shard:
            return None
        return pub[1]

    # -- memory ----------------------------------------------------------------------------------
    @staticmethod
    def _materialized(t: torch.Tensor) -> bool:
        return t.device.type == "meta" or t.untyped_storage().nbytes() > 0

    @property
    def is_materialized(self) -> bool:
        """Whether the unsharded parameter storage is allocated."""
        return self._materialized(self.full)

    @property
    def is_grad_materialized(self) -> bool:
        """Whether the unsharded gradient storage is allocated."""
        return self._materialized(self.grad_full)

    def _resize(self, t: torch.Tensor, alloc: bool) -> None:
        if self.is_meta:
            return
        storage = t.untyped_storage()
        want = t.numel() * t.element_size() if alloc else 0
        if storage.nbytes() != want:
            storage.resize_(want)

    def materialize(self) -> None:
        """Allocate the unsharded parameter storage (contents undefined until all-gather)."""
        self._resize(self.full, True)

    def free(self) -> None:
        """Free the unsharded parameter storage; views stay valid objects (see the notes)."""
        self._resize(self.full, False)
        self.partial = self._partial_group = None

    def reshard_to(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        """Free the unsharded storage but keep this rank's ``1/size`` of it (FSDP2's
        ``reshard_after_forward=<int>``): the next :meth:`all_gather` gathers among the
        ``size`` ranks of ``group`` (this rank is its ``rank``-th) instead of the shard group.
        """
        if self.is_meta or not self.is_materialized:
            return
        chunk = self.buffer_size // size
        kept = self.full[rank * chunk:(rank + 1) * chunk].clone()
        self.free()
        self.partial, self._partial_group = kept, group

    def materialize_grad(self) -> None:
        """Allocate the unsharded gradient storage, zeroed if it holds no gradient yet."""
        if not self.is_grad_materialized:
            self._resize(self.grad_full, True)
            self._grad_fresh = True
        if self._grad_fresh:
            self.grad_full.zero_()  # one kernel for the whole group
            self._grad_fresh = False

    def free_grad(self) -> None:
        """Free the unsharded gradient storage (the next materialisation starts from zero)."""
        self._resize(self.grad_full, False)
        self._grad_fresh = True

    @property
    def accumulates_in_reduce_dtype(self) -> bool:
        """Whether unsynced gradients are summed in ``reduce_dtype`` (it differs from
        ``param_dtype``): see :meth:`accumulate_grad`."""
        return self.reduce_dtype != self.param_dtype

    def accumulate_grad(self) -> None:
        """Fold this backward's unsharded gradient into :attr:`grad_acc` and free it.

        Called at the end of a backward without gradient sync when ``reduce_dtype`` differs
        from ``param_dtype`` (design note [dbuffer-collectives]); a no-op otherwise or when no
        gradient was materialised. The next :meth:`materialize_grad` starts from zero.
        """
        if not self.accumulates_in_reduce_dtype or self.is_meta:
            return
        if not self.is_grad_materialized or self._grad_fresh:
            return
        with torch.no_grad():
            if self.grad_acc is None:
                self.grad_acc = self.grad_full.to(self.reduce_dtype)
            else:
                self.grad_acc.add_(self.grad_full)
        self.free_grad()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes currently allocated, by role (see design note [dbuffer-memory])."""
        def nbytes(t: torch.Tensor | None) -> int:
            if t is None or self.is_meta:
                return 0
            return t.untyped_storage().nbytes()
        return {
            "param_shard": nbytes(self.shard),
            "param_unsharded": nbytes(self.full) + nbytes(self.partial),
            "grad_shard": nbytes(self.grad_shard) + nbytes(self.grad_partial),
            "grad_unsharded": nbytes(self.grad_full) + nbytes(self.grad_acc),
            "comm": self._comm_bytes + (self.quantized.held_bytes() if self.quantized else 0),
        }

    # -- loading ---------------------------------------------------------------------------------
    def load_local_(self, name: str, full_tensor: torch.Tensor) -> None:
        """Copy the owned part of ``full_tensor`` (global shape) into the shard (init/load only)."""
        view = self._local_views[name]
        if view.numel():
            with torch.no_grad():
                view.copy_(local_slice(full_tensor.detach(), self.placement(name), self.rank))

    # -- collectives -------------------------------------------------------------------------------
    def _check_collective(self) -> None:
        if self.is_meta:
            raise RuntimeError(
                f"DBuffer {self.name!r} lives on the meta device; materialise the module first "
                "(lightning_vescale.fsdp.materialize(module, device) or module.to_empty(...))."
            )

    def all_gather(self, async_op: bool = False) -> CommHandle:
        """Fill :attr:`full` from every rank's shard, in place.

        See design note [dbuffer-collectives]. Returns a :class:`CommHandle` (already waited
        unless ``async_op``).
        """
        self._check_collective()
        with label("vescale::all_gather"):
            return self._all_gather(async_op)

    def _all_gather(self, async_op: bool) -> CommHandle:
        group = self.group
        partial, partial_group = self.partial, self._partial_group
        self.partial = self._partial_group = None
        self.materialize()
        if partial is not None:  # after reshard_to: gather among the smaller group
            inp, group = partial, partial_group
        elif self.quantized is not None:  # see [quantized-all-gather]
            return self._quantized_all_gather(async_op)
        elif self.offload:
            # Offloaded shard: one host-to-device copy (and cast) of the whole shard, always a
            # copy (also when device is the CPU: the same code path everywhere).
            inp = self.shard.to(device=self.device, dtype=self.param_dtype,
                                non_blocking=self._pin, copy=True)
        elif self.param_dtype == self.dtype:
            inp = self.shard
        else:
            inp = self.shard.to(self.param_dtype)  # one cast for the whole group
        if self.world_size == 1:
            self.full.copy_(inp)
            return CommHandle(None)
        extra = inp.numel() * inp.element_size() if inp is not self.shard else 0
        self._comm_bytes += extra
        work = all_gather_into(self.full, inp, rank=self.rank, world_size=self.world_size,
                               group=group, async_op=async_op,
                               fuse=partial is None and self._cpu and self._on_gloo())

        def epilogue(inp=inp) -> None:  # keep ``inp`` alive until the collective finished
            self._comm_bytes -= extra

        handle = CommHandle(work, epilogue)
        if not async_op:
            handle.wait()
        return handle

    def _quantized_all_gather(self, async_op: bool) -> CommHandle:
        src = self.shard.to(self.device, non_blocking=self._pin) if self.offload else self.shard
        assert self.quantized is not None  # its buffers count in memory_bytes()["comm"]
        handle = CommHandle(*self.quantized.all_gather(src, self.full, group=self.group,
                                                       async_op=async_op))
        if not async_op:
            handle.wait()
        return handle

    def reduce_scatter(self, async_op: bool = False, op: str | dist.ReduceOp = "avg",
                       accumulate: bool = False, scale: float | None = None,
                       all_reduce: bool = True) -> CommHandle:
        """Reduce :attr:`grad_full` across ranks into the owned :attr:`grad_shard`, in place.

        ``accumulate=True`` adds onto the existing sharded gradients. ``scale`` multiplies the
        reduced shard (``op="sum"`` then ``1 / factor``: ``set_gradient_divide_factor``). HSDP,
        ``all_reduce=False`` (``set_requires_all_reduce(False)``): reduce-scatter within the
        shard group into :attr:`grad_partial`, added in by the next reduce with the all-reduce
        ([dbuffer-collectives]). :attr:`grad_full` is *not* freed: :meth:`free_grad` after it.
        """
        self._check_collective()
        rop = _resolve_op(op)
        with label("vescale::reduce_scatter"):
            return self._reduce_scatter(async_op, rop, accumulate, scale, all_reduce)

    def _on_gloo(self) -> bool:
        """Whether gloo serves ``device`` here: AVG is a SUM and one division (gloo's own AVG:
        4.3 vs 3.1 ms for 3.2 MB at 2 ranks), a SUM reduce-scatter an all-to-all plus a sum."""
        if self._gloo is None:
            self._gloo = dist.is_initialized() and gloo_serves(self.group, self.device)
        return self._gloo

    def _gloo_reduce_scatter_sum(self, out: torch.Tensor, inp: torch.Tensor,
                                 async_op: bool, wire: torch.dtype | None = None) -> Any:
        """``out = sum over ranks of inp[rank slice]`` on gloo, or in ``wire`` on any backend
        (design note [dbuffer-collectives]); the temporaries count as communication memory."""
        nbytes = self.world_size * self.shard_size * (wire or inp.dtype).itemsize * (1 + bool(wire))
        self._comm_bytes += nbytes

        def release() -> None:
            self._comm_bytes -= nbytes

        return wire_reduce_scatter_sum(out, inp, wire=wire, rank=self.rank, group=self.group,
                                       world_size=self.world_size, async_op=async_op,
                                       release=release, fuse=self._cpu and self._on_gloo())

    @property
    def fused_gather_bytes(self) -> int | None:
        """:meth:`all_gather`'s bytes if it is queued with other small gloo collectives."""
        nbytes = self.buffer_size * self.param_dtype.itemsize
        return nbytes if self.quantized is None and self.world_size > 1 and self._cpu \
            and self._on_gloo() and fusable(nbytes) else None

    @property
    def fused_reduce_bytes(self) -> int | None:
        """The reduce-scatter's bytes if it is queued with other small gloo collectives."""
        wire, gloo = self.wire_dtype, self._cpu and self._on_gloo()
        nbytes = self.buffer_size * (wire or self.reduce_dtype).itemsize
        return nbytes if reduce_scatter_fuses(self.world_size, gloo, wire, nbytes) else None

    def _reduce_scatter(self, async_op: bool, rop: dist.ReduceOp, accumulate: bool,
                        scale: float | None = None, all_reduce: bool = True) -> CommHandle:
        wire = self.wire_dtype
        # a wire dtype always takes the all-to-all form: AVG is a SUM and a division, as gloo's
        rop, pre, post, scale = reduce_factors(
            rop, scale, ranks=self.world_size * self.replicate_size,
            reduce_dtype=self.reduce_dtype, gloo=self._on_gloo() or wire is not None)
        if wire is not None and rop not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"DBuffer {self.name!r}: a reduce_scatter_dtype supports op 'sum' "
                             f"and 'avg' only, got {rop}")
        # offload: the collective writes on device; the epilogue copies the shard to the host
        partial = self.replicate_group is not None and not all_reduce
        direct = (not accumulate and self.reduce_dtype == self.dtype and not self.offload
                  and wire is None and not partial)
        # a copy overwrites every element; a partial reduce does not touch the grad shard
        gs = None if partial else self._ensure_grad_shard(zero=accumulate)
        if self.grad_acc is not None:  # unsynced micro-batches, summed in reduce_dtype
            inp, self.grad_acc = self.grad_acc, None
            inp.add_(self.grad_full)  # the last micro-batch, added in reduce_dtype in place
        elif self.reduce_dtype == self.param_dtype:
            inp = self.grad_full
        else:
            inp = self.grad_full.to(self.reduce_dtype)  # one cast for the whole group
        if pre is not None and pre != 1:
            inp.div_(pre)  # grad_full is freed after the reduce: dividing in place is safe
        sum_dtype = (self.reduce_dtype if wire is None
                     else torch.promote_types(torch.float32, self.reduce_dtype))
        out = gs if direct else torch.empty(self.shard_size, dtype=sum_dtype, device=self.device)
        extra = sum(t.numel() * t.element_size() for t, own in ((inp, self.grad_full), (out, gs))
                    if t is not own)
        self._comm_bytes += extra

        def epilogue(inp=inp, out=out) -> None:
            if post is not None and post != 1:
                out.div_(post)
            if scale is not None:
                out.mul_(scale)
            if out is not gs:
                if self.offload:
                    self._offload_event = offload_copy(gs, out, accumulate=accumulate,
                                                       non_blocking=self._pin)
                elif accumulate:
                    gs.add_(out)
                else:
                    gs.copy_(out)
            self._comm_bytes -= extra

        if wire is not None:  # cast (fp16: scaled per rank) in the all-to-all form, fp32 sums
            work = self._gloo_reduce_scatter_sum(out, inp, async_op, wire=wire)
        elif self.world_size == 1:
            out.copy_(inp[: self.shard_size])
            work = None
        elif rop == dist.ReduceOp.SUM and self._on_gloo():
            # all-to-all + local sum (in out's dtype): see [dbuffer-collectives]
            work = self._gloo_reduce_scatter_sum(out, inp, async_op)
        else:
            work = _reduce_scatter_flat(out, inp, op=rop, group=self.group, async_op=async_op)
        if partial:
            def keep_partial(out=out) -> None:
                # the shard group's sum of this micro-batch, before ``post`` and ``scale``
                # (linear: applied once, to the total, after the all-reduce)
                if self.grad_partial is None:
                    self.grad_partial = out
                else:
                    self.grad_partial.add_(out)
                self._comm_bytes -= extra

        elif self.replicate_group is not None:
            work = self._replica_stage(work, out, rop, async_op)
        handle = CommHandle(work, keep_partial if partial else epilogue)
        if not async_op:
            handle.wait()
        return handle

    def _replica_stage(self, work: Any, out: torch.Tensor, rop: dist.ReduceOp,
                       async_op: bool) -> Any:
        """HSDP, after the shard group's reduce-scatter into ``out``: add ``grad_partial``,
        then all-reduce ``out`` across the replicas ([dbuffer-collectives])."""
        if self.grad_partial is not None:
            # the micro-batches reduced without the all-reduce join this one before it (an
            # accelerator's current stream waits for this reduce-scatter: last micro-batch only)
            if work is not None:
                with label("vescale::comm_wait"):
                    work.wait()
                work = None
            out.add_(self.grad_partial)
            self.grad_partial = None
        # after the reduce-scatter (a side stream on accelerators); AVG averages per stage
        return replica_all_reduce(work, out, op=rop, group=self.replicate_group,
                                  async_op=async_op, wire=self.wire_dtype,
                                  size=self.replicate_size)

    def wait_offload(self) -> None:
        """Wait for the asynchronous copy of the reduced gradient shard to the host (offload,
        pinned; [dbuffer-offload]): the root's final callback does, once per backward."""
        event, self._offload_event = self._offload_event, None
        if event is not None:
            event.synchronize()
