"""``fully_shard``: the public entry point of layer 3 (FSDP2-style, RaggedShard + DBuffer).

Design note [fsdp-api]
----------------------
``fully_shard(module)`` turns the parameters of ``module`` that no inner ``fully_shard`` call
owns into one :class:`~lightning_vescale.fsdp._param_group.ParamGroup` (one DBuffer per dtype),
registers an :class:`~lightning_vescale.fsdp._state.FSDPState` with the forward hooks, and
changes the module's class to a subclass mixing in :class:`VeScaleFSDPModule` (as FSDP2 does)
so that ``module.set_requires_gradient_sync``, ``reshard``/``unshard`` and the device-move
handling of ``_apply`` exist. Call it bottom-up: on each block, then on the root.

Parameters keep their data: each rank copies its owned range of every parameter into its shard
(the caller guarantees the same values on every rank, e.g. by seeding, as with FSDP2). A module
on the meta device is planned without data; see design note [fsdp-materialize] in
``_materialize.py``.

Every group gets one :class:`~lightning_vescale.mesh.MeshInfo` (from ``mesh``, or the default
data-parallel mesh of :func:`lightning_vescale.mesh.init_mesh`) and the user's
:class:`MixedPrecisionPolicy` object, whole; runtime settings (gradient sync, resharding after
forward) live on the group, the prefetch setting on the root context.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.dbuffer import DBuffer
from lightning_vescale.fsdp._collect import (
    GranularityArg,
    check_param,
    collect_params,
    resolve_granularities,
)
from lightning_vescale.fsdp._materialize import apply_to_group
from lightning_vescale.fsdp._param_group import ManagedParam, ParamGroup
from lightning_vescale.fsdp._policy import MixedPrecisionPolicy, as_policy
from lightning_vescale.fsdp._state import FSDPState, get_state, states_in
from lightning_vescale.fsdp._state_dict import register_state_dict_hooks
from lightning_vescale.mesh import MeshInfo, default_device_type, init_mesh

__all__ = [
    "MixedPrecisionPolicy",
    "VeScaleFSDPModule",
    "fully_shard",
    "iter_param_groups",
    "param_fqn_map",
    "dbuffers",
    "memory_bytes",
]


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


class VeScaleFSDPModule:
    """Mixed into every ``fully_shard``-ed module's class (like FSDP2's ``FSDPModule``)."""

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        states = states_in(self) if recurse else [get_state(self)]  # type: ignore[arg-type]
        return [st.group for st in states if st is not None and st.group is not None]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Turn gradient reduce-scatter on/off (off: gradients accumulate unsharded).

        With sync off, gradients of several backwards add up in each group's unsharded grad
        buffer without communication; the next backward with sync on reduce-scatters the sum.
        """
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in self._groups(recurse):
            group.reduce_grads = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Change whether groups free their unsharded parameters after forward."""
        _check_bool("reshard_after_forward", reshard_after_forward)
        for group in self._groups(recurse):
            group.reshard_after_forward = reshard_after_forward

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

    def reshard(self) -> None:
        """Free unsharded parameters of this module's groups (and inner ones)."""
        for group in self._groups(recurse=True):
            group.reshard()

    def unshard(self, async_op: bool = False) -> "_UnshardHandle":
        """All-gather this module's own group; ``wait()`` the handle before using it."""
        st = get_state(self)  # type: ignore[arg-type]
        assert st is not None
        if st.group is not None:
            st.group.unshard(async_op=async_op)
        return _UnshardHandle(st.group)

    def _apply(self, fn: Callable, recurse: bool = True) -> Any:  # noqa: D401
        return apply_to_group(self, super()._apply, fn, recurse)  # type: ignore[misc]


class _UnshardHandle:
    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


_CLASSES: dict[type, type] = {}


def _wrap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, VeScaleFSDPModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"VeScaleFSDP{cls.__name__}", (VeScaleFSDPModule, cls), {})
    module.__class__ = _CLASSES[cls]


def _check_not_wrapped(module: nn.Module) -> None:
    if get_state(module) is not None:
        raise ValueError(
            f"fully_shard was already called on this {type(module).__name__}; call it once "
            "per module (on each block, then on the root).")
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return
    for name, m in module.named_modules():
        if isinstance(m, (FSDPModule, FullyShardedDataParallel)):
            where = f"submodule {name!r}" if name else "the module"
            raise ValueError(
                f"{where} ({type(m).__name__}) is already wrapped by PyTorch FSDP; use either "
                "torch.distributed.fsdp or lightning_vescale.fsdp.fully_shard, not both.")


