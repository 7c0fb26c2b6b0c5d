"""``fully_shard``: the public entry point of layer 3 (FSDP2-style, RaggedShard + DBuffer).

Design note [fsdp-api]
----------------------
``fully_shard(module)`` (or ``fully_shard([a, b])``) turns the parameters of the module(s)
that no inner ``fully_shard`` call owns into one
:class:`~lightning_vescale.fsdp._param_group.ParamGroup` (DBuffers per dtype: design note
[fsdp-buffer-order]), registers an
:class:`~lightning_vescale.fsdp._state.FSDPState` with the forward hooks, and changes each
module's class to a subclass mixing in :class:`VeScaleFSDPModule`, itself a subclass of
torch's ``FSDPModule`` (design note [fsdp-module] in ``_module.py``), so that FSDP2's methods
and ``isinstance`` checks work. Call it bottom-up: on each block, then on the root. The
arguments are FSDP2's, with FSDP2's meaning (``reshard_after_forward=None`` by default,
``offload_policy``, ``ignored_params``, ``shard_placement_fn`` and ``dp_mesh_dims`` read for
RaggedShard layouts: design note [fsdp-shard-placement]), plus ``granularity``.

Parameters keep their data: each rank copies its owned range of every parameter into its shard
(the caller guarantees the same values on every rank, e.g. by seeding, as with FSDP2). The
shard lives on the mesh's device, wherever the module was built (a CPU-built model sharded
under NCCL trains on the GPU, its buffers moved there: design note [mesh-device]). A module
on the meta device is planned without data; see design note [fsdp-materialize] in
``_materialize.py``.

Every group gets one :class:`~lightning_vescale.mesh.MeshInfo` (from ``mesh``, or the default
data-parallel mesh of :func:`lightning_vescale.mesh.init_mesh`) and the user's
:class:`MixedPrecisionPolicy` object, whole; runtime settings (gradient sync, resharding after
forward) live on the group, the prefetch setting on the root context.

Design note [fsdp-state-accessor]
---------------------------------
FSDP2's composable-API surface beyond the call itself, with FSDP2's rules:

* ``fully_shard.state(module)`` returns the module's :class:`FSDPState` (``None`` when
  ``fully_shard`` did not shard it): one per call, shared by the modules of a list group. It
  exposes, besides our own attributes, the FSDP2 names code reads through it:
  ``_fsdp_param_group(s)`` (our :class:`ParamGroup`, not an ``FSDPParamGroup``), ``_is_root``
  (``None`` before lazy init), ``_state_ctx`` (``all_states``), ``_mp_policy``, ``_modules``,
  ``_lazy_init()``.
* A container without ``forward`` (``nn.ModuleList``, ``nn.ModuleDict``) is refused with
  FSDP2's ``ValueError``: no forward runs on it, so its hooks would never gather the
  parameters. The message says to shard each block instead.
* ``copy.deepcopy`` of a sharded module is refused (FSDP2's message, "FSDP does not support
  deepcopy"; the error is both a ``RuntimeError`` and FSDP2's ``AssertionError``): the copy
  would share no DBuffer and no hooks with a state of its own. Copy before ``fully_shard``, or
  build a new model and load the state dict.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

from lightning_vescale.dbuffer import DBuffer
from lightning_vescale.fsdp._collect import (
    CollectedParam,
    GranularityArg,
    check_param,
    collect_params,
    remember_taken,
    resolve_granularities,
)
from lightning_vescale.fsdp._comm_policy import (
    CommPolicy,
    as_comm_policy,
    quantized_granularities,
    quantized_params,
)
from lightning_vescale.fsdp._module import VeScaleFSDPModule, register_fsdp_forward_method
from lightning_vescale.fsdp._outside_call import guard_outside_calls
from lightning_vescale.fsdp._param_group import ManagedParam, ParamGroup
from lightning_vescale.fsdp._policy import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    as_offload_policy,
    as_policy,
)
from lightning_vescale.fsdp._replaced import install_optimizer_check
from lightning_vescale.fsdp._reshard import ReshardPolicy, reshard_policy
from lightning_vescale.fsdp._param_mesh import (
    OWN_MESH_PARAMS,
    TP_PARAMS,
    own_mesh_info,
    refuse_unsupported,
)
from lightning_vescale.fsdp._shard_placement import (
    dp_mesh,
    local_value,
    placement_results,
    shard_units,
    with_units,
)
from lightning_vescale.fsdp._state import FSDPState, get_state
from lightning_vescale.fsdp._subgroups import make_partial_group
from lightning_vescale.fsdp._tp import (
    TPSpec,
    check_not_ragged,
    tp_default_granularity,
    tp_param_spec,
)
from lightning_vescale.fsdp._state_dict import register_state_dict_hooks
from lightning_vescale.mesh import MeshInfo, default_device_type, init_mesh, mesh_device

__all__ = [
    "CPUOffloadPolicy",
    "CommPolicy",
    "MixedPrecisionPolicy",
    "VeScaleFSDPModule",
    "fully_shard",
    "register_fsdp_forward_method",
    "iter_param_groups",
    "param_fqn_map",
    "dbuffers",
    "memory_bytes",
]


def _check_not_wrapped(module: nn.Module) -> None:
    if get_state(module) is not None:
        raise ValueError(
            f"fully_shard was already called on this {type(module).__name__}; call it once "
            "per module (on each block, then on the root).")
    for name, m in module.named_modules():
        if isinstance(m, (FSDPModule, FullyShardedDataParallel)) \
                and not isinstance(m, VeScaleFSDPModule):
            where = f"submodule {name!r}" if name else "the module"
            raise ValueError(
                f"{where} ({type(m).__name__}) is already wrapped by PyTorch FSDP; use either "
                "torch.distributed.fsdp or lightning_vescale.fsdp.fully_shard, not both.")


def _check_has_forward(module: nn.Module) -> None:
    """Refuse a container without ``forward`` (FSDP2's ``_validate_module``): its forward hooks
    would never run, so its children would see sharded parameters."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)) \
            and type(module).forward is nn.Module.forward:
        kind = type(module).__name__
        loop = "for b in model.layers: fully_shard(b)" if isinstance(module, nn.ModuleList) \
            else "for b in model.layers.values(): fully_shard(b)"
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: got an "
            f"{kind} of {len(module)} modules, whose forward never runs (its hooks would never "
            f"gather the parameters). Shard each block instead ({loop}), then the module that "
            "calls them (the root).")


