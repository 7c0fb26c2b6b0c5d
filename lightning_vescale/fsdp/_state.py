"""Per-module FSDP state: forward/backward hooks, the root, prefetching, the final callback.

Design note [fsdp-schedule]
---------------------------
One :class:`FSDPState` per ``fully_shard``-ed module; it owns at most one
:class:`~lightning_vescale.fsdp._param_group.ParamGroup` (``None`` when every parameter belongs
to inner groups). The first state whose forward runs becomes the *root* (lazy init, as in
FSDP2) and adopts every state in its module tree. The root never reshards after forward (its
parameters are needed first in backward) and drives per-iteration bookkeeping.

Forward: the pre-hook all-gathers (or waits for a prefetched all-gather), registers the
unsharded parameters and prefetches the next group in the recorded forward order with
``async_op=True``. The post-hook reshards (``reshard_after_forward``) and registers a tensor
hook on every output that requires grad: the group's *pre-backward*.

Backward: the pre-backward re-gathers the group (or waits for its prefetch); once half of the
group's gradients arrived, the next group in the recorded backward order is prefetched (late
enough not to coincide with the activation peak at the start of the group's backward, early
enough to overlap its second half). Gradient arrival is tracked per group (design note
[fsdp-grads]); a complete group first reshards (its parameters are no longer needed) and then
reduce-scatters: asynchronously on accelerators (the previous one is waited first, so at most
one is in flight, bounding memory), synchronously on CPU. A final autograd-engine
callback, queued by the root at the first backward hook, reduces groups that never completed
(unused parameters, grads kept from no-sync steps), waits for everything and reshards all.

Execution orders are recorded on the first iteration. A group with frozen parameters defers
its backward reshard to the final callback (frozen parameters have no ``AccumulateGrad`` that
would tell us their last use). A forward that runs *inside* backward (activation-checkpointing
recompute, detected with ``torch._C._current_graph_task_id()``) leaves the group unsharded and
registers nothing. No-grad/inference forwards reshard every group at the root's post-forward.

Design note [fsdp-reentrant]
----------------------------
A module's forward may run inside its own forward. Lightning's step redirection is the common
case: with the LightningModule as the root group, ``lm(...)`` runs ``training_step`` as the
forward, and ``training_step`` calls ``self(x)``. Like FSDP2's ``iter_forward_root``, only the
outermost call does the root bookkeeping (resharding leftovers, recording the order, prefetch,
pre-backward hooks on the outputs). An inner call only makes sure the group is unsharded. The
depth is counted per state and decremented by a forward hook with ``always_call=True``, so a
forward that raises cannot leave it stuck.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from lightning_vescale.fsdp._param_group import ParamGroup

__all__ = ["FSDPState", "get_state", "states_in"]

# The state lives in the module's __dict__ (not in a weak-keyed registry: the state refers back
# to the module, so a registry value would keep every sharded model alive forever).
_ATTR = "_lv_fsdp_state"


def get_state(module: nn.Module) -> "FSDPState | None":
    """The :class:`FSDPState` of a ``fully_shard``-ed module, or ``None``."""
    return module.__dict__.get(_ATTR)


def states_in(module: nn.Module) -> list["FSDPState"]:
    """States of ``module`` and its submodules, in ``module.modules()`` order."""
    out = []
    for m in module.modules():
        st = m.__dict__.get(_ATTR)
        if st is not None:
            out.append(st)
    return out


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


class FSDPState:
    """Hooks and schedule of one ``fully_shard``-ed module (see design note [fsdp-schedule])."""

    def __init__(self, module: nn.Module, group: ParamGroup | None, *,
                 reshard_after_forward: bool, param_dtype: torch.dtype | None,
                 output_dtype: torch.dtype | None, cast_forward_inputs: bool) -> None:
        self.module_ref = weakref.ref(module)
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self.output_dtype = output_dtype
        self.cast_forward_inputs = cast_forward_inputs
        self.requires_gradient_sync = True
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        # root-only bookkeeping
        self.tree: list[FSDPState] = []
        self.fwd_order: list[FSDPState] = []
        self.bwd_order: list[FSDPState] = []
        self.fwd_recorded = False
        self.bwd_recorded = False
        self.final_cb_queued = False
        self.inflight_reduce: FSDPState | None = None
        self.prefetch = True
        # Reduce-scatter asynchronously (overlapping the rest of backward, one in flight) where
        # an accelerator's streams make that real overlap; synchronously on CPU, where the
        # in-flight gradient buffer would only add to peak memory (FSDP2 is synchronous there).
        self.async_reduce: bool | None = None
        # per-iteration
        self._pre_bwd_done = False
        # How many calls of this module's forward are running (design note [fsdp-reentrant]).
        self._forward_depth = 0
        self._handles: list[Any] = []
        if group is not None:
            group.on_complete = self._on_group_complete
            group.on_first_grad = self._on_first_grad
            group.on_half = self._on_half_grads
        module.__dict__[_ATTR] = self
        self._handles.append(module.register_forward_pre_hook(
            self._pre_forward, prepend=True, with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._post_forward, prepend=False))
        # Registered last and always called (also when forward raises), so the depth count is
        # right whatever happens inside forward.
        self._handles.append(module.register_forward_hook(self._forward_exit, prepend=False,
                                                          always_call=True))

    @property
    def module(self) -> nn.Module:
        m = self.module_ref()
        assert m is not None
        return m

    # -- root ------------------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        self.tree = states_in(self.module)
        for st in self.tree:
            if st is not self:
                if st.is_root:  # an inner module ran forward alone before: demote it
                    st.tree, st.fwd_order, st.bwd_order = [], [], []
                st.is_root = False
                st.root = self
            if st.group is not None:
                st.group.sync_requires_grad()

    def _root_pre_forward(self) -> None:
        # finish anything left from an interrupted iteration (a backward that raised)
        self._finish_reduce()
        self.final_cb_queued = False
        for st in self.tree:
            st._pre_bwd_done = False
            # A forward whose output never went through backward (e.g. a loss computed twice,
            # or an evaluation with grad enabled) leaves the root (and groups with
            # reshard_after_forward=False) unsharded. Their full parameters would be stale once
            # the optimizer or load_state_dict changes the shards, so start every iteration
            # from the sharded state (a no-op after a normal backward).
            if st.group is not None and st.group.is_unsharded:
                st.group.reshard()
            if st.group is not None:
                st.group.reset_arrivals()
                st.group.sync_requires_grad()
                st.group.release_unused_grad_shards()

    # -- forward ---------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._lazy_init()
        root = self.root
        assert root is not None
        if _in_backward():
            # forward re-run inside backward (activation checkpointing recompute): parameters
            # are already unsharded for backward; no recording, prefetch or hooks
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return args, kwargs
        self._forward_depth += 1
        if self._forward_depth > 1:
            # Re-entrant call (design note [fsdp-reentrant]): the outer call already did the
            # bookkeeping; only make sure the parameters are there.
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return args, kwargs
        if self.is_root:
            self._root_pre_forward()
        if not root.fwd_recorded and self not in root.fwd_order:
            root.fwd_order.append(self)
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
        if root.fwd_recorded and root.prefetch:
            self._prefetch(root.fwd_order)
        if self.cast_forward_inputs and self.param_dtype is not None:
            dt = self.param_dtype

            def cast(x: Any) -> Any:
                return x.to(dt) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        root = self.root
        assert root is not None
        if _in_backward() or self._forward_depth > 1:
            # recompute inside backward, or a re-entrant call: the outer call does the rest
            return output
        grad = torch.is_grad_enabled()
        if self.group is not None and self.reshard_after_forward and not self.is_root:
            self.group.reshard()
        if self.output_dtype is not None:
            dt = self.output_dtype
            output = tree_map(
                lambda x: x.to(dt) if isinstance(x, torch.Tensor) and x.is_floating_point()
                else x, output)
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if grad and tensors:
            for t in tensors:
                t.register_hook(self._pre_backward)
        if self.is_root:
            self.fwd_recorded = True
        if self.is_root and (not grad or not tensors):
            # no backward will follow: inference (no_grad / eval) leaves nothing unsharded
            for st in self.tree:
                if st.group is not None:
                    st.group.reshard()
        return output

    def _forward_exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)

    def _prefetch(self, order: list["FSDPState"], *, backward: bool = False) -> None:
        try:
            i = order.index(self)
        except ValueError:
            return
        for nxt in order[i + 1:]:
            if backward and nxt._pre_bwd_done:
                continue  # already through its backward (e.g. the root's late gradients)
            if nxt.group is not None:
                nxt.group.unshard(async_op=True)
                return

    # -- backward --------------------------------------------------------------------------------
    def _queue_final_callback(self) -> None:
        root = self.root
        assert root is not None
        if not root.final_cb_queued:
            root.final_cb_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self._queue_final_callback()
        if self._pre_bwd_done:
            return
        self._pre_bwd_done = True
        root = self.root
        assert root is not None
        if not root.bwd_recorded and self not in root.bwd_order:
            root.bwd_order.append(self)
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
        if root.bwd_recorded and root.prefetch and (
                self.group is None or self.group.num_trainable == 0):
            self._prefetch(root.bwd_order, backward=True)  # else deferred to _on_half_grads

    def _on_half_grads(self, group: ParamGroup) -> None:
        # Backward prefetch of the next group, issued once half of this group's gradients
        # arrived: it still overlaps the second half of this group's backward, but it is not
        # alive at the start of the group's backward, where activation memory peaks.
        root = self.root
        assert root is not None
        if root.bwd_recorded and root.prefetch:
            self._prefetch(root.bwd_order, backward=True)

    def _on_first_grad(self, group: ParamGroup) -> None:
        self._queue_final_callback()

    def _on_group_complete(self, group: ParamGroup) -> None:
        root = self.root
        assert root is not None
        if not group.has_frozen:
            group.reshard()  # parameters are done: free them before the reduce-scatter runs
        if self.requires_gradient_sync:
            root._finish_reduce()  # at most one reduce-scatter in flight
            async_op = root.async_reduce
            if async_op is None:
                async_op = group.mesh.device_type != "cpu"
            group.reduce_scatter(async_op=async_op)
            if async_op:
                root.inflight_reduce = self

    def _finish_reduce(self) -> None:
        st, self.inflight_reduce = self.inflight_reduce, None
        if st is not None and st.group is not None:
            st.group.wait_for_reduce()

    def _final_callback(self) -> None:
        self.final_cb_queued = False
        self._finish_reduce()
        for st in self.tree:
            g = st.group
            if g is None:
                continue
            if st.requires_gradient_sync and g.has_pending_grads:
                g.reduce_scatter(async_op=False)
            g.reshard()
            g.reset_arrivals()
            st._pre_bwd_done = False
        if self.bwd_order:
            self.bwd_recorded = True

    # -- teardown --------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
