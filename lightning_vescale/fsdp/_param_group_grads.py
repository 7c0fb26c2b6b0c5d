"""The gradient half of a group: hooks, grad buffer, reduce-scatter, accumulation, publication.

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
per backward) and its :class:`~lightning_vescale.fsdp._training_state.TrainingState`. Whether the group
reduce-scatters now is decided in one place, :meth:`ParamGroup.should_reduce`. What is
root-wide (which group to prefetch, the final callback) the group asks of the root context
(:class:`BackwardRoot`), never of a module state.

Design note [fsdp-post-acc-grad-hooks]
--------------------------------------
Optimizer in backward: users register ``register_post_accumulate_grad_hook`` on the sharded
parameters (what ``model.parameters()`` gives at rest). Autograd never accumulates into those
(gradients land in the unsharded parameters' grad buffer), so autograd never calls their hooks;
as FSDP2 (``foreach_reduce``), the group calls them itself on the reduced sharded gradient:
:meth:`GroupGradients.run_post_reduce_hooks`, which the root calls right after the group's
reduce-scatter finished (synchronously on CPU, at the wait of an asynchronous one), once per
reduce, within the backward. Each parameter that received a gradient on this rank then has its
sharded gradient published (a DTensor over the reduced shard, as :meth:`publish_grads` gives
it) and its hooks called with the sharded parameter; an offloaded shard's copy to the host is
waited first (FSDP2 also refuses to overlap that copy with a hook). A hook may step an
optimizer and set ``grad = None``: that parameter is then not published again at the end of the
backward. A parameter that received no gradient here but did on another rank (an expert routed
elsewhere) is known to have one only after the end-of-backward flag all-reduce (design note
[fsdp-final-callback]): its hooks run there, in :meth:`publish_grads`. So the hooks run once per
synced backward for exactly the parameters that get a gradient, on every rank (FSDP2: only
where the rank computed one). Without gradient sync nothing is reduced and no hook runs, as in
FSDP2. After the hooks a buffer whose parameters all dropped their gradients frees its sharded
gradient at once. What this does not save: the unsharded grad buffer of a group is one
allocation until its reduce-scatter (as FSDP2's reduce-scatter input).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor
from lightning_vescale._labels import label

from lightning_vescale.dbuffer import CommHandle, DBuffer
from lightning_vescale.fsdp._managed_param import ManagedParam
from lightning_vescale.fsdp._tp import tp_grad
from lightning_vescale.mesh import MeshInfo
from lightning_vescale.placement import ragged_from_local

__all__ = ["BackwardRoot", "GroupGradients"]

#: ``ragged_from_local``'s own constructor: a DTensor over a local tensor and a known spec
#: (``DTensor.__new__`` without ``__init__``'s checks; the spec came from ``ragged_from_local``)
_new_dtensor = DTensor.__new__


class BackwardRoot(Protocol):
    """What a group's gradient hooks ask of the root (``_state.RootContext`` implements it)."""

    groups: list[Any]  # every group of the tree, in the order of their ``index``
    final_callback_queued: bool  # read by the gradient hooks' fast path

    def queue_final_callback(self) -> None:
        """Make sure the end-of-backward callback runs after this backward."""

    def prefetch_backward(self, group: Any) -> None:
        """All-gather the group that follows ``group`` in the recorded backward order."""