def _as_modules(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """``fully_shard``'s first argument as a list of distinct, non-nested modules."""
    if isinstance(module, nn.Module):
        _check_has_forward(module)
        return [module]
    if not isinstance(module, (list, tuple)) or not module:
        raise TypeError(f"fully_shard expects an nn.Module or a non-empty list of nn.Modules, "
                        f"got {type(module).__name__}")
    modules = list(module)
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard([...]) expects nn.Modules, got {type(m).__name__}")
        _check_has_forward(m)
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard([...]) got the same module twice")
    ids = {id(m): i for i, m in enumerate(modules)}
    for i, m in enumerate(modules):
        for sub in m.modules():
            j = ids.get(id(sub))
            if j is not None and j != i:
                raise ValueError(
                    f"fully_shard([...]): module [{j}] ({type(sub).__name__}) is inside module "
                    f"[{i}] ({type(m).__name__}); list sibling modules only (call fully_shard on "
                    "the inner one first, as its own group).")
    return modules


def _create_process_groups(mesh_info: MeshInfo, reshard: ReshardPolicy) -> None:
    """Create the process groups the group will use, at this call (creating one is a
    collective): HSDP's flattened data-parallel group, ``reshard_after_forward=k``'s groups."""
    if mesh_info.is_hsdp:
        mesh_info.data_parallel_group  # collective on first use
    if reshard.ranks is not None:
        make_partial_group(mesh_info, reshard.ranks)


def _params_device(collected: list[CollectedParam], label: str) -> torch.device | None:
    """The one device of the collected parameters (``None``: no parameters)."""
    devices = {c.param.device for c in collected}
    if len(devices) > 1:
        raise ValueError(f"fully_shard({label}): parameters live on several "
                         f"devices {sorted(map(str, devices))}; move the module to one device.")
    return next(iter(devices)) if devices else None


def _mesh_info(mesh: DeviceMesh | None) -> MeshInfo:
    """The group's MeshInfo: ``mesh``, or the default data-parallel mesh, whose device type
    comes from the default process group, never from the parameters ([mesh-device])."""
    if mesh is None:
        mesh = init_mesh(default_device_type())
    elif not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard(mesh=...) must be a 1-D DeviceMesh (FSDP), a 2-D "
                         f"(replicate, shard) DeviceMesh (HSDP) or None, got {mesh!r}")
    return MeshInfo.from_mesh(mesh)


