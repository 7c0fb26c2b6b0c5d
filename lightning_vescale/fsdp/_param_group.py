"""One sharding group: the parameters of one ``fully_shard`` call, their DBuffers and swaps.

Design note [fsdp-param-objects]
--------------------------------
Every managed parameter has two long-lived ``nn.Parameter`` objects:

* ``sharded``: a DTensor with placements ``(RaggedShard,)`` (HSDP: ``(Replicate(),
  RaggedShard)``) whose local tensor is a 1-D view of the DBuffer's owned slice. This is what modules hold *at rest*: optimizers, ``state_dict()``
  and ``named_parameters()`` see it, and its ``.grad`` is a DTensor view of the sharded
  gradient slice.
* ``unsharded``: a plain tensor over the DBuffer's unsharded storage (design note
  [dbuffer-views]). Modules hold it while the group computes. Its storage is freed between
  uses, but the object lives on, so the autograd graph recorded in forward stays valid.

Swapping is a dict assignment in each owner's ``_parameters`` (tied parameters have several
owners), as in FSDP2. Both objects are rebuilt only when the module moves device/dtype
(``_apply``, see design note [fsdp-materialize]). :attr:`ParamGroup.modules_hold_unsharded` says
which of the two the modules hold; :attr:`ParamGroup.is_unsharded` is also true while an
all-gather that will give them the unsharded ones is in flight (a prefetch).

Design note [fsdp-grads]
------------------------
Gradients land directly in the grad buffer: before the first gradient of a backward reaches a
parameter (a tensor hook on the unsharded leaf, which runs before ``AccumulateGrad``), the group
materialises ``grad_full`` (one zero kernel) and points every unsharded parameter's ``.grad`` at
its view. ``AccumulateGrad`` then adds in place (``grad += new``) instead of allocating. A
post-accumulate-grad hook records the arrival (it times the backward prefetch only). When the
group's backward is complete (a structural point, the same on every rank: design note
[fsdp-schedule]) every buffer holding trainable parameters is reduce-scattered as a whole,
with zeros where this rank received no gradient, so the collectives never depend on local
data. With gradient sync off, grads stay in ``grad_full`` across backwards and are reduced at
the first synced one. After the backward, each parameter that received a gradient on *any*
rank gets ``sharded.grad`` = a DTensor view into the sharded gradient
(:meth:`ParamGroup.publish_grads`); parameters that received none anywhere keep ``grad=None``,
as in single-process training.

The group keeps its own backward bookkeeping: ``needs_reduce`` (set by the structural events
of design note [fsdp-schedule], cleared by a reduce-scatter), the first gradient (materialise
``grad_full``; make sure the root's final callback is queued), the arrivals that time the
early backward prefetch (once half of the trainable parameters have a gradient; at most once
per backward) and its :class:`~lightning_vescale.fsdp._common.TrainingState`. Whether the group
reduce-scatters now is decided in one place, :meth:`ParamGroup.should_reduce`. What is
root-wide (which group to prefetch, the final callback) the group asks of the root context
(:class:`BackwardRoot`), never of a module state.

Design note [fsdp-buffer-order]
-------------------------------
Inside a DBuffer, parameters of two or more dims (weight matrices, embeddings) come first and
the others (biases, norm scales, scalars) after them, each in module order. The usual recipe
puts weight decay on the matrices only; with this order each of its two param groups is one
contiguous run per buffer, so the flat optimizer step and ``FlatParamOptimizer`` step 2 flat
tensors per group instead of one per parameter (on the 292-tensor GPT: 50 instead of 145).
The planner keeps the order it is given (design note in ``planner/_layout``); checkpoints are
keyed by parameter name and global boxes, so the order never shows outside a group.

Parameters that are frozen when the group is built (``requires_grad=False``: a frozen base
model under LoRA, say) go into a DBuffer of their own, which never allocates a gradient buffer
and is never reduce-scattered: gradient memory and reduce-scatter traffic follow the trainable
parameters only. Everything above is per buffer and per parameter, so a parameter unfrozen
later simply makes its buffer carry gradients from then on; no rebuild is needed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from lightning_vescale.dbuffer import CommHandle, DBuffer
from lightning_vescale.fsdp._common import TrainingState
from lightning_vescale.fsdp._policy import CPUOffloadPolicy, MixedPrecisionPolicy
from lightning_vescale.fsdp._replaced import mark_replaced
from lightning_vescale.fsdp._reshard import ReshardPolicy
from lightning_vescale.fsdp._subgroups import partial_group
from lightning_vescale.mesh import MeshInfo
from lightning_vescale.placement import ragged_from_local
from lightning_vescale.planner import plan_layout

__all__ = ["BackwardRoot", "ManagedParam", "Owner", "ParamGroup", "set_param"]

class Owner(NamedTuple):
    """A module that registers a parameter, and the attribute name it uses."""

    module: nn.Module
    attr: str


def set_param(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<attr>`` without nn.Module.__setattr__'s checks."""
    if getattr(module.__setattr__, "__func__", None) is nn.Module.__setattr__:
        module._parameters[attr] = param
    else:  # a module overriding __setattr__: honour it
        setattr(module, attr, param)