class GroupGradients:
    """The gradient methods of :class:`~lightning_vescale.fsdp._param_group.ParamGroup` (a
    mixin: the group initialises every field in its ``__init__``; design note [fsdp-grads]).

    Reads the group's parameters, buffers and mesh; owns ``needs_reduce``, ``reduced``, the
    in-flight reduce-scatter and the gradient-sync settings.
    """

    # the group's (set in ParamGroup.__init__)
    fqn: str
    params: list[ManagedParam]
    buffers: dict[Any, DBuffer]
    mesh_info: MeshInfo
    root: BackwardRoot | None
    reduce_grads: bool
    requires_all_reduce: bool
    reduced_partially: bool
    gradient_divide_factor: float | None
    force_sum_reduction: bool
    grads_for_unused: bool
    needs_reduce: bool
    reduced: bool
    _reduce: list[CommHandle] | None
    _grads_ready: bool
    _arrived: int
    _num_trainable: int
    prefetch_backward_once: Callable[[], None]  # ParamGroup's methods
    check_collective: Callable[[str], None]
    mesh_of: Callable[[ManagedParam], MeshInfo]

    def trainable(self) -> list[ManagedParam]:
        """The parameters that take part in reduce-scatters (a fixed order on every rank)."""
        return [mp for mp in self.params if mp.requires_grad and mp.buffer is not None]


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
            if group is None:
                return
            if group._grads_ready and not group.reduced and not torch.is_grad_enabled():
                # :meth:`_on_gradient`'s fast path, inlined: runs for every parameter and step
                root = group.root
                if root is not None and not root.final_callback_queued:
                    root.queue_final_callback()
                return
            group._on_gradient(mp)
        return hook

    def _make_grad_post_hook(self, mp: ManagedParam) -> Callable[[torch.Tensor], None]:
        group_weakref, mp_weakref = weakref.ref(self), weakref.ref(mp)

        def hook(param: torch.Tensor) -> None:
            group, entry = group_weakref(), mp_weakref()
            if group is None or entry is None:
                return
            # the gradient was accumulated: count it (it times the backward prefetch only).
            # Once half of the trainable parameters have one: late enough not to coincide with
            # the activation peak at the start of the group's backward, early enough to
            # overlap its second half. Timing only, never a reduce.
            entry.got_grad = True
            group._arrived += 1
            if group._arrived == max(1, group._num_trainable // 2):
                group.prefetch_backward_once()
        return hook

    def _on_gradient(self, mp: ManagedParam) -> None:
        """A gradient is about to be accumulated into ``mp`` (before ``AccumulateGrad``)."""
        if self._grads_ready and not self.reduced and not torch.is_grad_enabled():
            # Every gradient after the group's first: nothing to prepare (runs once per
            # parameter per backward, so kept free of the profiler label and the checks below).
            if self.root is not None:
                self.root.queue_final_callback()
            return
        with label("vescale::grad_arrival"):
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
                if isinstance(g, DTensor):  # a TP parameter (design note [fsdp-tp])
                    g = g._local_tensor
                if g is None or g.data_ptr() != view.data_ptr():
                    if g is not None:  # a gradient outside the buffer: fold it in
                        with torch.no_grad():
                            view.add_(g)
                    mp.unsharded.grad = view if mp.tp is None else tp_grad(view, mp.tp)

    def run_post_reduce_hooks(self) -> None:
        """The group's reduce-scatter finished: call the sharded parameters' post-accumulate-grad
        hooks of those that received a gradient on this rank (design note
        [fsdp-post-acc-grad-hooks]). A no-op for parameters without hooks."""
        if self._reduce is not None:
            return  # still in flight; the root calls again after its wait
        hooked = [mp for mp in self.trainable()
                  if (mp.got_grad or self.grads_for_unused) and not mp.hooks_ran
                  and getattr(mp.sharded, "_post_accumulate_grad_hooks", None)]
        if not hooked:
            return
        for mp in hooked:
            assert mp.buffer is not None
            mp.buffer.wait_offload()  # the host copy of the shard must be complete
        for mp in hooked:
            self._publish_one(mp)
            mp.hooks_ran = True
            _call_post_acc_hooks(mp.sharded)
        for buf in {id(mp.buffer): mp.buffer for mp in hooked}.values():
            mps = [mp for mp in self.params if mp.buffer is buf]
            # every parameter's hooks ran and dropped its gradient (none is still to be
            # published from other ranks' gradients): free the sharded gradient now
            if all(mp.hooks_ran and mp.sharded is not None and mp.sharded.grad is None
                   for mp in mps):
                buf.release_grad_shard()

    def _publish_one(self, mp: ManagedParam) -> torch.Tensor:
        """Point ``mp.sharded.grad`` at its reduced gradient (unless it already views it)."""
        assert mp.sharded is not None and mp.buffer is not None
        g = mp.sharded.grad
        if g is None or not self._is_our_grad(mp, g):
            view = mp.buffer.grad_local_view(mp.name)
            if mp.grad_spec is not None:  # every publication after the first: no lookups
                g = mp.sharded.grad = _new_dtensor(DTensor, view, mp.grad_spec,
                                                   requires_grad=False)
                return g
            mesh, shape, stride = mp.dtensor_meta(self.mesh_of(mp).mesh)
            g = mp.sharded.grad = ragged_from_local(
                view, mesh, mp.placements, shape, stride, autograd=False, check=False)
            mp.grad_spec = g._spec
        return g

    def discard_gradients(self) -> None:
        """Drop unreduced gradients (unsharded, and the unsynced accumulators): the recovery of
        ``reset_iter_state()``. Sharded gradients already published stay."""
        self.wait_for_reduce()
        for buf in self.buffers.values():
            buf.free_grad()
            buf.grad_acc = None
            buf.grad_partial = None
        self._grads_ready = False
        self.needs_reduce = False
        for mp in self.params:
            mp.got_grad = False
            mp.hooks_ran = False
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
        self.check_collective("reduce-scatter")
        scale = None
        sum_then_divide = False  # set_force_sum_reduction_for_comms: by each buffer's mesh
        if op is None:
            if self.gradient_divide_factor is not None:  # set_gradient_divide_factor
                op, scale = "sum", 1.0 / self.gradient_divide_factor
            elif self.force_sum_reduction:  # set_force_sum_reduction_for_comms
                op, sum_then_divide = "sum", True
            else:
                op = "avg"
        # HSDP, set_requires_all_reduce(False): the shard group only; the sharded gradients
        # are neither touched nor published until a reduce with the all-reduce (FSDP2's)
        partial = self.mesh_info.is_hsdp and not self.requires_all_reduce
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
            if accumulate and not partial:
                self._prepare_accumulate(mps)
            # the buffer's own mesh: a parameter's mesh may be narrower ([fsdp-param-mesh])
            buf_scale = 1.0 / buf.mesh_info.data_parallel_size if sum_then_divide else scale
            handles.append(buf.reduce_scatter(async_op=async_op, op=op, accumulate=accumulate,
                                              scale=buf_scale, all_reduce=not partial))
        self._reduce = handles
        self.reduced = True
        self.reduced_partially = partial
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
        late: list[ManagedParam] = []  # a gradient from other ranks only: hooks run now
        any_ran = False
        for mp, got in zip(self.trainable(), received):
            mp.got_grad = False
            ran, mp.hooks_ran = mp.hooks_ran, False
            any_ran |= ran
            assert mp.sharded is not None and mp.buffer is not None
            g = mp.sharded.grad
            if not got or ran:  # kept from an earlier backward, or left by this one's hooks
                if (g is not None and mp.buffer.grad_shard is not None
                        and self._is_our_grad(mp, g)):
                    published[mp.buffer][id(mp.sharded)] = g
                continue
            published[mp.buffer][id(mp.sharded)] = self._publish_one(mp)
            if getattr(mp.sharded, "_post_accumulate_grad_hooks", None):  # _post_acc_hooks
                late.append(mp)
        # Readers of many gradients at once check identity against this record instead of
        # every gradient's memory (design note [dbuffer-published-grads]).
        for buf, grads in published.items():
            buf.record_published_grads(grads)
        for mp in late:  # design note [fsdp-post-acc-grad-hooks]
            _call_post_acc_hooks(mp.sharded)
        if late or any_ran:
            self.release_unused_grad_shards()  # hooks that stepped and zeroed: free now

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


def _post_acc_hooks(param: torch.Tensor | None) -> Any:
    """The post-accumulate-grad hooks registered on ``param`` (a falsy value when none)."""
    return getattr(param, "_post_accumulate_grad_hooks", None)


def _call_post_acc_hooks(param: torch.Tensor | None) -> None:
    """Call ``param``'s post-accumulate-grad hooks as autograd would (FSDP2's
    ``foreach_reduce`` does the same for its sharded parameters)."""
    for hook in tuple((_post_acc_hooks(param) or {}).values()):
        hook(param)
