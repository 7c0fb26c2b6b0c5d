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
on the meta device is planned without data; see design note [fsdp-init] in ``_init.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_vescale.dbuffer import DBuffer
from lightning_vescale.fsdp._param_group import ManagedParam, ParamGroup
from lightning_vescale.fsdp._state import FSDPState, get_state, states_in
from lightning_vescale.fsdp._state_dict import register_load_hook

__all__ = [
    "MixedPrecisionPolicy",
    "VeScaleFSDPModule",
    "fully_shard",
    "default_mesh",
    "iter_param_groups",
    "param_fqn_map",
    "dbuffers",
    "memory_bytes",
]

GranularityArg = Union[None, int, str, Mapping[str, Union[int, str]],
                       Callable[[str, nn.Parameter], Union[int, str]]]


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Mixed precision for ``fully_shard`` (same fields and meaning as FSDP2's).

    Args:
        param_dtype: dtype of the all-gather and of the unsharded parameters used in compute
            (``None``: the parameters' own dtype). Shards stay in the original dtype (the fp32
            master copy) and the optimizer steps on them.
        reduce_dtype: dtype of the gradient reduce-scatter (``None``: ``param_dtype``).
        output_dtype: cast floating-point forward outputs to this dtype (``None``: no cast).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for f in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, torch.dtype) or not v.is_floating_point):
                raise TypeError(
                    f"MixedPrecisionPolicy.{f} must be a floating-point torch.dtype or None, "
                    f"got {f}={v!r}")


def _as_policy(mp_policy: Any) -> MixedPrecisionPolicy:
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    if all(hasattr(mp_policy, f) for f in ("param_dtype", "reduce_dtype", "output_dtype")):
        # PyTorch's FSDP2 MixedPrecisionPolicy (same fields)
        return MixedPrecisionPolicy(
            param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
            output_dtype=mp_policy.output_dtype,
            cast_forward_inputs=getattr(mp_policy, "cast_forward_inputs", True))
    raise TypeError(
        f"mp_policy must be a lightning_vescale.fsdp.MixedPrecisionPolicy or None, got "
        f"{type(mp_policy).__name__}")


# Keyed on the world size too: a child forked from a process that used fully_shard, or a new
# init_process_group() after destroy_process_group(), may have another world size. (A 1-D world
# mesh looks its group up by name, so it follows a re-initialised default group by itself.)
_MESHES: dict[tuple[str, int], DeviceMesh] = {}


def _device_type_for(device: torch.device | None) -> str:
    if device is not None and device.type != "meta":
        return device.type
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if acc is not None and backend != "gloo":
        return acc.type
    return "cpu"


def default_mesh(device_type: str | None = None) -> DeviceMesh:
    """A 1-D mesh over the default process group (cached per device type).

    ``device_type`` defaults to the current accelerator when the default backend is not gloo,
    else ``"cpu"``.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed to be initialised (init_process_group), even "
            "for world_size=1; or pass mesh=... explicitly.")
    dt = device_type or _device_type_for(None)
    key = (dt, dist.get_world_size())
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(dt, (dist.get_world_size(),))
    return _MESHES[key]


class VeScaleFSDPModule:
    """Mixed into every ``fully_shard``-ed module's class (like FSDP2's ``FSDPModule``)."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Turn gradient reduce-scatter on/off (off: gradients accumulate unsharded).

        With sync off, gradients of several backwards add up in each group's unsharded grad
        buffer without communication; the next backward with sync on reduce-scatters the sum.
        """
        if not isinstance(requires_gradient_sync, bool):
            raise TypeError(f"requires_gradient_sync must be a bool, got "
                            f"{requires_gradient_sync!r}")
        targets = states_in(self) if recurse else [get_state(self)]  # type: ignore[arg-type]
        for st in targets:
            if st is not None:
                st.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *,
                                  recurse: bool = True) -> None:
        """Change whether groups free their unsharded parameters after forward."""
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        targets = states_in(self) if recurse else [get_state(self)]  # type: ignore[arg-type]
        for st in targets:
            if st is not None:
                st.reshard_after_forward = bool(reshard_after_forward)

    def set_prefetch(self, enabled: bool) -> None:
        """Enable/disable implicit all-gather prefetching (root setting; default on)."""
        if not isinstance(enabled, bool):
            raise TypeError(f"set_prefetch(enabled=...) must be a bool, got {enabled!r}")
        for st in states_in(self):  # type: ignore[arg-type]
            st.prefetch = bool(enabled)

    def reshard(self) -> None:
        """Free unsharded parameters of this module's groups (and inner ones)."""
        for st in states_in(self):  # type: ignore[arg-type]
            if st.group is not None:
                st.group.reshard()

    def unshard(self, async_op: bool = False) -> "_UnshardHandle":
        """All-gather this module's own group; ``wait()`` the handle before using it."""
        st = get_state(self)  # type: ignore[arg-type]
        assert st is not None
        if st.group is not None:
            st.group.unshard(async_op=async_op)
        return _UnshardHandle(st.group)

    def _apply(self, fn: Callable, recurse: bool = True) -> Any:  # noqa: D401
        from lightning_vescale.fsdp._init import apply_to_group
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


