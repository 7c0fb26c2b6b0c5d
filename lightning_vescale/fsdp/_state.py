"""Per-module FSDP state: the forward and backward hooks of one ``fully_shard`` call.

The root-only state a module tree shares is :class:`~lightning_vescale.fsdp._root.RootContext`
(``_root.py``, design note [fsdp-final-callback]).

Design note [fsdp-schedule]
---------------------------
One :class:`FSDPState` per ``fully_shard``-ed module; it owns at most one
:class:`~lightning_vescale.fsdp._param_group.ParamGroup` (``None`` when every parameter belongs
to inner groups). The first state whose forward runs becomes the *root* (lazy init, as in FSDP2)
and shares its :class:`~lightning_vescale.fsdp._root.RootContext` with every state in its module
tree (FSDP2's ``FSDPStateContext``): the list of states and groups, the recorded
forward/backward orders, the prefetch setting, the reduce-scatter in flight, whether the final
callback is queued. A state keeps only what is its own: its group, the mixed-precision policy,
its :class:`~lightning_vescale.fsdp._training_state.TrainingState` (design note [fsdp-training-state]),
its forward depth and its post-backward count. What a group does with its
parameters after forward is its :class:`~lightning_vescale.fsdp._reshard.ReshardPolicy` (design
note [fsdp-reshard-policy]). The root drives
per-iteration bookkeeping. The modules of one ``fully_shard([a, b])`` call share one state: the
first of them to run forward unshards the group, the last one's post-forward reshards it.

Forward: the pre-hook all-gathers (or waits for a prefetched all-gather), registers the
unsharded parameters and prefetches the next group in the recorded forward order with
``async_op=True``. The post-hook reshards (``reshard_after_forward``) and registers a tensor
hook on every output that requires grad: the group's *pre-backward*.

Backward: the pre-backward re-gathers the group (or waits for its prefetch); once half of the
group's gradients arrived, the next group in the recorded backward order that has not begun
its backward is prefetched (late enough not to coincide with the activation peak at the start
of the group's backward, early enough to overlap its second half).

Design note [fsdp-backward-completion]
--------------------------------------
When a group's backward is *complete* must not depend on which gradients a rank received: a
parameter may get a gradient on one rank and none on another (data-dependent routing, e.g. an
MoE expert inside a block), and if the ranks then reduce-scattered different groups at different
times, their collectives would pair wrongly. So completion is structural, as in FSDP2: the
pre-forward wraps the module's forward inputs that require grad in :class:`_PostBackward`, an
identity whose backward runs once the gradients of those inputs are complete. That needs the
module's whole backward, and it is the same point in the backward pass on every rank. (With
several forwards of one module, the last one's backward counts, design note
[fsdp-multi-forward]; if any forward with grad had no input needing a gradient, e.g. the token
ids of a list group's embedding, the group has no structural end in this iteration and the final
callback completes it.) Inputs and outputs are searched for tensors through dataclasses,
namedtuples, dicts, lists and pytree-registered classes (``_tree.py``). The gradient arrivals
only time the early prefetch; if that has not fired by completion, it is issued then, before the
reduce-scatter, so every rank's collectives come in the same order. A complete group first
reshards (its parameters are no longer needed, frozen ones included) and then reduce-scatters
every buffer holding trainable parameters, with zeros where the rank got no gradient:
asynchronously on accelerators (the previous one is waited first, so at most one is in flight,
bounding memory), synchronously on CPU.

Limits: a module whose forward runs on some ranks and not on others in the same iteration (an
expert *module* that is its own group and gets no tokens on one rank) is still not supported:
only the ranks that ran it have its completion. Run it on an empty batch instead. The opt-in
check of design note [fsdp-collective-check] names such a group instead of hanging.

Design note [fsdp-multi-forward]
--------------------------------
A group may be used several times before one backward: a module called twice in a forward,
or the whole model run twice and the two losses combined (DPO), with or without activation
checkpointing. Each forward with grad whose inputs need a gradient is a *use*: it wraps the
inputs in a :class:`_PostBackward` and hooks its outputs, both tagged with the use's number.
Uses add up from the end of one backward (the root's final callback) to the end of the next,
*across* root forwards: the root's pre-forward forgets the counts only when the last backward
began and never reached its final callback (it raised). The group's backward is complete when
every use's :class:`_PostBackward` ran; only then is it resharded and reduce-scattered. This
matters because of ``AccumulateGrad``: a parameter used twice receives its gradient once, after
*both* uses' backward, so completing the group at the first use's end (what a per-forward count
did) reduce-scattered before the gradient arrived ("received its gradient after its group was
reduce-scattered"). A use whose backward ends while others are still to come and none is under
way (its output hooks fired, its ``_PostBackward`` not yet) reshards the group (FSDP2 reshards
at every post-backward too); the next use's output hook gathers it again, so two forwards do not
keep every group gathered for the whole backward. A forward whose output never goes through
backward (an evaluation with grad on) leaves its use open: the final callback then completes
the group, correct but without the early reshard, for that iteration only. An activation-
checkpointing recompute is not a use (design note [fsdp-final-callback]): it only unshards.
The modules of a list group (``fully_shard([norm, output])``) that run in one forward are one
use: each wraps its inputs in a :class:`_PostBackward` of that use, and the use ends when all of
them ran (counted per use), so the group is not resharded between ``output``'s backward and
``norm``'s (which re-gathered it: one all-gather more than FSDP2, and a group pinned with
``reshard_after_forward=False`` freed and rebuilt).

Design note [fsdp-reentrant]
----------------------------
A module's forward may run inside its own forward. Lightning's step redirection is the common
case: with the LightningModule as the root group, ``lm(...)`` runs ``training_step`` as the
forward, and ``training_step`` calls ``self(x)``. Like FSDP2's ``iter_forward_root``, only the
outermost call does the root bookkeeping (resharding leftovers, recording the order, prefetch,
pre-backward hooks on the outputs). An inner call only makes sure the group is unsharded. The
depth is counted per state and decremented by a forward hook with ``always_call=True``, so a
forward that raises cannot leave it (or the ``FORWARD`` training state) stuck.

Design note [fsdp-profiling]
----------------------------
Every hook and collective runs under a ``record_function("vescale::...")`` label
(``lazy_init``, ``root_pre_forward``, ``pre_forward``, ``post_forward``, ``pre_backward``,
``grad_arrival``, ``post_backward``, ``post_backward_final_callback``,
``grad_flags_all_reduce``, and in the DBuffer ``all_gather`` / ``reduce_scatter`` /
``comm_wait``), as FSDP2's ``FSDP::...`` labels, so a profiler trace shows the engine's phases
(``benchmarks/hook_overhead.py`` sums their self CPU time). The labels are entered only while a
profiler records (``lightning_vescale._labels.label``): ``record_function`` itself dispatches
two operators whether or not anyone records, several per group and step. The hooks are the
host's cost per step on many small groups (issue 36; pytorch#173680 for FSDP2), so their common
paths avoid per-step scans and Python calls: the recorded orders' positions are indexed once,
the gradient hooks' common case is inlined in the hook closures, ``requires_grad`` is synced
by one compare per parameter. ``tests/distributed/test_hook_work.py`` pins the Python calls
of one forward + backward.

Design note [fsdp-compile]
--------------------------
``torch.compile`` works per block, as with FSDP2: ``fully_shard(block)`` then
``block.compile()`` (or ``torch.compile(block)``). The module hooks are wrapped in
``torch.compiler.disable``, so dynamo graph-breaks around them and they run eagerly; the block's
forward between them is one graph. Its parameters are the unsharded tensors the pre-forward
hook registered, which are the same objects every iteration (design note
[fsdp-param-objects]), so no recompilation follows; their storage is freed and re-gathered on
the same storage objects, so the tensors the compiled backward saved see the re-gathered data.
Gradient hooks, the post-backward autograd function and the final callback run in the eager
backward. Compiling the root module as a whole (with its hooks inside) is not tested.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from lightning_vescale._labels import label

from lightning_vescale.fsdp._training_state import TrainingState, in_backward
from lightning_vescale.fsdp._param_group import ParamGroup
from lightning_vescale.fsdp._policy import MixedPrecisionPolicy
from lightning_vescale.fsdp._root import ATTR, RootContext, get_state, states_in
from lightning_vescale.fsdp._tree import map_tensors, tensors_in

__all__ = ["FSDPState", "RootContext", "get_state", "states_in"]


class _PostBackward(torch.autograd.Function):
    """Identity on a module's forward inputs whose backward marks the module's backward done.

    Autograd runs it once the gradients of the module's inputs are complete, which needs the
    whole backward of the module: a point in the backward pass that is the same on every rank,
    whatever gradients each rank's parameters received (design note [fsdp-backward-completion]).
    """

    @staticmethod
    def forward(ctx: Any, state: "FSDPState", use: int,
                *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Weakly: the autograd node lives in C++ and may outlive the iteration (a loss tensor
        # kept by the user keeps its grad_fn chain); a strong reference would keep the state,
        # its DBuffers and the process group alive until that node dies, possibly during
        # interpreter shutdown.
        ctx.state_weakref = weakref.ref(state)
        ctx.use = use
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        state = ctx.state_weakref()
        if state is not None:
            state._post_backward(ctx.use)
        return (None, None, *grads)


class FSDPState:
    """Hooks of one ``fully_shard`` call's module(s) (see design note [fsdp-schedule]).

    Args:
        modules: the module, or the modules of ``fully_shard([a, b])`` (held weakly: the
            modules hold the state). A list group is unsharded by the first of its modules to
            run forward and resharded after the last one ran (FSDP2's rule).
        group: its parameter group, or ``None`` when the modules own no parameters.
        mp_policy: the user's mixed-precision policy, kept whole (input/output casts).
    """

    def __init__(self, modules: nn.Module | list[nn.Module], group: ParamGroup | None, *,
                 mp_policy: MixedPrecisionPolicy) -> None:
        modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.module_weakrefs = [weakref.ref(m) for m in modules]
        self.group = group
        self.mp_policy = mp_policy
        self.ctx = RootContext()  # replaced by the root's at lazy init
        self.training_state = TrainingState.IDLE
        # How many calls of this module's forward are running (design note [fsdp-reentrant]).
        self._forward_depth = 0
        # Forwards ("uses") that registered a _PostBackward since the last backward (several
        # root forwards before one backward add up), how many of those completed, and the uses
        # whose backward is under way: a gradient reached their outputs, not yet their inputs
        # (design note [fsdp-multi-forward]).
        self._post_backward_seen = 0
        self._post_backward_expected = 0
        self._open_uses: set[int] = set()
        # per use, its _PostBackwards not yet run (a list group's modules run in one forward
        # share one use, one _PostBackward each: design note [fsdp-multi-forward])
        self._use_remaining: dict[int, int] = {}
        self._next_use = 0
        self._use_in_pass: int | None = None  # the use of this forward pass (list groups)
        self._use: int | None = None  # the current forward's use, for its output hooks
        # A forward with grad whose inputs needed no gradient registered no _PostBackward: the
        # group's backward has no structural end then, and the final callback completes it.
        self._unhooked_forward = False
        # List groups: the modules still to run in this iteration's forward (FSDP2's
        # ``_modules_to_run_forward``); the group reshards after the last.
        self._pending: set[int] = set()
        # set_modules_to_forward_prefetch / _backward_prefetch: explicit lists (None: implicit)
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        for module in modules:
            module.__dict__[ATTR] = self
            # Hooks run eagerly even when the module itself is compiled (``module.compile()``),
            # like FSDP2's (``skip_fsdp_hooks``): dynamo graph-breaks around them and compiles
            # the forward between, so collectives, storage resizes and parameter swaps stay
            # outside any graph (design note [fsdp-compile]).
            module.register_forward_pre_hook(_eager(self._pre_forward), prepend=True,
                                             with_kwargs=True)
            module.register_forward_hook(_eager(self._post_forward), prepend=False)
            # Registered last and always called (also when forward raises), so the depth count
            # is right whatever happens inside forward.
            module.register_forward_hook(_eager(self._forward_exit), prepend=False,
                                         always_call=True)

    @property
    def module(self) -> nn.Module:
        """The (first) module of this state."""
        m = self.module_weakrefs[0]()
        assert m is not None
        return m

    @property
    def modules(self) -> list[nn.Module]:
        """Every module of this state (one, or those of ``fully_shard([a, b])``)."""
        out = [r() for r in self.module_weakrefs]
        assert all(m is not None for m in out)
        return out  # type: ignore[return-value]

    @property
    def is_root(self) -> bool:
        return self.ctx.root is self

    # -- FSDP2's ``FSDPState`` attributes read through ``fully_shard.state(module)`` -------------
    # (design note [fsdp-state-accessor] in ``api.py``): aliases of ours, same meaning.
    @property
    def _fsdp_param_group(self) -> ParamGroup | None:
        """The group's parameters (FSDP2: its ``FSDPParamGroup``); ``None`` without any."""
        return self.group

    @property
    def _fsdp_param_groups(self) -> list[ParamGroup]:
        return [] if self.group is None else [self.group]

    @property
    def _is_root(self) -> bool | None:
        """``None`` before the first forward (lazy init), then whether this is the root."""
        return None if self.ctx.root is None else self.is_root

    @property
    def _state_ctx(self) -> RootContext:
        """The root context shared by the tree (``all_states``), FSDP2's ``FSDPStateContext``."""
        return self.ctx

    @property
    def _mp_policy(self) -> MixedPrecisionPolicy:
        return self.mp_policy

    @property
    def _modules(self) -> tuple[nn.Module, ...]:
        return tuple(self.modules)

    def _lazy_init(self) -> None:
        if self.ctx.root is None:
            self.ctx.adopt(self)

    def _unshard_now(self) -> None:
        if self.group is not None:
            self.group.unshard()
            self.group.wait_for_unshard()

    # -- forward ---------------------------------------------------------------------------------
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        with label("vescale::pre_forward"):
            self._lazy_init()
            if in_backward():
                # forward re-run inside backward (activation checkpointing recompute):
                # parameters are already unsharded for backward; no recording, prefetch or
                # hooks. With reentrant checkpointing the original forward ran under no_grad, so
                # this recompute is the group's only forward with grad: the final callback must
                # reduce it.
                self._unshard_now()
                if self.group is not None and torch.is_grad_enabled():
                    self.group.expect_gradients()
                return args, kwargs
            self._forward_depth += 1
            if self._forward_depth > 1:
                # Re-entrant call (design note [fsdp-reentrant]): the outer call already did the
                # bookkeeping; only make sure the parameters are there.
                self._unshard_now()
                return args, kwargs
            if self._pending:
                # Another module of this list group runs within the same forward: the group is
                # unsharded already (FSDP2: only the first module's pre-forward unshards).
                self._pending.discard(id(module))
                self._unshard_now()
                return self._prepare_inputs(args, kwargs, same_pass=True)
            ctx = self.ctx
            if self.is_root:
                ctx.root_pre_forward()
            self.training_state = TrainingState.FORWARD
            ctx.record_forward(self)
            if self.group is not None and (self.forward_prefetch is not None
                                           or (ctx.forward_recorded and ctx.prefetch)):
                # own all-gather first, the prefetch behind it, then the wait: one exchange on
                # gloo (design note [fsdp-gloo-fusion])
                self.group.unshard(async_op=True)
            if self.forward_prefetch is not None:
                for st in self.forward_prefetch:
                    if st.group is not None:
                        st.group.unshard(async_op=True)
            else:
                ctx.prefetch_forward(self)
            self._unshard_now()
            self._pending = {id(r()) for r in self.module_weakrefs} - {id(module)}
            return self._prepare_inputs(args, kwargs, same_pass=False)

    def _prepare_inputs(self, args: tuple, kwargs: dict, *,
                        same_pass: bool) -> tuple[tuple, dict]:
        """Cast the forward inputs (policy) and wrap those needing a gradient (``same_pass``:
        another module of a list group in the forward its first module began)."""
        policy = self.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), policy.param_dtype)
        if self.group is not None and torch.is_grad_enabled():
            self.group.expect_gradients()
            args, kwargs = self._register_post_backward(args, kwargs, same_pass)
        return args, kwargs

    def _register_post_backward(self, args: tuple, kwargs: dict,
                                same_pass: bool) -> tuple[tuple, dict]:
        inputs = [t for t in tensors_in((args, kwargs) if kwargs else args) if t.requires_grad]
        self._use = None
        if not same_pass:
            self._use_in_pass = None
        if not inputs:
            # no input gradient: the group's backward has no structural end this iteration,
            # the final callback completes it
            self._unhooked_forward = True
            return args, kwargs
        unique = list({id(t): t for t in inputs}.values())
        if not same_pass or self._use_in_pass is None:
            self._use_in_pass = self._next_use
            self._next_use += 1
        self._use = use = self._use_in_pass
        self._use_remaining[use] = self._use_remaining.get(use, 0) + 1
        outs = _PostBackward.apply(self, use, *unique)
        replace = {id(t): o for t, o in zip(unique, outs)}
        self._post_backward_expected += 1

        def swap(t: torch.Tensor) -> torch.Tensor:
            return replace.get(id(t), t)

        if not kwargs:
            return map_tensors(swap, args), kwargs
        return map_tensors(swap, (args, kwargs))

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if in_backward() or self._forward_depth > 1:
            # recompute inside backward, or a re-entrant call: the outer call does the rest
            return output
        with label("vescale::post_forward"):
            grad = torch.is_grad_enabled()
            group = self.group
            last = not self._pending  # list groups: the last of their modules to run
            if self.mp_policy.output_dtype is not None:
                output = _cast_floating(output, self.mp_policy.output_dtype)
            tensors = [t for t in tensors_in(output) if t.requires_grad]
            if last and group is not None:  # design note [fsdp-reshard-policy]
                group.reshard_after_forward_now(group.reshard_policy.ranks_after_forward(
                    shard_size=group.mesh_info.shard_size, is_root=self.is_root,
                    is_last_in_forward=bool(grad and tensors) and self._is_last_in_forward()))
            if grad and tensors:
                hook = functools.partial(self._pre_backward, use=self._use)
                for t in tensors:
                    t.register_hook(hook)
            if self.is_root:
                self.ctx.forward_recorded = True
                if not grad or not tensors:
                    self.ctx.reshard_all()  # no backward will follow (no_grad / eval)
            if last:
                self.training_state = TrainingState.IDLE
            if self.is_root:  # the forward's quantized all-gathers, read once
                self.ctx.check_quantized()
            return output

    def _is_last_in_forward(self) -> bool:
        """The last group of the recorded forward order (its backward comes first), and on gloo
        the small ones before it (design note [fsdp-reshard-policy])."""
        return self.ctx.keeps_into_backward(self)

    def _forward_exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)
        if (self._forward_depth == 0 and self.training_state is TrainingState.FORWARD
                and not self._pending):  # (a list group between its modules stays FORWARD)
            self.training_state = TrainingState.IDLE  # the forward raised

    # -- backward --------------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor, use: int | None = None) -> None:
        with label("vescale::pre_backward"):
            self.ctx.queue_final_callback()
            if use is not None:
                self._open_uses.add(use)
            if self.training_state is TrainingState.PRE_BACKWARD:
                return  # once per backward (or per use after a reshard between uses)
            self.training_state = TrainingState.PRE_BACKWARD
            self.ctx.record_backward(self)
            if self.group is not None:
                self.group.pre_backward()
            elif self.backward_prefetch is not None:  # set_modules_to_backward_prefetch
                for st in self.backward_prefetch:
                    g = st.group
                    if g is not None and g.training_state is TrainingState.IDLE \
                            and g.unshard_in_backward:
                        g.unshard(async_op=True)
            else:
                self.ctx.prefetch_backward(self)

    def _post_backward(self, use: int) -> None:
        self._post_backward_seen += 1
        left = self._use_remaining.pop(use, 1) - 1
        if left > 0:  # a list group's use: another of its modules' backward is still to come
            self._use_remaining[use] = left
        else:
            self._open_uses.discard(use)
        if self._unhooked_forward:
            return  # a forward without input gradients: the final callback completes the group
        if self._post_backward_seen == self._post_backward_expected:  # the last use's backward
            self._complete_backward()
        elif not self._open_uses:
            self._reshard_between_uses()

    def _reshard_between_uses(self) -> None:
        """One use's backward is over, others are to come and none is under way: free the
        gathered parameters until the next use's pre-backward gathers them again (design note
        [fsdp-multi-forward]). Gradients stay in the grad buffer; nothing is reduced."""
        group = self.group
        if group is None or not group.reshard_after_backward or not group.is_unsharded:
            return
        with label("vescale::reshard_between_uses"):
            group.reshard()
            self.training_state = TrainingState.IDLE  # the next use's pre-backward re-gathers

    def _complete_backward(self) -> None:
        """The group's backward is over (on every rank at this point): reshard, then reduce."""
        group = self.group
        if group is None or group.training_state is TrainingState.POST_BACKWARD:
            return
        with label("vescale::post_backward"):
            group.post_backward()
            if group.should_reduce():
                self.ctx.reduce_scatter(group)
            else:
                group.accumulate_unsynced()

    def reset_post_backward(self) -> None:
        self._post_backward_expected = self._post_backward_seen = 0
        self._open_uses = set()
        self._use_remaining = {}
        self._next_use = 0
        self._use_in_pass = None
        self._use = None
        self._unhooked_forward = False
        self._pending = set()


def _eager(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` never traced by ``torch.compile`` (see design note [fsdp-compile])."""
    return torch.compiler.disable(hook, recursive=True)


def _cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (dataclasses included)."""
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() else x, tree)
