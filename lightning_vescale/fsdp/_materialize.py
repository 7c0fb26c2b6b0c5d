"""Device moves and meta-device initialisation of ``fully_shard``-ed modules.

Design note [fsdp-materialize]
------------------------------
Supported sequence for large models (what the Lightning strategy uses)::

    with torch.device("meta"):
        model = GPT(config)              # no memory
    for block in model.blocks:
        fully_shard(block)               # plans on meta: DBuffers without storage
    fully_shard(model)
    materialize(model, device)           # DBuffers on device + init + keep own ranges

:func:`materialize` first calls ``module.to_empty(device=...)`` (which, through
:func:`apply_to_group`, re-creates every DBuffer on ``device``), then initialises with *full*
temporary tensors: the rank swaps plain full-size parameters into the modules, initialises them
(default: ``reset_parameters()`` of every submodule that has one, in ``modules()`` order, as
Lightning does), copies its owned ranges into the shards and drops the temporaries. With the
default, this runs group by group: only the groups the current submodule's parameters belong to
hold temporaries (the root group and one block, for a transformer). Every rank computes the
same full values from the same seed, so the result equals single-device initialisation; no
collective is needed. A custom ``init_fn`` sees every parameter at once (one full copy of the
model in its master dtype); for models whose full parameters do not fit on one device, make it
initialise the sharded DTensors directly.

``module.to(device)``/``.cuda()``/``.to(dtype)``/``to_empty`` on a sharded module work too:
:func:`apply_to_group` applies the function to each rank's *local* 1-D shard views (never to
DTensors) and rebuilds the group's DBuffers from the results when device or dtype changed. A
move to another device type keeps the group's mesh: the same process group and dimension
names, on the new device type (``DeviceMesh.from_group``), whether the user supplied the mesh
or it is the default one.

A parameter the user *replaces* on a module after ``fully_shard`` and before the first forward
(``model.w = nn.Parameter(...)``, e.g. computed from layers materialised with ``to_empty``) is
taken back at the root's lazy init, with its new value, as FSDP2's ``reset_sharded_param`` does
(``ParamGroup.adopt_replaced_params``): a materialised group copies the rank's range of it into
its shard; a group still on the meta device whose parameters were all replaced is built on the
new parameters' device. The shape must stay; a DTensor value is gathered first.

Buffers: ``to_empty`` re-creates them too; those that were on a real device keep their values,
those that were on meta are recomputed (design note [meta-buffers]). ``init_params=False``
allocates without initialising parameters (their values are loaded next, e.g. by
``lightning_vescale.checkpoint.load_safetensors``), buffers are still recomputed.

Design note [fsdp-list-apply]
-----------------------------
A ``fully_shard([a, b])`` group is converted once per ``_apply`` pass, by the first of its
modules the pass reaches: it registers temporaries over the local shard views in *every* owner
(``b``'s too), runs ``nn.Module._apply`` on ``a``, converts the temporaries only ``b`` owns with
``fn`` itself, and rebuilds the group. When the pass then reaches ``b``, ``b`` holds the group's
*new* sharded parameters; ``nn.Module._apply`` must not see them. It would call ``fn`` on those
DTensors and, DTensor being a wrapper subclass, ``torch.utils.swap_tensors`` the result into the
very objects the optimizer gets: after ``to_empty`` (a fresh ``empty_like``) they no longer view
the DBuffer, so the optimizer stepped tensors the forward never read, and a meta-built
DeepSeek-V3 (torchtitan's ``fully_shard([norm, output])``) kept its initial loss for ever. So
``b``'s ``_apply`` runs with the group's parameters unregistered (``None``, which
``nn.Module._apply`` skips) in the modules it reaches. As a guard for any other path (a user's
``swap_tensors``, ``.data =`` on a sharded parameter), the root's lazy init checks that every
sharded parameter still views its DBuffer and names the one that does not
(``ParamGroup.check_views``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale import _meta_buffers
from lightning_vescale.fsdp._param_group import ParamGroup, set_param
from lightning_vescale.fsdp._state import get_state, states_in
from lightning_vescale.fsdp._tp import load_full_
from lightning_vescale.mesh import MeshInfo

__all__ = ["materialize", "apply_to_group"]


def apply_to_group(module: nn.Module, super_apply: Callable[..., Any], fn: Callable,
                   recurse: bool) -> Any:
    """``nn.Module._apply`` for a sharded module (see design note [fsdp-materialize]).

    A ``fully_shard([a, b])`` group is handled by the first of its modules that ``_apply``
    reaches: the parameters owned by the other modules are converted with ``fn`` directly, and
    those modules' own ``_apply`` (the same pass: the same ``fn`` object) runs with the group's
    parameters hidden from them, so that ``fn`` reaches neither the group's new parameter
    objects nor their DBuffer views twice (design note [fsdp-list-apply]).
    """
    st = get_state(module)
    group = st.group if st is not None else None
    if group is None or not group.buffers:
        return super_apply(fn, recurse)
    if len(st.modules) > 1:  # type: ignore[union-attr]
        done = group.applying
        if done is not None and done[0] is fn and id(module) not in done[1]:
            done[1].add(id(module))  # another module of the list did the group in this pass
            with _hidden(group, _reached(module, recurse)):
                return super_apply(fn, recurse)
        group.applying = (fn, {id(module)})
    group.reshard()
    was_meta = all(b.is_meta for b in group.buffers.values())
    reached = _reached(module, recurse)
    temps: dict[str, nn.Parameter] = {}
    for mp in group.params:
        assert mp.buffer is not None
        temps[mp.name] = nn.Parameter(mp.buffer.local_view(mp.name), requires_grad=mp.requires_grad)
        for owner in mp.owners:
            set_param(owner.module, owner.attr, temps[mp.name])
    try:
        ret = super_apply(fn, recurse)
    finally:
        new = _applied(group, temps, reached, fn)
        old_dtype = {mp.name: mp.buffer.dtype for mp in group.params}  # type: ignore[union-attr]
        changed = False
        for mp in group.params:
            t, buf = new[mp.name], mp.buffer
            assert t is not None and buf is not None
            same_storage = (t.device.type == "meta" and buf.is_meta) or (
                t.device == buf.shard_device and not buf.is_meta
                and t.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr())
            if not same_storage or t.dtype != old_dtype[mp.name]:
                changed = True
        if changed:
            _rebuild(group, {n: t.detach() for n, t in new.items()}, from_meta=was_meta)
        else:
            group.swap(sharded=True)
    return ret


def _reached(module: nn.Module, recurse: bool) -> set[int]:
    """The modules ``module._apply(fn, recurse)`` converts the parameters of."""
    return {id(m) for m in module.modules()} if recurse else {id(module)}


def _applied(group: ParamGroup, temps: dict[str, nn.Parameter], reached: set[int],
             fn: Callable) -> dict[str, torch.Tensor]:
    """What ``fn`` made of each parameter's local view: the tensor its owner now holds where
    ``_apply`` reached an owner (a new ``Parameter``, or ``temps[name]`` itself, converted in
    place by ``.data =`` or ``swap_tensors``), else ``fn`` applied here, once (a parameter of a
    list group owned only by modules the pass reaches later, or not at all)."""
    new: dict[str, torch.Tensor] = {}
    for mp in group.params:
        owner = next((o for o in mp.owners if id(o.module) in reached), None)
        if owner is not None:
            new[mp.name] = owner.module._parameters[owner.attr]  # type: ignore[assignment]
        else:
            with torch.no_grad():
                new[mp.name] = fn(temps[mp.name])
    return new


@contextlib.contextmanager
def _hidden(group: ParamGroup, reached: set[int]) -> Iterator[None]:
    """Unregister ``group``'s parameters from the modules in ``reached`` for a while:
    ``nn.Module._apply`` skips ``None`` parameters (design note [fsdp-list-apply])."""
    held = [(o, o.module._parameters[o.attr]) for mp in group.params for o in mp.owners
            if id(o.module) in reached]
    for o, _ in held:
        o.module._parameters[o.attr] = None
    try:
        yield
    finally:
        for o, p in held:
            o.module._parameters[o.attr] = p


def _rebuild(group: ParamGroup, locals_: dict[str, torch.Tensor], *, from_meta: bool) -> None:
    """Re-create ``group``'s DBuffers on the device of ``locals_`` with their values. From meta
    (``to_empty``) there are no values: the new tensors are uninitialised, so nothing is copied
    (the shard is allocated zeroed, and each page is touched once, not three times)."""
    device = next(iter(locals_.values())).device
    if from_meta:
        locals_ = {n: t.to("meta") for n, t in locals_.items()}
    if group.offload is not None and device.type == "cpu" and group.buffers:
        device = next(iter(group.buffers.values())).device  # offloaded: compute device stays
    if device.type != "meta" and device.type != group.mesh_info.device_type:
        group.mesh_info = MeshInfo.from_mesh(_on_device_type(group.mesh_info.mesh, device.type))
        for mp in group.params:  # parameters on meshes of their own ([fsdp-param-mesh])
            if mp.mesh_info is not None:
                mp.mesh_info = MeshInfo.from_mesh(_on_device_type(mp.mesh_info.mesh,
                                                                  device.type))
    group.build(locals_, device, local_sources=True)  # meta sources: nothing is copied


def _on_device_type(mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """``mesh`` on ``device_type``: the same process groups, ranks and dimension names."""
    groups = mesh.get_group() if mesh.ndim == 1 else [mesh.get_group(d) for d in range(mesh.ndim)]
    return DeviceMesh.from_group(groups, device_type, mesh=mesh.mesh.tolist(),
                                 mesh_dim_names=mesh.mesh_dim_names)


def materialize(module: nn.Module, device: torch.device | str,
                init_fn: Callable[[nn.Module], None] | None = None, *,
                init_params: bool = True) -> nn.Module:
    """Allocate a (meta-)sharded module's DBuffers on ``device`` and initialise it.

    Args:
        module: a module whose groups were created with ``fully_shard`` (on meta or not), or a
            plain module.
        device: target device.
        init_fn: called once with ``module`` while every managed parameter is a full-size plain
            tensor. Runs under ``torch.no_grad()``. Default: ``reset_parameters()`` of every
            submodule that defines it, in ``module.modules()`` order (what Lightning does), run
            group by group so that only the groups the current submodule touches hold full-size
            temporaries.
        init_params: ``False``: allocate only (parameters hold uninitialised memory until they
            are loaded); buffers are recomputed all the same.

    Returns:
        ``module``. See design notes [fsdp-materialize] and [meta-buffers].
    """
    device = torch.device(device)
    on_meta = _meta_buffers.meta_buffers(module)
    real = _meta_buffers.save_real_buffers(module)
    module.to_empty(device=device)
    _meta_buffers.restore_real_buffers(real)
    poisoned = _meta_buffers.poison(on_meta)
    groups = [st.group for st in states_in(module) if st.group is not None]
    try:
        with torch.no_grad():
            if not init_params:
                pass
            elif init_fn is None:
                _default_init_group_by_group(module, groups, device)
            else:
                temps = [_swap_in_temporaries(g, device) for g in groups]
                init_fn(module)
                for g, group_temps in zip(groups, temps):
                    _load_owned_ranges(g, group_temps)
    finally:
        for g in groups:
            g.swap(sharded=True)
    _meta_buffers.recompute(module, on_meta, poisoned, reset_ran=init_params and init_fn is None)
    return module


def _swap_in_temporaries(group: ParamGroup, device: torch.device) -> dict[str, nn.Parameter]:
    """Register a full-size (uninitialised) plain parameter for each of ``group``'s params (a
    tensor-parallel one's of its global shape: design note [fsdp-tp])."""
    temps = {}
    for mp in group.params:
        assert mp.buffer is not None
        shape = mp.shape if mp.tp is None else mp.tp.shape
        full = torch.empty(shape, dtype=mp.buffer.dtype, device=device)
        temps[mp.name] = tp = nn.Parameter(full, requires_grad=mp.requires_grad)
        for owner in mp.owners:
            set_param(owner.module, owner.attr, tp)
    return temps