@dataclass(eq=False, kw_only=True)
class ManagedParam:
    """One parameter of a group (see design note [fsdp-param-objects])."""

    name: str  # name relative to the group's module; key in the plan and DBuffer
    owners: list[Owner]
    shape: tuple[int, ...]
    requires_grad: bool
    buffer: DBuffer | None = None
    sharded: nn.Parameter | None = None
    unsharded: nn.Parameter | None = None
    got_grad: bool = False  # received a gradient since its last reduce-scatter
    aliases: list[str] = field(default_factory=list)  # all names (tied params have several)
    #: all names relative to module ``k`` of a ``fully_shard([...])`` list, as ``(k, name)``
    scoped_aliases: list[tuple[int, str]] = field(default_factory=list)
    #: weak reference to the user's parameter before sharding (tie detection by later groups)
    original_weakref: weakref.ref | None = None
    hooks: list[Any] = field(default_factory=list)
    #: the DTensor placements of ``sharded`` and its gradient: ``(RaggedShard,)`` on a 1-D
    #: mesh, ``(Replicate(), RaggedShard)`` on an HSDP mesh. Set with the buffer at each build;
    #: one tuple per parameter, so ``ragged_from_local``'s per-step spec cache hits.
    placements: Any = None


class BackwardRoot(Protocol):
    """What a group's gradient hooks ask of the root (``_state.RootContext`` implements it)."""

    def queue_final_callback(self) -> None:
        """Make sure the end-of-backward callback runs after this backward."""

    def prefetch_backward(self, group: "ParamGroup") -> None:
        """All-gather the group that follows ``group`` in the recorded backward order."""