def _device_for(mesh_info: MeshInfo, params_device: torch.device | None) -> torch.device:
    """Where the group's buffers live: the mesh's device (FSDP2's ``_get_device_from_mesh``),
    whatever device the parameters were built on; parameters on the meta device stay there
    (deferred initialisation, design note [fsdp-materialize])."""
    if params_device is not None and params_device.type == "meta":
        return params_device
    return mesh_device(mesh_info.mesh)


def _move_buffers(modules: list[nn.Module], device: torch.device) -> None:
    """Move the module buffers this call manages to ``device`` (FSDP2's
    ``_move_states_to_device``; the parameters need no move: each rank copies its owned part
    into the group's DBuffer on ``device``). Modules an inner ``fully_shard`` owns and meta
    buffers are left alone."""
    seen: set[int] = set()

    def visit(m: nn.Module, top: bool) -> None:
        if id(m) in seen or (not top and get_state(m) is not None):
            return
        seen.add(id(m))
        for name, b in m._buffers.items():
            if b is not None and b.device != device and b.device.type != "meta":
                m._buffers[name] = b.to(device)
        for child in m.children():
            visit(child, False)

    for m in modules:
        visit(m, True)


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | ReshardPolicy | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: MixedPrecisionPolicy | None = None,
                offload_policy: Any = None,
                ignored_params: set[nn.Parameter] | None = None,
                granularity: GranularityArg = None,
                comm_policy: CommPolicy | dict[str, Any] | None = None,
                dp_mesh_dims: Any = None) -> Any:
    """Shard ``module``'s parameters (those no inner group owns) as one group (FSDP2's API).

    Args:
        module: the module, or a list of sibling modules that form one group (e.g. a tied
            embedding and output head: ``fully_shard([model.emb, model.head])``); call bottom-up
            (each block, then the root). A module without parameters of its own is allowed
            (it still gets the root hooks).
        mesh: a 1-D :class:`DeviceMesh` (FSDP; default: the whole world, device type from the
            default process group: the accelerator when its backend runs there), or a 2-D ``(replicate, shard)`` mesh
            (HSDP, FSDP2's convention: dim 0 replicates, dim 1 shards; e.g.
            ``init_mesh(device_type, replicas=nodes)``). Parameters are then DTensors with
            placements ``(Replicate(), RaggedShard)``, planned for the shard dim's size, and
            each gradient shard is all-reduced across the replicas (design note [hsdp]).
        reshard_after_forward: FSDP2's meaning. ``None`` (default): ``True`` for every group
            but the root, which keeps its parameters after forward (backward needs them
            first); ``True``/``False``: free (or keep) the unsharded parameters after forward,
            the root included; an ``int`` ``k`` dividing the shard-group size: after forward
            keep the parameters sharded over groups of ``k`` ranks, so that backward
            all-gathers among ``k`` ranks only (memory between the two). ``None`` also keeps
            the last group of the recorded forward order gathered into backward (design note
            [fsdp-reshard-policy]); a :class:`ReshardPolicy` is taken as it is.
        shard_placement_fn: FSDP2's: ``None`` -> the default layout, ``Shard(d)`` -> rank
            ranges keep ``prod(shape[d+1:])``-element slices whole; another 1-D mesh: a DBuffer
            on it (design notes [fsdp-shard-placement], [fsdp-param-mesh]).
        mp_policy: mixed precision (:class:`MixedPrecisionPolicy`; FSDP2's is accepted too).
        offload_policy: ``CPUOffloadPolicy`` (ours or FSDP2's) keeps sharded parameters,
            gradients and optimizer states in CPU memory; ``None``/FSDP2's ``OffloadPolicy()``:
            no offload.
        ignored_params: parameters left alone: not sharded, not moved, gradients not reduced
            (FSDP2's meaning).
        granularity: per parameter, one int/str for all (``"row"``, ``"matrix"``: each expert of
            ``(E, out, in)`` whole, ...), a dict ``name -> int/str`` (relative to ``module``) or
            ``(name, param) -> int``. Rank ranges start and end on a block boundary.
            Default: the strategies' (element-wise, multiples of 256 for tensors of 4096+
            elements: ``AdamW8bit``'s blocks; the planner aligns shard sizes to 16 elements).
        comm_policy: :class:`CommPolicy` (or a dict of its fields): int8/fp8 all-gather,
            gradient wire dtype (design note [comm-policy]); ``None``: neither.
        dp_mesh_dims: FSDP2's ``DataParallelMeshDims`` on the full SPMD ``mesh``, whose other
            dims must have size 1 (design note [fsdp-shard-placement]).

    Returns:
        ``module`` (or the list), whose class now also derives from :class:`VeScaleFSDPModule`
        and torch's ``FSDPModule``.
    """
    modules = _as_modules(module)
    for m in modules:
        _check_not_wrapped(m)
    policy = as_policy(mp_policy)
    offload = as_offload_policy(offload_policy)
    collected, sources, mesh, tp, placed = _collect(modules, ignored_params, mesh,
                                                    dp_mesh_dims, shard_placement_fn)
    label = _label(modules)
    mesh_info = _mesh_info(mesh)
    device = _device_for(mesh_info, _params_device(collected, label))
    reshard = reshard_policy(reshard_after_forward, mesh_info.shard_size)
    _create_process_groups(mesh_info, reshard)
    _move_buffers(modules, mesh_device(mesh_info.mesh))  # never to meta: buffers keep values
    group = None
    if collected:
        comm, quantized, grans = _group_layout(
            collected, sources, tp, placed, comm_policy, granularity,
            refuse=(offload, reshard_after_forward))
        group = ParamGroup(
            params=[_managed(c, tp, sources, placed) for c in collected], mesh_info=mesh_info,
            mp_policy=policy, granularity=grans, reshard_policy=reshard, fqn=label,
            offload=offload, comm_policy=comm, quantized=quantized)
        _build_group(group, modules, collected, sources, device, label)
    FSDPState(modules, group, mp_policy=policy)
    for m in modules:
        _wrap_class(m)
    return module


