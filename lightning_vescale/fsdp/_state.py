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
enough to overlap its second half).

When a group's backward is *complete* must not depend on which gradients a rank received: a
parameter may get a gradient on one rank and none on another (data-dependent routing, e.g. an
MoE expert inside a block), and if the ranks then reduce-scattered different groups at
different times, their collectives would pair wrongly. So completion is structural, as in
FSDP2: the pre-forward wraps the module's forward inputs that require grad in
:class:`_PostBackward`, an identity whose backward runs once the gradients of those inputs
are complete. That needs the module's whole backward, and it is the same point in the backward
pass on every rank. (With several forwards of one module, the last one's backward counts.) The
gradient arrivals only time the early prefetch; if that has not fired by completion, it is
issued then, before the reduce-scatter, so every rank's collectives come in the same order.
A complete group first reshards (its parameters are no longer needed, frozen ones included)
and then reduce-scatters every buffer holding trainable parameters, with zeros where the rank
got no gradient: asynchronously on accelerators (the previous one is waited first, so at most
one is in flight, bounding memory), synchronously on CPU.

A final autograd-engine callback, queued by the root at the first backward hook, handles the
groups without a structural completion (the root, whose inputs are token ids; a block whose
input does not require grad; a block under reentrant activation checkpointing), in tree order:
it reduce-scatters each group that needs it, waits for everything and reshards all. A group
needs a reduce when, since its last one, its forward ran with grad, its forward was recomputed
with grad inside backward (reentrant checkpointing), or a gradient reached its outputs (a second
backward through a retained graph). All three are structural, so every rank reduces the same
groups. Then one small
all-reduce (MAX) of the "received a gradient" flags tells every rank which parameters received
one on *any* rank: exactly those get a sharded gradient, as in single-process training over the
global batch (:meth:`FSDPState._publish_grads`). Forward and backward orders are recorded on
the first iteration. A forward that runs *inside* backward (activation-checkpointing recompute,
detected with ``torch._C._current_graph_task_id()``) leaves the group unsharded and registers
nothing. No-grad/inference forwards reshard every group at the root's post-forward.

Limits: a module whose forward runs on some ranks and not on others in the same iteration (an
expert *module* that is its own group and gets no tokens on one rank) is still not supported:
only the ranks that ran it have its completion. Run it on an empty batch instead.

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
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

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


class _PostBackward(torch.autograd.Function):
    """Identity on a module's forward inputs whose backward marks the module's backward done.

    Autograd runs it once the gradients of the module's inputs are complete, which needs the
    whole backward of the module: a point in the backward pass that is the same on every rank,
    whatever gradients each rank's parameters received (design note [fsdp-schedule]).
    """

    @staticmethod
    def forward(ctx: Any, state: "FSDPState", *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Weakly: the autograd node lives in C++ and may outlive the iteration (a loss tensor
        # kept by the user keeps its grad_fn chain); a strong reference would keep the state,
        # its DBuffers and the process group alive until that node dies, possibly during
        # interpreter shutdown.
        ctx.state_ref = weakref.ref(state)
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        state = ctx.state_ref()
        if state is not None:
            state._post_backward()
        return (None, *grads)


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
        # per-iteration (reset by the final callback)
        self._pre_bwd_done = False
        self._bwd_done = False  # the group's backward completed (reshard + reduce issued)
        self._bwd_prefetched = False
        self._post_bwd_expected = 0  # forwards that registered a _PostBackward
        self._post_bwd_seen = 0
        # How many calls of this module's forward are running (design note [fsdp-reentrant]).
        self._forward_depth = 0
        self._handles: list[Any] = []
        if group is not None:
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
            # are already unsharded for backward; no recording, prefetch or hooks. With
            # reentrant checkpointing the original forward ran under no_grad, so this recompute
            # is the group's only forward with grad: the final callback must reduce it.
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
                if torch.is_grad_enabled() and self.group.num_trainable:
                    self.group.needs_reduce = True
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
        if self.group is not None and torch.is_grad_enabled():
            if self.group.num_trainable:
                self.group.needs_reduce = True
            args, kwargs = self._register_post_backward(args, kwargs)
        return args, kwargs

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs  # no input gradient: the final callback completes the group
        outs = _PostBackward.apply(self, *(flat[i] for i in idx))
        for i, t in zip(idx, outs):
            flat[i] = t
        self._post_bwd_expected += 1
        return tree_unflatten(flat, spec)

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
        if self.group is not None and self.group.num_trainable:
            # A gradient flows into this group's outputs in this backward (structural: the same
            # on every rank), e.g. a second backward through a retained graph after the first
            # one reduced the group: this backward's gradients must be reduced too.
            self.group.needs_reduce = True
        self._pre_bwd_done = True
        root = self.root
        assert root is not None
        if not root.bwd_recorded and self not in root.bwd_order:
            root.bwd_order.append(self)
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()
        if self.group is None or self.group.num_trainable == 0:
            self._backward_prefetch_once()  # else deferred to _on_half_grads

    def _backward_prefetch_once(self) -> None:
        """All-gather the next group in the recorded backward order, once per backward."""
        root = self.root
        assert root is not None
        if root.bwd_recorded and root.prefetch and not self._bwd_prefetched:
            self._bwd_prefetched = True
            self._prefetch(root.bwd_order, backward=True)

    def _on_half_grads(self, group: ParamGroup) -> None:
        # Backward prefetch of the next group, issued once half of this group's gradients
        # arrived: it still overlaps the second half of this group's backward, but it is not
        # alive at the start of the group's backward, where activation memory peaks.
        self._backward_prefetch_once()

    def _on_first_grad(self, group: ParamGroup) -> None:
        self._queue_final_callback()

    def _post_backward(self) -> None:
        self._post_bwd_seen += 1
        if self._post_bwd_seen == self._post_bwd_expected:  # the last use's backward is done
            self._complete_backward()

    def _complete_backward(self) -> None:
        """The group's backward is over (on every rank at this point): reshard, then reduce.

        A backward prefetch that the gradient arrivals did not trigger yet is issued first, so
        every rank issues the next group's all-gather before this reduce-scatter.
        """
        group, root = self.group, self.root
        if group is None or root is None or self._bwd_done:
            return
        self._bwd_done = True
        self._backward_prefetch_once()
        group.reshard()  # parameters are done: free them before the reduce-scatter runs
        if self.requires_gradient_sync and group.needs_reduce:
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
        for st in self.tree:  # groups without a structural completion, in the same order
            g = st.group
            if g is None:
                continue
            if not st._bwd_done and st.requires_gradient_sync and g.needs_reduce:
                g.reduce_scatter(async_op=False)
            g.reshard()
        self._publish_grads()
        for st in self.tree:
            if st.group is not None:
                st.group.reset_arrivals()
            st._pre_bwd_done = st._bwd_done = st._bwd_prefetched = False
            st._post_bwd_expected = st._post_bwd_seen = 0
        if self.bwd_order:
            self.bwd_recorded = True

    def _publish_grads(self) -> None:
        """Publish the sharded gradients of the groups reduced in this backward.

        Whether a parameter has a gradient must not depend on the rank (rank 1 may compute none
        for an expert rank 0 routed tokens to): one all-reduce (MAX) of the "received a
        gradient" flags of every reduced group's trainable parameters gives the global answer.
        Which groups were reduced is the same on every rank, so is the message.
        """
        groups = [st.group for st in self.tree if st.group is not None and st.group.reduced]
        if not groups:
            return
        per_group = [g.trainable() for g in groups]
        local = bytes(int(mp.got_grad) for mps in per_group for mp in mps)
        flags = list(local)
        mesh = groups[0].mesh
        if mesh.size() > 1 and local:
            # frombuffer: no ATen op (the zero-copy tests count copy operators)
            t = torch.frombuffer(bytearray(local), dtype=torch.uint8)
            device = next(iter(groups[0].buffers.values())).device
            t = t.to(device) if device.type != "cpu" else t
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.get_group())
            flags = t.tolist()
        i = 0
        for g, mps in zip(groups, per_group):
            g.publish_grads([bool(f) for f in flags[i:i + len(mps)]])
            i += len(mps)

    # -- teardown --------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