def _collect(module: nn.Module) -> list[tuple[str, nn.Parameter, list, list[str]]]:
    """This group's parameters: ``(name, param, owners, aliases)``, skipping inner groups."""
    inner_ids: set[int] = set()
    for st in states_in(module):
        if st.group is not None:
            for mp in st.group.params:
                inner_ids.update((id(mp.sharded), id(mp.unsharded)))
                orig = mp.original() if mp.original is not None else None
                if orig is not None:  # still referenced elsewhere, e.g. by a tied head
                    inner_ids.add(id(orig))
    found: dict[int, list[Any]] = {}
    seen_modules: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        for attr, p in m._parameters.items():
            if p is None:
                continue
            name = prefix + attr
            if id(p) in inner_ids:
                raise ValueError(
                    f"parameter {name!r} is shared with (tied to) a parameter of an inner "
                    "fully_shard group; tied parameters must live in one group: call "
                    "fully_shard on a common ancestor only (e.g. leave the embedding and the "
                    "output head to the root).")
            entry = found.setdefault(id(p), [name, p, [], []])
            if (m, attr) not in [(o, a) for o, a in entry[2]]:
                entry[2].append((m, attr))
                entry[3].append(name)
        for cname, child in m._modules.items():
            if child is None or get_state(child) is not None:
                continue
            visit(child, prefix + cname + ".")

    visit(module, "")
    return [tuple(v) for v in found.values()]  # type: ignore[misc]


def _check_param(name: str, p: nn.Parameter) -> None:
    if isinstance(p, DTensor):
        raise ValueError(
            f"parameter {name!r} is already a DTensor (sharded by FSDP2, tensor parallelism or "
            "another engine); fully_shard needs plain tensors.")
    if p.layout != torch.strided or p.is_sparse:
        raise TypeError(f"parameter {name!r} has layout {p.layout}; fully_shard supports dense "
                        "(strided) parameters only.")
    if p.is_complex():
        raise TypeError(f"parameter {name!r} is complex ({p.dtype}); fully_shard supports real "
                        "floating-point parameters; store it as a real view (torch.view_as_real).")
    if not p.is_floating_point():
        raise TypeError(f"parameter {name!r} has dtype {p.dtype}; fully_shard shards "
                        "floating-point parameters only; register integer/bool state as a "
                        "buffer (module.register_buffer) instead.")


def _granularities(granularity: GranularityArg,
                   entries: list) -> dict[str, int | str]:
    names = [e[0] for e in entries]
    if granularity is None:
        return {n: 1 for n in names}
    if isinstance(granularity, (int, str)) and not isinstance(granularity, bool):
        return {n: granularity for n in names}
    if isinstance(granularity, Mapping):
        unknown = sorted(set(granularity) - set(names))
        if unknown:
            raise ValueError(
                f"granularity has keys {unknown} that are not parameters of this group; valid "
                f"names (relative to the module): {names}")
        return {n: granularity.get(n, 1) for n in names}
    if callable(granularity):
        out = {}
        for name, param in ((e[0], e[1]) for e in entries):
            g = granularity(name, param)
            if isinstance(g, bool) or not isinstance(g, (int, str)):
                raise TypeError(
                    f"the granularity callable returned {g!r} for parameter {name!r}; it must "
                    "return a block size in elements (int), 'row' or '<k>rows' (return 1 for "
                    "element-wise sharding).")
            out[name] = g
        return out
    raise TypeError(f"granularity must be None, an int, a str, a dict name->int or a callable "
                    f"(name, param)->int, got {type(granularity).__name__}")


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
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
    _check_not_wrapped(module)
    policy = _as_policy(mp_policy)
    entries = _collect(module)
    if not entries and not states_in(module):
        raise ValueError(
            f"fully_shard({type(module).__name__}): the module has no parameters to shard; "
            "call fully_shard on modules that own parameters (or on a root whose blocks were "
            "sharded).")
    for name, p, *_ in entries:
        _check_param(name, p)
    devices = {e[1].device for e in entries}
    if len(devices) > 1:
        raise ValueError(f"fully_shard({type(module).__name__}): parameters live on several "
                         f"devices {sorted(map(str, devices))}; move the module to one device.")
    device = next(iter(devices)) if devices else None
    if mesh is None:
        mesh = default_mesh(_device_type_for(device))
    elif not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"mesh must be a 1-D DeviceMesh, got {mesh!r}")
    if device is None:
        device = torch.device(mesh.device_type)
    group: ParamGroup | None = None
    if entries:
        grans = _granularities(granularity, entries)
        params = [ManagedParam(name=n, owners=list(owners), shape=tuple(p.shape),
                               requires_grad=p.requires_grad, aliases=list(aliases),
                               original=weakref.ref(p))
                  for n, p, owners, aliases in entries]
        group = ParamGroup(module=module, params=params, mesh=mesh,
                           param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype,
                           granularity=lambda n, shape: grans[n], fqn=type(module).__name__)
        group.build({e[0]: e[1].detach() for e in entries}, device)
        register_load_hook(module, group)
    FSDPState(module, group, reshard_after_forward=reshard_after_forward,
              param_dtype=policy.param_dtype, output_dtype=policy.output_dtype,
              cast_forward_inputs=policy.cast_forward_inputs)
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