def _label(modules: list[nn.Module]) -> str:
    """The group's label: its module's class name, or a list group's ``[A, B]``."""
    if len(modules) == 1:
        return type(modules[0]).__name__
    return "[" + ", ".join(type(m).__name__ for m in modules) + "]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Placed:
    """What ``shard_placement_fn`` said of the call's parameters (design notes
    [fsdp-shard-placement], [fsdp-param-mesh])."""

    units: dict[str, int]  #: elements ``Shard(d)`` keeps whole, per parameter
    meshes: dict[str, MeshInfo]  #: the parameters on a mesh of their own, with it


def _collect(modules: list[nn.Module], ignored_params: set[nn.Parameter] | None,
             mesh: DeviceMesh | None, dp_mesh_dims: Any, shard_placement_fn: Any
             ) -> tuple[list[CollectedParam], dict[str, torch.Tensor], DeviceMesh,
                        dict[str, TPSpec], _Placed]:
    """The call's parameters (checked), each one's full value (a tensor-parallel parameter's:
    its TP-local tensor, with its :class:`TPSpec`: design note [fsdp-tp]), the data-parallel
    mesh (``dp_mesh_dims`` resolved: design note [fsdp-shard-placement]) and what
    ``shard_placement_fn`` returned for them (called once per parameter, with the user's
    parameter object; a TP parameter's units from its TP-local shape; a parameter on a mesh
    of its own is TP-planned over that mesh: design note [fsdp-param-mesh])."""
    ignored = {id(p) for p in (ignored_params or ())}
    collected = [c for c in collect_params(modules) if id(c.param) not in ignored]
    spmd_mesh = mesh if dp_mesh_dims is not None else None
    given = dp_mesh(mesh, dp_mesh_dims)
    # no mesh: the default data-parallel mesh ([mesh-device]; TP parameters refuse it)
    dp = given if given is not None else init_mesh(default_device_type())
    dims, own = placement_results(shard_placement_fn, [(c.name, c.param) for c in collected],
                                  dp)
    meshes = {n: own_mesh_info(n, m, dp) for n, m in own.items()}
    tp: dict[str, TPSpec] = {}
    if spmd_mesh is None:
        for c in collected:
            spec = tp_param_spec(c.name, c.param, own.get(c.name, given))
            if spec is not None:
                tp[c.name] = spec
    else:
        for c in collected:
            check_not_ragged(c.name, c.param)
    sources = {c.name: c.param.detach().to_local() if c.name in tp
               else local_value(c.name, c.param, spmd_mesh) for c in collected}
    for c in collected:
        check_param(c.name, sources[c.name] if spmd_mesh is not None or c.name in tp
                    else c.param)
    units = {n: shard_units(n, tuple(sources[n].shape), d) for n, d in dims.items()}
    return collected, sources, dp, tp, _Placed(units=units, meshes=meshes)