class ParamGroup:
    """The parameters of one ``fully_shard`` call, bucketed into one DBuffer per dtype.

    Not a public constructor: :func:`lightning_vescale.fsdp.fully_shard` builds it. The
    strategy, optimizers and the memory profiler may read :attr:`params` and :attr:`buffers`.

    Args:
        params: the managed parameters (names relative to the group's module).
        mesh_info: the shard group (every DBuffer and DTensor of the group uses it).
        mp_policy: the user's policy, kept whole: DBuffer dtypes come from it.
        granularity: block size in elements per parameter name (resolved by ``fully_shard``).
        reshard_policy: what the group does with its gathered parameters after forward
            (design note [fsdp-reshard-policy]); ``set_reshard_after_forward`` replaces it.
        fqn: a label for buffer names and error messages.
        offload: ``CPUOffloadPolicy``: shards and sharded gradients in CPU memory.
    """

    def __init__(self, *, params: list[ManagedParam], mesh_info: MeshInfo,
                 mp_policy: MixedPrecisionPolicy, granularity: dict[str, int],
                 reshard_policy: ReshardPolicy, fqn: str = "",
                 offload: CPUOffloadPolicy | None = None) -> None:
        self.fqn = fqn
        self.params = params
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        self.granularity = granularity
        self.reshard_policy = reshard_policy
        self.offload = offload
        self.reduce_grads = True  # set_requires_gradient_sync
        # FSDPModule setters (design note [fsdp-module] in _module.py)
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.gradient_divide_factor: float | None = None  # None: the shard-group size (AVG)
        self.force_sum_reduction = False
        self.explicit_backward_prefetch: list[ParamGroup] | None = None
        # list groups: (the ``_apply`` function, modules of the list it reached) of the last pass
        self.applying: tuple[Any, set[int]] | None = None
        # One DBuffer per (dtype, trainable at build time); see design note [fsdp-grads].
        self.buffers: dict[tuple[torch.dtype, bool], DBuffer] = {}
        self.modules_hold_unsharded = False
        self._gather: list[CommHandle] | None = None  # in-flight all-gathers
        self._reduce: list[CommHandle] | None = None  # in-flight reduce-scatters
        self._num_trainable = 0
        # -- backward bookkeeping (design note [fsdp-grads]) --
        self.root: BackwardRoot | None = None  # set by the root's lazy init
        self.training_state = TrainingState.IDLE
        # Structural (the same on every rank): the group's gradients must be reduced since it
        # ran forward with grad / was recomputed with grad / got output gradients.
        self.needs_reduce = False
        self.reduced = False  # reduce-scattered in the current backward
        self._grads_ready = False  # grad_full materialised and unsharded .grads point at it
        self._arrived = 0  # trainable parameters that received a gradient in this backward
        self._backward_prefetched = False

    # -- construction --------------------------------------------------------------------------
    def build(self, sources: dict[str, torch.Tensor], device: torch.device,
              local_sources: bool = False) -> None:
        """(Re)create DBuffers on ``device`` and both parameter objects of every parameter.

        ``sources[name]`` provides each parameter's data and dtype: the full tensor (global
        shape), or with ``local_sources`` the rank's 1-D local part. Meta sources copy nothing.
        """
        for mp in self.params:
            self._remove_grad_hooks(mp)
        buckets: dict[tuple[torch.dtype, bool], list[ManagedParam]] = {}
        for mp in self.params:
            buckets.setdefault((sources[mp.name].dtype, mp.requires_grad), []).append(mp)
        self.buffers = {}
        policy = self.mp_policy
        for (dtype, trainable), mps in buckets.items():
            mps = sorted(mps, key=lambda mp: len(mp.shape) < 2)  # [fsdp-buffer-order]
            specs = [(mp.name, mp.shape, self.granularity[mp.name]) for mp in mps]
            plan = plan_layout(specs, self.mesh_info.shard_size)
            if dtype.is_floating_point:
                pdt = policy.param_dtype if policy.param_dtype is not None else dtype
                rdt = policy.reduce_dtype if policy.reduce_dtype is not None else pdt
            else:  # integer/bool parameters (never trainable) keep their dtype: no cast
                pdt = rdt = dtype
            buf = DBuffer(plan, dtype=dtype, device=device, mesh_info=self.mesh_info,
                          param_dtype=pdt, reduce_dtype=rdt,
                          name=f"{self.fqn or '<root>'}[{dtype}{'' if trainable else ', frozen'}]",
                          offload=self.offload is not None,
                          pin_memory=self.offload is not None and self.offload.pin_memory)
            self.buffers[(dtype, trainable)] = buf
            for mp in mps:
                mp.buffer = buf
                src = sources[mp.name]
                if src.device.type != "meta" and device.type != "meta":
                    with torch.no_grad():
                        if local_sources:
                            buf.local_view(mp.name).copy_(src.reshape(-1))
                        else:
                            buf.load_local_(mp.name, src)
                self._make_param_objects(mp)
        self._arrived = 0
        self._count_trainable()
        self._grads_ready = False
        self.modules_hold_unsharded = False
        self._gather = None
        self._reduce = None
        self.swap(sharded=True)

    def _make_param_objects(self, mp: ManagedParam) -> None:
        buf = mp.buffer
        assert buf is not None
        if mp.sharded is not None:  # a rebuild: an optimizer holding the old one trains nothing
            mark_replaced(mp.sharded, f"{self.fqn}.{mp.name}" if self.fqn else mp.name,
                          original=False)
        local = buf.local_view(mp.name)
        mp.placements = self.mesh_info.placements(buf.placement(mp.name))
        dt = ragged_from_local(local, self.mesh_info.mesh, mp.placements, mp.shape,
                               autograd=False, check=False)
        mp.sharded = nn.Parameter(dt, requires_grad=mp.requires_grad)
        mp.unsharded = nn.Parameter(buf.param_view(mp.name), requires_grad=mp.requires_grad)
        mp.got_grad = False
        if not buf.is_meta and mp.requires_grad:
            self._register_grad_hooks(mp)

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` calls users made on the sharded parameters."""
        for mp in self.params:
            assert mp.sharded is not None and mp.unsharded is not None
            rg = mp.sharded.requires_grad
            if rg != mp.requires_grad:
                mp.requires_grad = rg
                mp.unsharded.requires_grad_(rg)
                self._remove_grad_hooks(mp)
                if rg:
                    self._register_grad_hooks(mp)
        self._count_trainable()

    def _count_trainable(self) -> None:
        self._num_trainable = sum(1 for mp in self.params if mp.requires_grad)

    def trainable(self) -> list[ManagedParam]:
        """The parameters that take part in reduce-scatters (a fixed order on every rank)."""
        return [mp for mp in self.params if mp.requires_grad and mp.buffer is not None]

    # -- unshard / reshard ----------------------------------------------------------------------
    def swap(self, *, sharded: bool) -> None:
        """Register the sharded (or the unsharded) parameter objects in every owner module."""
        for mp in self.params:
            p = mp.sharded if sharded else mp.unsharded
            assert p is not None
            for owner in mp.owners:
                set_param(owner.module, owner.attr, p)
        self.modules_hold_unsharded = not sharded

    @property
    def is_unsharded(self) -> bool:
        """True while modules hold the unsharded parameters or an all-gather for them is in
        flight (a prefetch): :meth:`unshard` has nothing left to start."""
        return self.modules_hold_unsharded or self._gather is not None

    def unshard(self, async_op: bool = False) -> None:
        """Start (or run) the all-gather of every buffer; no-op if already (being) unsharded."""
        if self.is_unsharded:
            if not async_op:
                self.wait_for_unshard()
            return
        self._gather = [buf.all_gather(async_op=async_op) for buf in self.buffers.values()]
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather and register the unsharded parameters."""
        self._wait_for_gather()
        if not self.modules_hold_unsharded:
            self.swap(sharded=False)

    def reshard(self) -> None:
        """Free the unsharded storage and register the sharded parameters."""
        self._wait_for_gather()
        for buf in self.buffers.values():
            buf.free()
        if self.modules_hold_unsharded:
            self.swap(sharded=True)

    def reshard_after_forward_now(self, ranks: int) -> None:
        """The post-forward reshard: stay sharded over ``ranks`` ranks, i.e. all of them
        (reshard), ``1`` (keep everything gathered), or groups of ``k`` (design note
        [dbuffer-memory]'s ``partial``). ``ranks`` comes from
        :meth:`ReshardPolicy.ranks_after_forward` (design note [fsdp-reshard-policy])."""
        if ranks >= self.mesh_info.shard_size:
            self.reshard()
        elif ranks > 1:
            group, rank = partial_group(self.mesh_info, ranks)
            self._wait_for_gather()
            for buf in self.buffers.values():
                buf.reshard_to(group, ranks, rank)
            if self.modules_hold_unsharded:
                self.swap(sharded=True)

    @property
    def has_partial(self) -> bool:
        """Whether a buffer keeps a ``reshard_after_forward=<int>`` chunk."""
        return any(buf.partial is not None for buf in self.buffers.values())

    def _wait_for_gather(self) -> None:
        if self._gather is not None:
            for h in self._gather:
                h.wait()
            self._gather = None

    # -- backward bookkeeping (design notes [fsdp-grads], [fsdp-training-state]) ----------------
    def expect_gradients(self) -> None:
        """Mark that this group's gradients must be reduced (a structural event: a forward with
        grad, a recompute with grad inside backward, or gradients reaching its outputs)."""
        if self._num_trainable:
            self.needs_reduce = True

    def should_reduce(self) -> bool:
        """Whether the group reduce-scatters its gradients now: the one place that decides.

        Gradient sync must be on and the group must need a reduce (``needs_reduce``, which a
        reduce-scatter clears: a group reduced once in a backward is not reduced again).
        """
        return self.reduce_grads and self.needs_reduce

    def pre_backward(self) -> None:
        """A gradient reached the group's outputs: unshard for backward."""
        self.training_state = TrainingState.PRE_BACKWARD
        # E.g. a second backward through a retained graph after the first one reduced the
        # group: this backward's gradients must be reduced too.
        self.expect_gradients()
        if self.unshard_in_backward:
            self.unshard()
            self.wait_for_unshard()
        if self._num_trainable == 0 or self.explicit_backward_prefetch is not None:
            self.prefetch_backward_once()  # else when half of the gradients arrived

    def post_backward(self) -> None:
        """The group's backward is complete (on every rank at this point): reshard.

        A backward prefetch the gradient arrivals did not trigger yet is issued first, so every
        rank issues the next group's all-gather before this group's reduce-scatter; the caller
        then reduces if :meth:`should_reduce`.
        """
        self.training_state = TrainingState.POST_BACKWARD
        self.prefetch_backward_once()
        if self.reshard_after_backward:
            self.reshard()  # parameters are done: free them before the reduce-scatter runs

    def prefetch_backward_once(self) -> None:
        """Ask the root to all-gather the next group in backward order, once per backward."""
        if self._backward_prefetched or self.root is None:
            return
        self._backward_prefetched = True
        if self.explicit_backward_prefetch is not None:  # set_modules_to_backward_prefetch
            for group in self.explicit_backward_prefetch:
                if group.training_state is TrainingState.IDLE and group.unshard_in_backward:
                    group.unshard(async_op=True)
            return
        self.root.prefetch_backward(self)

    def reset_backward(self) -> None:
        """Forget this iteration's backward (the end of a backward, or the root's pre-forward)."""
        self.training_state = TrainingState.IDLE
        self._arrived = 0
        self.reduced = False
        self._backward_prefetched = False

    # -- gradients (design note [fsdp-grads]) ---------------------------------------------------
    def _register_grad_hooks(self, mp: ManagedParam) -> None:
        assert mp.unsharded is not None
        mp.hooks.append(mp.unsharded.register_hook(self._make_grad_pre_hook(mp)))
        mp.hooks.append(mp.unsharded.register_post_accumulate_grad_hook(
            self._make_grad_post_hook(mp)))

    @staticmethod
    def _remove_grad_hooks(mp: ManagedParam) -> None:
        for h in mp.hooks:
            h.remove()
        mp.hooks.clear()

    # Hooks on tensors live in C++ (invisible to Python's cycle collector), so they refer to
    # the group and the parameter entry weakly: a strong closure would keep the whole model
    # alive forever through tensor -> hook -> group -> tensor.
    def _make_grad_pre_hook(self, mp: ManagedParam) -> Callable[[torch.Tensor], None]:
        group_weakref = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            group = group_weakref()
            if group is not None:
                group._on_gradient(mp)
        return hook

    def _make_grad_post_hook(self, mp: ManagedParam) -> Callable[[torch.Tensor], None]:
        group_weakref, mp_weakref = weakref.ref(self), weakref.ref(mp)

        def hook(param: torch.Tensor) -> None:
            group, entry = group_weakref(), mp_weakref()
            if group is not None and entry is not None:
                group._on_gradient_accumulated(entry)
        return hook

    def _on_gradient(self, mp: ManagedParam) -> None:
        """A gradient is about to be accumulated into ``mp`` (before ``AccumulateGrad``)."""
        if self._grads_ready and not self.reduced and not torch.is_grad_enabled():
            # Every gradient after the group's first: nothing to prepare (runs once per
            # parameter per backward, so kept free of the profiler label and the checks below).
            if self.root is not None:
                self.root.queue_final_callback()
            return
        with record_function("vescale::grad_arrival"):
            if self.reduced:
                name = f"{self.fqn}.{mp.name}" if self.fqn else mp.name
                raise RuntimeError(
                    f"fully_shard: parameter {name!r} received its gradient after its group was "
                    "reduce-scattered, i.e. after the gradients of its module's inputs were "
                    "computed. A parameter's gradient must be computed within its module's "
                    "backward: use the parameter in a computation that involves the module's "
                    "inputs, or move it to a group (module) of its own.")
            if torch.is_grad_enabled():
                # backward(create_graph=True): AccumulateGrad then writes `grad + new` out of
                # place, so the gradient would leave the grad buffer and be lost.
                raise NotImplementedError(
                    "fully_shard does not support backward(create_graph=True) / "
                    "torch.autograd.grad(..., create_graph=True) through sharded parameters "
                    "(higher-order gradients): gradients are reduce-scattered from a flat "
                    "buffer that an out-of-place gradient would bypass. Compute the "
                    "higher-order term on an unsharded copy of the model instead.")
            self.prepare_grads()
            if self.root is not None:
                self.root.queue_final_callback()

    def _on_gradient_accumulated(self, mp: ManagedParam) -> None:
        """``mp``'s gradient was accumulated: count it (it times the backward prefetch only)."""
        mp.got_grad = True
        self._arrived += 1
        if self._arrived == max(1, self._num_trainable // 2):
            # Late enough not to coincide with the activation peak at the start of the group's
            # backward, early enough to overlap its second half. Timing only, never a reduce.
            self.prefetch_backward_once()

    def prepare_grads(self) -> None:
        """Materialise (zeroed) ``grad_full`` and point unsharded ``.grad``s at it."""
        if self._grads_ready:
            return
        self._grads_ready = True
        trainable = {id(mp.buffer) for mp in self.params if mp.requires_grad}
        for buf in self.buffers.values():
            if id(buf) in trainable:
                buf.materialize_grad()  # a buffer of frozen parameters never gets one
        for mp in self.params:
            if mp.requires_grad:
                assert mp.unsharded is not None and mp.buffer is not None
                view = mp.buffer.grad_view(mp.name)
                g = mp.unsharded.grad
                if g is None or g.data_ptr() != view.data_ptr():
                    if g is not None:  # a gradient outside the buffer: fold it in
                        with torch.no_grad():
                            view.add_(g)
                    mp.unsharded.grad = view

    def discard_gradients(self) -> None:
        """Drop unreduced gradients (unsharded, and the unsynced accumulators): the recovery of
        ``reset_iter_state()``. Sharded gradients already published stay."""
        self.wait_for_reduce()
        for buf in self.buffers.values():
            buf.free_grad()
            buf.grad_acc = None
        self._grads_ready = False
        self.needs_reduce = False
        for mp in self.params:
            mp.got_grad = False
            if mp.unsharded is not None:
                mp.unsharded.grad = None

    def reduce_scatter(self, async_op: bool = True, op: str | None = None) -> None:
        """Launch the reduce-scatter of every buffer that holds trainable parameters.

        Every such buffer is reduced, whether or not this rank received gradients for it (a
        rank without any contributes zeros): which collectives run must not depend on local
        data (design note [fsdp-grads]). Sharded gradients are published later, by
        :meth:`publish_grads`, once every rank's arrivals are known.
        """
        assert self._reduce is None, "a reduce-scatter is already in flight"
        scale = None
        if op is None:
            if self.gradient_divide_factor is not None:  # set_gradient_divide_factor
                op, scale = "sum", 1.0 / self.gradient_divide_factor
            elif self.force_sum_reduction:  # set_force_sum_reduction_for_comms
                op, scale = "sum", 1.0 / self.mesh_info.data_parallel_size
            else:
                op = "avg"
        handles = []
        for buf in self.buffers.values():
            mps = [mp for mp in self.params if mp.buffer is buf and mp.requires_grad]
            if not mps:
                continue  # parameters frozen at build time: no gradient buffer
            buf.materialize_grad()  # no-op if gradients arrived; zeros if none did on this rank
            # Accumulate onto the grad shard if ANY parameter of the buffer still holds a
            # gradient (no zero_grad since the last reduce), not only those with a new one: a
            # plain reduce-scatter overwrites the whole shard, kept gradients included.
            accumulate = any(mp.sharded is not None and mp.sharded.grad is not None
                             for mp in mps)
            if accumulate:
                self._prepare_accumulate(mps)
            handles.append(buf.reduce_scatter(async_op=async_op, op=op, accumulate=accumulate,
                                              scale=scale))
        self._reduce = handles
        self.reduced = True
        self.needs_reduce = False
        if not async_op:
            self.wait_for_reduce()

    def accumulate_unsynced(self) -> None:
        """End of a backward without gradient sync: sum its gradients in ``reduce_dtype``.

        With ``set_requires_gradient_sync(False)`` gradients stay unsharded until the next
        synced backward. When the policy's ``reduce_dtype`` differs from ``param_dtype`` (bf16
        compute, fp32 reduction) each buffer folds this backward's ``grad_full`` into its
        ``reduce_dtype`` accumulator and frees it (``DBuffer.accumulate_grad``), so micro-batches
        are summed in fp32 as with FSDP2, not in bf16. Idempotent; a no-op for buffers without
        new gradients or whose dtypes agree (those keep accumulating in ``grad_full``).
        """
        if self._reduce is not None:
            return
        folded = False
        for buf in self.buffers.values():
            if buf.accumulates_in_reduce_dtype and buf.is_grad_materialized:
                buf.accumulate_grad()
                folded = True
        if not folded:
            return
        self._grads_ready = False  # the next gradient re-materialises and re-points
        for mp in self.params:
            if mp.unsharded is not None and mp.buffer is not None \
                    and not mp.buffer.is_grad_materialized:
                mp.unsharded.grad = None  # re-pointed at a fresh grad_full next backward

    def _prepare_accumulate(self, mps: list[ManagedParam]) -> None:
        # Rare path: the user kept sharded grads from an earlier step (no zero_grad or
        # zero_grad(set_to_none=False)). Regions without a kept gradient start from zero;
        # foreign grads are folded into the buffer so the reduce adds onto the right values.
        for mp in mps:
            assert mp.sharded is not None and mp.buffer is not None
            view = mp.buffer.grad_local_view(mp.name)
            g = mp.sharded.grad
            with torch.no_grad():
                if g is None:
                    view.zero_()
                elif not self._is_our_grad(mp, g):
                    local = g.to_local() if isinstance(g, DTensor) else g
                    view.copy_(local.reshape(-1))

    @staticmethod
    def _is_our_grad(mp: ManagedParam, g: torch.Tensor) -> bool:
        assert mp.buffer is not None
        if not isinstance(g, DTensor):
            return False
        view = mp.buffer.grad_local_view(mp.name)
        local = g._local_tensor
        return (local.data_ptr() == view.data_ptr() and local.numel() == view.numel()
                and local.untyped_storage().data_ptr() == view.untyped_storage().data_ptr())

    def wait_for_reduce(self) -> None:
        """Finish in-flight reduce-scatters and free ``grad_full``."""
        if self._reduce is None:
            return
        handles, self._reduce = self._reduce, None
        for h in handles:
            h.wait()
        for buf in self.buffers.values():
            buf.free_grad()
        self._grads_ready = False
        for mp in self.params:
            if mp.unsharded is not None:
                mp.unsharded.grad = None  # its storage is gone; re-pointed next backward

    def publish_grads(self, received: list[bool]) -> None:
        """Give each parameter that received a gradient on ANY rank its sharded gradient.

        ``received[i]`` is that global fact for ``trainable()[i]`` (an all-reduce over ranks,
        done once per backward by the root). A parameter no rank computed a gradient for keeps
        ``grad=None`` (or the gradient kept from before), as in single-process training.
        """
        published: dict[DBuffer, dict[int, torch.Tensor]] = {
            buf: {} for buf in self.buffers.values()}
        for mp, got in zip(self.trainable(), received):
            mp.got_grad = False
            assert mp.sharded is not None and mp.buffer is not None
            g = mp.sharded.grad
            if not got:  # keeps a gradient from an earlier backward, if any
                if (g is not None and mp.buffer.grad_shard is not None
                        and self._is_our_grad(mp, g)):
                    published[mp.buffer][id(mp.sharded)] = g
                continue
            if g is None or not self._is_our_grad(mp, g):
                view = mp.buffer.grad_local_view(mp.name)
                g = mp.sharded.grad = ragged_from_local(
                    view, self.mesh_info.mesh, mp.placements, mp.shape,
                    autograd=False, check=False)
            published[mp.buffer][id(mp.sharded)] = g
        # Readers of many gradients at once check identity against this record instead of
        # every gradient's memory (design note [dbuffer-published-grads]).
        for buf, grads in published.items():
            buf.record_published_grads(grads)

    def release_unused_grad_shards(self) -> None:
        """Free sharded-gradient storage of buffers whose parameters all have ``grad=None``.

        Called at the start of each iteration: after ``optimizer.zero_grad()`` (set_to_none)
        the sharded gradients cost no memory until the next reduce-scatter, as in FSDP2.
        """
        for buf in self.buffers.values():
            if buf.grad_shard is None or self._reduce is not None:
                continue
            if all(mp.sharded is None or mp.sharded.grad is None
                   for mp in self.params if mp.buffer is buf):
                buf.release_grad_shard()
