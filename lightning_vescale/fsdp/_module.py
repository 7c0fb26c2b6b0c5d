"""``VeScaleFSDPModule``: the methods every ``fully_shard``-ed module gains, FSDP2's ``FSDPModule``.

Design note [fsdp-module]
-------------------------
``fully_shard`` changes a module's class to ``VeScaleFSDP<Cls>(VeScaleFSDPModule, Cls)``, as
FSDP2 does with ``FSDP<Cls>(FSDPModule, Cls)``. ``VeScaleFSDPModule`` *subclasses* torch's
``FSDPModule``, so ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` is true and libraries
that branch on it (Lightning's ``ModelParallelStrategy``, torch's pipelining schedules, user
code) see a sharded module. FSDP2's own methods never run on our state: every public and
private method of ``FSDPModule`` is overridden here (``tests/distributed/
test_fsdp2_compat_api.py`` checks that none is inherited), with FSDP2's signature and meaning,
or, for the few FSDP2 features this engine does not have, a ``NotImplementedError`` naming the
feature. ``_get_fsdp_state()`` returns a narrow view that has exactly what torch's
``register_fsdp_forward_method`` calls (``_pre_forward``/``_post_forward``), so that function
works unchanged on our modules; any other FSDP2-internal attribute raises an ``AttributeError``
that says so. The class keeps FSDP2's ``__new__`` (``_orig_cls_mro_index`` points past both
mixins), so a container method that builds a new instance of the module's class (e.g. slicing
a sharded ``nn.Sequential``) builds a plain, unsharded one.

Methods that are *not recursive* in FSDP2 (``reshard``, ``unshard``,
``set_gradient_divide_factor``...) act on this module's own group only; those with
``recurse=True`` act on every group in the module's tree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from lightning_vescale.fsdp._materialize import apply_to_group
from lightning_vescale.fsdp._param_group import ParamGroup
from lightning_vescale.fsdp._reshard import reshard_policy
from lightning_vescale.fsdp._state import FSDPState, get_state, states_in

__all__ = ["VeScaleFSDPModule", "register_fsdp_forward_method"]


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def _not_supported(feature: str, why: str) -> NotImplementedError:
    return NotImplementedError(
        f"{feature} (a torch FSDP2 FSDPModule method) is not supported by lightning_vescale's "
        f"fully_shard: {why}")


class _UnshardHandle(UnshardHandle):
    """:meth:`VeScaleFSDPModule.unshard`'s handle (FSDP2's ``UnshardHandle``)."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Wait for the all-gather and register the unsharded parameters (idempotent)."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class _FSDP2StateView:
    """What ``FSDPModule._get_fsdp_state()`` returns for our modules: the forward hooks torch's
    ``register_fsdp_forward_method`` calls, nothing else (design note [fsdp-module])."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return self._state._pre_forward(module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        try:
            return self._state._post_forward(module, args, output)
        finally:
            self._state._forward_exit(module, args, output)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"{name!r}: this module was sharded by lightning_vescale.fsdp.fully_shard, whose "
            "state is not torch FSDP2's FSDPState; use lightning_vescale.fsdp.get_state(module) "
            "and the FSDPModule methods instead.")


class VeScaleFSDPModule(FSDPModule):
    """Mixed into every ``fully_shard``-ed module's class; torch's ``FSDPModule`` API on our
    engine (design note [fsdp-module])."""

    # MRO: [VeScaleFSDP<Cls>, VeScaleFSDPModule, FSDPModule, Cls, ...]: FSDP2's __new__ builds Cls
    _orig_cls_mro_index: int = 3

    # -- helpers ---------------------------------------------------------------------------------
    def _own_state(self) -> FSDPState:
        st = get_state(self)  # type: ignore[arg-type]
        if st is None:
            raise RuntimeError(f"{type(self).__name__} has no fully_shard state")
        return st

    def _states(self, recurse: bool) -> list[FSDPState]:
        return states_in(self) if recurse else [self._own_state()]  # type: ignore[arg-type]

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        return [st.group for st in self._states(recurse) if st.group is not None]

    # -- FSDP2 methods ---------------------------------------------------------------------------
    def reshard(self) -> None:
        """Free this module's unsharded parameters and register the sharded ones (not
        recursive, as in FSDP2)."""
        for group in self._groups(recurse=False):
            group.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's own group (not recursive, as in FSDP2).

        Returns ``None`` (the parameters are registered on return), or with ``async_op=True`` a
        handle whose ``wait()`` registers them; the module's pre-forward waits by itself.
        """
        _check_bool("async_op", async_op)
        group = self._own_state().group
        if group is not None:
            group.unshard(async_op=async_op)
        handle = _UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After a forward or backward raised: reshard everything and clear the iteration's
        state (call on the root; that iteration's gradients are lost, as in FSDP2)."""
        st = self._own_state()
        if st.ctx.root is not None and not st.is_root:
            raise RuntimeError("reset_iter_state() must be called on the root fully_shard module "
                               f"(the one forwarded first), not on {type(self).__name__}.")
        st.ctx.reset_iteration()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted and validated for FSDP2 compatibility, and a no-op by design: every backward
        here already ends as FSDP2's last backward does (the final callback waits for every
        reduce-scatter), so both values train the same and nothing is stored."""
        _check_bool("is_last_backward", is_last_backward)
        self._own_state()  # a module fully_shard did not shard raises, as for every setter

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Turn gradient reduce-scatter on/off (off: gradients accumulate unsharded).

        With sync off, gradients of several backwards add up without communication (in
        ``reduce_dtype`` when it differs from ``param_dtype``, as FSDP2); the next backward with
        sync on reduce-scatters the sum.
        """
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's HSDP switch for gradient accumulation: with ``False`` each backward
        reduce-scatters within the shard group only and sums the result in the buffers'
        partial gradient shard, without the all-reduce across replicas and without touching
        ``.grad``; the next backward with ``True`` adds that sum in and all-reduces once
        (design note [dbuffer-collectives]). Set ``False`` on all micro-batches but the last.
        On a 1-D mesh there is no all-reduce: either value does nothing."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        for group in self._groups(recurse):
            group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change whether groups free their unsharded parameters after forward (the root
        too: an explicit value replaces FSDP2's "root keeps them" default)."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        policy = reshard_policy(reshard_after_forward)
        for group in self._groups(recurse):
            group.reshard_policy = policy

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """With ``False``, groups keep their unsharded parameters after backward (gradient
        accumulation: the next forward needs no all-gather). Set it back to ``True`` for the
        last micro-batch: parameters kept unsharded do not see an optimizer step (FSDP2)."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) right after this module's own all-gather
        in forward, instead of the implicit next-in-order prefetch."""
        self._own_state().forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' groups (async) when this module's backward starts,
        instead of the implicit prefetch of the next group in backward order."""
        st = self._own_state()
        states = _states_of(modules)
        st.backward_prefetch = states
        if st.group is not None:
            st.group.explicit_backward_prefetch = [s.group for s in states if s.group is not None]

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's reduced gradients by ``factor`` instead of the shard-group size
        (sum-reduce, then one scale of the gradient shard). Not recursive, as in FSDP2."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor(factor=...) must be a positive number, "
                             f"got {factor!r}")
        for group in self._groups(recurse=False):
            group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated FSDP2 name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce-scatter with ``SUM`` and divide afterwards (one scale of the gradient shard)
        instead of an ``AVG`` collective. Not recursive, as in FSDP2."""
        _check_bool("enable", enable)
        for group in self._groups(recurse=False):
            group.force_sum_reduction = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """FSDP2's meaning: with ``True`` every trainable parameter gets a gradient after each
        backward, zeros where no rank computed one (an expert no rank routed tokens to), never
        ``None``. This engine always reduce-scatters whole buffers, so ranks with different
        unused parameters never issue mismatched collectives either way; the setting decides
        what a parameter unused on *every* rank gets. ``False`` (the default): ``grad=None``, as
        in single-process training, found by one small all-reduce of "received a gradient"
        flags per backward, which a rank lacking a gradient must read on the host before the
        backward returns. ``True`` skips that all-reduce and its host sync (design note
        [fsdp-final-callback]). Recursive by default, as in FSDP2; set it on every rank."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        for group in self._groups(recurse=recurse):
            group.grads_for_unused = reduce_scatter_unused_params

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With ``False``, this module's group is not all-gathered in backward (only for groups
        whose parameters backward does not need, e.g. an embedding; as FSDP2)."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """FSDP2's meaning: the root's next pre-forward makes the current stream wait on
        ``event`` (recorded after an optimizer step on another stream), so the all-gathers and
        offloaded-shard copies issued from then on read the updated shards; the event is then
        dropped (set a new one each iteration). Without one, work issued on the current stream
        follows whatever the optimizer enqueued there."""
        # torch.Event, or a device event class (torch.cuda.Event) that provides wait()
        if not isinstance(event, torch.Event) and not callable(getattr(event, "wait", None)):
            raise TypeError(f"set_post_optim_event(event=...) must be a torch.Event (e.g. "
                            f"stream.record_event()), got {type(event).__name__}")
        device = getattr(event, "device", None)
        if device is None or torch.device(device).type != "cpu":  # CPU work is ordered already
            self._own_state().ctx.post_optim_event = event

    def set_custom_all_gather(self, comm: Any) -> None:
        raise _not_supported("set_custom_all_gather", "the all-gather runs in place on the "
                             "group's DBuffer (zero-copy); a custom collective cannot plug in.")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise _not_supported("set_custom_reduce_scatter", "the reduce-scatter runs in place on "
                             "the group's DBuffer (zero-copy); a custom collective cannot plug in.")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Any = None) -> None:
        raise _not_supported("set_all_reduce_hook", "the HSDP all-reduce runs in place on the "
                             "group's flat gradient shard (zero-copy); a custom collective "
                             "cannot plug in.")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        raise _not_supported("set_reduce_scatter_max_input_buffers", "gradients are "
                             "reduce-scattered straight from the group's gradient buffer; there "
                             "are no copy-in buffers to cap (at most one reduce-scatter is in "
                             "flight).")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        raise _not_supported("set_separate_reduce_scatter_group", "every collective of a group "
                             "runs in the mesh's shard process group.")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        raise _not_supported("set_allocate_memory_from_process_group_for_comm", "collectives "
                             "run in place on DBuffer storage; there are no staging buffers.")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted, and changes nothing: FSDP2 allocates its all-gather *staging* buffers in
        symmetric memory so that NCCL can use copy-engine / symmetric-kernel all-gathers. Here
        the all-gather runs in place on each DBuffer's own storage (zero-copy: no staging
        buffer), allocated by the caching allocator, so the collectives stay NCCL's ordinary
        ones, on every backend (gloo included). ``backend`` is validated as in FSDP2 (only
        ``"NCCL"``). Not recursive, as in FSDP2 (torchtitan calls it on every module)."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm(backend=...) supports only 'NCCL' (as "
                             f"FSDP2), got {backend!r}")
        self._own_state()  # a module fully_shard did not shard raises, as for every setter

    def _set_unshard_async_op(self, async_op: bool) -> None:
        raise _not_supported("_set_unshard_async_op", "use unshard(async_op=True) or "
                             "set_modules_to_forward_prefetch for explicit overlap.")

    def _get_fsdp_state(self) -> Any:
        return _FSDP2StateView(self._own_state())

    # -- ours ------------------------------------------------------------------------------------
    def set_prefetch(self, enabled: bool) -> None:
        """Enable/disable implicit all-gather prefetching (a root setting; default on).

        Applies to the root context of this module's tree: called before the first forward,
        to whichever of its modules becomes the root; afterwards, on the root only.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_prefetch(enabled=...) must be a bool, got {enabled!r}")
        for st in states_in(self):  # type: ignore[arg-type]
            if st.ctx.root is None or st.is_root:
                st.ctx.prefetch = enabled

    def _apply(self, fn: Callable, recurse: bool = True) -> Any:  # noqa: D401
        return apply_to_group(self, super(FSDPModule, self)._apply, fn, recurse)  # type: ignore[misc]


def _states_of(modules: Iterable[Any]) -> list[FSDPState]:
    modules = list(modules)
    out = []
    for m in modules:
        st = get_state(m) if isinstance(m, nn.Module) else None
        if st is None:
            raise ValueError(f"Expects modules sharded by fully_shard, got {type(m).__name__}: "
                             f"{m!r}")
        out.append(st)
    return out


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) gather parameters like ``forward``.

    FSDP2's function of the same name; torch's own also works on our modules (design note
    [fsdp-module]). A no-op when ``module`` was not sharded (so code can call it either way).

    Raises:
        ValueError: ``module`` has no such method.
    """
    st = get_state(module)
    if st is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    orig = getattr(module, method_name)
    view = _FSDP2StateView(st)

    @functools.wraps(orig)
    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = view._pre_forward(self, args, kwargs)
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            st._forward_exit(self, args, None)  # keep the forward depth right
            raise
        return view._post_forward(self, args, out)

    setattr(module, method_name, wrapped.__get__(module, type(module)))