def _build_group(group: ParamGroup, modules: list[nn.Module], collected: list[CollectedParam],
                 sources: dict[str, torch.Tensor], device: torch.device, label: str) -> None:
    """Build the group's buffers from the parameters' data and register what refers to it."""
    group.build(sources, device)
    guard_outside_calls(group, modules)  # design note [fsdp-outside-call]
    for k, m in enumerate(modules):
        register_state_dict_hooks(m, group, k)
    remember_taken(collected, label)
    install_optimizer_check()


def _group_layout(collected: list[CollectedParam], sources: dict[str, torch.Tensor],
                  tp: dict[str, TPSpec], placed: _Placed, comm_policy: Any,
                  granularity: GranularityArg, *, refuse: tuple
                  ) -> tuple[CommPolicy | None, dict[str, bool], dict[str, int]]:
    """:func:`_comm_layout` of the call's parameters, a tensor-parallel one by its TP-local
    tensor (design note [fsdp-tp]), ``shard_placement_fn``'s units folded in; the options not
    supported with TP parameters or parameters on meshes of their own yet are refused
    (``refuse``: ``(offload, reshard_after_forward)``; ``dp_mesh_dims`` needs no check here:
    with it, TP is not detected (DTensors must be on the SPMD mesh, :func:`local_value`) and
    per-parameter meshes come with their own data-parallel mesh, as torchtitan's
    ``spmd_types`` backend passes them)."""
    named = [(c.name, sources[c.name] if c.name in tp else c.param) for c in collected]
    granularity = tp_default_granularity(granularity, tp)
    comm, quantized, grans = _comm_layout(comm_policy, granularity, named, placed.units)
    offload, reshard_after_forward = refuse
    options = dict(offload=offload, reshard_after_forward=reshard_after_forward)
    refuse_unsupported(sorted(tp), TP_PARAMS, **options)  # comm_policy works with TP
    refuse_unsupported(sorted(placed.meshes), OWN_MESH_PARAMS, comm=comm, **options)
    return comm, quantized, grans


def _comm_layout(comm_policy: Any, granularity: GranularityArg,
                 named: list[tuple[str, nn.Parameter]], units: dict[str, int]
                 ) -> tuple[CommPolicy | None, dict[str, bool], dict[str, int]]:
    """The group's comm policy (its block size resolved), which parameters it quantizes, and
    the granularities (``shard_placement_fn``'s ``units`` folded in: design note
    [fsdp-shard-placement]) with quantized tensors' aligned to the block (design note
    [comm-policy]). Checked here, at ``fully_shard``, before any step."""
    comm = as_comm_policy(comm_policy)
    grans = with_units(resolve_granularities(granularity, named), units)
    if comm is None or not comm.is_active:
        return None, {n: False for n, _ in named}, grans
    if comm.block_size is None:
        comm = dataclasses.replace(comm, block_size=comm.resolved_block_size())
    quantized = quantized_params(comm, named)
    # a granularity the user wrote (int, str, dict) must fit the blocks; computed ones (None,
    # a callable such as the strategies' policy) are rounded up to them
    user_given = granularity is not None and not callable(granularity)
    assert comm.block_size is not None
    return comm, quantized, quantized_granularities(grans, quantized, block_size=comm.block_size,
                                                    user_given=user_given)