def _mesh_info(mesh: DeviceMesh | None, device: torch.device | None) -> MeshInfo:
    """The group's MeshInfo: ``mesh``, or the default data-parallel mesh for ``device``."""
    if mesh is None:
        mesh = init_mesh(default_device_type(device))
    elif not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard(mesh=...) must be a 1-D DeviceMesh or None, got {mesh!r}")
    return MeshInfo.from_mesh(mesh)


def fully_shard(module: nn.Module, *, mesh: DeviceMesh | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                granularity: GranularityArg = None,
                reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``module``'s parameters (those no inner group owns) as one group.

    Args:
        module: the module; call bottom-up (each block, then the root).
        mesh: a 1-D :class:`DeviceMesh` (default: the whole world, device type from the
            parameters or the current accelerator).
        mp_policy: mixed precision (:class:`MixedPrecisionPolicy`; FSDP2's is accepted too).
        granularity: block size per parameter in elements, as one int/str for all, a dict
            ``name -> int`` (names relative to ``module``) or a callable ``(name, param) ->
            int``. Every rank's range of a parameter starts and ends on a block boundary.
            Default: element-wise (the planner aligns shard sizes to 16 elements).
        reshard_after_forward: free the unsharded parameters after forward (re-gathered in
            backward). The root never reshards after forward.

    Returns:
        ``module``, whose class now also derives from :class:`VeScaleFSDPModule`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    _check_bool("reshard_after_forward", reshard_after_forward)
    _check_not_wrapped(module)
    policy = as_policy(mp_policy)
    collected = collect_params(module)
    if not collected and not states_in(module):
        raise ValueError(
            f"fully_shard({type(module).__name__}): the module has no parameters to shard; "
            "call fully_shard on modules that own parameters (or on a root whose blocks were "
            "sharded).")
    for c in collected:
        check_param(c.name, c.param)
    devices = {c.param.device for c in collected}
    if len(devices) > 1:
        raise ValueError(f"fully_shard({type(module).__name__}): parameters live on several "
                         f"devices {sorted(map(str, devices))}; move the module to one device.")
    device = next(iter(devices)) if devices else None
    mesh_info = _mesh_info(mesh, device)
    if device is None:
        device = torch.device(mesh_info.device_type)
    group: ParamGroup | None = None
    if collected:
        params = [ManagedParam(name=c.name, owners=list(c.owners), shape=tuple(c.param.shape),
                               requires_grad=c.param.requires_grad, aliases=list(c.aliases),
                               original_weakref=weakref.ref(c.param))
                  for c in collected]
        group = ParamGroup(
            params=params, mesh_info=mesh_info, mp_policy=policy,
            granularity=resolve_granularities(granularity, [(c.name, c.param) for c in collected]),
            reshard_after_forward=reshard_after_forward, fqn=type(module).__name__)
        group.build({c.name: c.param.detach() for c in collected}, device)
        register_state_dict_hooks(module, group)
    FSDPState(module, group, mp_policy=policy)
    _wrap_class(module)
    return module


# -- introspection for the strategy, optimizers and the memory profiler ----------------------------
def iter_param_groups(module: nn.Module) -> Iterator[tuple[str, ParamGroup]]:
    """``(module fqn relative to module, group)`` for every group in ``module``'s tree."""
    for name, m in module.named_modules():
        st = get_state(m)
        if st is not None and st.group is not None:
            yield name, st.group


def param_fqn_map(module: nn.Module) -> dict[str, tuple[ParamGroup, ManagedParam]]:
    """Parameter fqn (as in ``module.named_parameters()``) -> its group and managed entry.

    Tied parameters appear under their first name (the one ``named_parameters`` reports).
    """
    out: dict[str, tuple[ParamGroup, ManagedParam]] = {}
    for prefix, g in iter_param_groups(module):
        for mp in g.params:
            out[f"{prefix}.{mp.name}" if prefix else mp.name] = (g, mp)
    return out


def dbuffers(module: nn.Module) -> list[DBuffer]:
    """Every DBuffer of ``module``'s groups."""
    return [b for _, g in iter_param_groups(module) for b in g.buffers.values()]


def memory_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes held by ``module``'s DBuffers, by role (see ``DBuffer.memory_bytes``)."""
    out: dict[str, int] = {}
    for b in dbuffers(module):
        for k, v in b.memory_bytes().items():
            out[k] = out.get(k, 0) + v
    return out