def _load_owned_ranges(group: ParamGroup, temps: dict[str, nn.Parameter]) -> None:
    """Copy this rank's range of each temporary into the shard; modules get the shards back."""
    for mp in group.params:
        load_full_(mp, temps[mp.name])
    group.swap(sharded=True)


def _default_init_group_by_group(module: nn.Module, groups: list[ParamGroup],
                                 device: torch.device) -> None:
    """The default init with each group's temporaries alive only while they are used.

    ``reset_parameters()`` of every submodule that defines it runs in ``module.modules()``
    order (so the random stream, hence every value, equals single-device initialisation). Before a
    submodule's call, the groups owning any of its parameters (recursively: a
    ``reset_parameters`` may initialise its children) get full-size temporaries; after a
    group's last such call, its ranges are copied into the shards and the temporaries dropped.
    Peak memory: the groups one submodule spans (for a transformer: the root group and one
    block), instead of the whole model.
    """
    group_of = {id(p): g for g in groups for mp in g.params
                for p in (mp.sharded, mp.unsharded) if p is not None}
    calls = [m for m in module.modules() if callable(getattr(m, "reset_parameters", None))]
    touched = [{id(group_of[id(p)]): group_of[id(p)] for p in m.parameters()
                if id(p) in group_of} for m in calls]
    last_use = {gid: i for i, gs in enumerate(touched) for gid in gs}
    live: dict[int, dict[str, nn.Parameter]] = {}
    for i, (m, gs) in enumerate(zip(calls, touched)):
        for gid, g in gs.items():
            if gid not in live:
                live[gid] = _swap_in_temporaries(g, device)
        m.reset_parameters()
        for gid, g in gs.items():
            if last_use[gid] == i:
                _load_owned_ranges(g, live.pop(gid))