def _managed(c: CollectedParam, tps: dict[str, TPSpec], sources: dict[str, torch.Tensor],
             placed: _Placed) -> ManagedParam:
    """The group's entry for a collected parameter (a TP parameter is planned by its
    TP-local shape: design note [fsdp-tp]; one on a mesh of its own carries it: design note
    [fsdp-param-mesh])."""
    tp = tps.get(c.name)
    shape = tuple(c.param.shape) if tp is None else tuple(sources[c.name].shape)
    return ManagedParam(name=c.name, owners=list(c.owners), shape=shape, tp=tp,
                        mesh_info=placed.meshes.get(c.name),
                        requires_grad=c.param.requires_grad, aliases=list(c.aliases),
                        scoped_aliases=list(c.scoped_aliases),
                        original_weakref=weakref.ref(c.param))


def _state_of(module: nn.Module) -> FSDPState | None:
    """``fully_shard.state(module)``: the module's :class:`FSDPState`, ``None`` when
    ``fully_shard`` did not shard it (FSDP2's composable-API accessor, design note
    [fsdp-state-accessor])."""
    return get_state(module)


fully_shard.state = _state_of  # type: ignore[attr-defined]


class DeepcopyError(RuntimeError, AssertionError):
    """``copy.deepcopy`` of a sharded module (design note [fsdp-state-accessor]); also an
    ``AssertionError``, the type FSDP2 raises, for code written against FSDP2."""


def _refuse_deepcopy(self: nn.Module, memo: dict) -> Any:
    raise DeepcopyError(
        f"FSDP does not support deepcopy of a sharded module ({type(self).__name__}, sharded by "
        "lightning_vescale.fsdp.fully_shard): the copy would have no DBuffers and no hooks of "
        "its own. Deepcopy the model before fully_shard, or build a new one and "
        "load_state_dict(model.state_dict()) (use state dicts for serialization).")


_CLASSES: dict[type, type] = {}


def _wrap_class(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, VeScaleFSDPModule):
        return
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"VeScaleFSDP{cls.__name__}", (VeScaleFSDPModule, cls),
                             {"__deepcopy__": _refuse_deepcopy})
    module.__class__ = _CLASSES[cls]


# -- introspection for the strategy, optimizers and the memory profiler ----------------------------
def iter_param_groups(module: nn.Module) -> Iterator[tuple[str, ParamGroup]]:
    """``(module fqn relative to module, group)`` for every group in ``module``'s tree, once
    each (a ``fully_shard([a, b])`` group under its first module met)."""
    seen: set[int] = set()
    for name, m in module.named_modules():
        st = get_state(m)
        if st is not None and st.group is not None and id(st.group) not in seen:
            seen.add(id(st.group))
            yield name, st.group


def param_fqn_map(module: nn.Module) -> dict[str, tuple[ParamGroup, ManagedParam]]:
    """Parameter fqn (as in ``module.named_parameters()``) -> its group and managed entry.

    Tied parameters appear under their first name (the one ``named_parameters`` reports).
    """
    paths = {id(m): name for name, m in module.named_modules()}
    order = {name: i for i, name in enumerate(paths.values())}
    out: dict[str, tuple[ParamGroup, ManagedParam]] = {}
    for name, m in module.named_modules():
        st = get_state(m)
        if st is None or st.group is None or st.module is not m:
            continue
        tops = [paths.get(id(top)) for top in st.modules]
        for mp in st.group.params:
            scoped = [(tops[k], rel) for k, rel in (mp.scoped_aliases or [(0, mp.name)])
                      if tops[k] is not None]
            if not scoped:
                continue
            prefix, rel = min(scoped, key=lambda pr: order[pr[0]])
            out[f"{prefix}.{rel}" if prefix else rel] = (st.group, mp)
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
