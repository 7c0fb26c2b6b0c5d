"""Device moves and meta-device initialisation of ``fully_shard``-ed modules.

Design note [fsdp-init]
-----------------------
Supported sequence for large models (what the Lightning strategy uses)::

    with torch.device("meta"):
        model = GPT(config)              # no memory
    for block in model.blocks:
        fully_shard(block)               # plans on meta: DBuffers without storage
    fully_shard(model)
    materialize(model, device)           # DBuffers on device + init + keep own ranges

:func:`materialize` first calls ``module.to_empty(device=...)`` (which, through
:func:`apply_to_group`, re-creates every DBuffer on ``device``), then initialises with *full*
temporary tensors, group by group in module order: the rank swaps plain full-size parameters
into the modules, runs ``init_fn`` (default: ``reset_parameters()`` of every submodule that has
one, as Lightning does), copies its owned ranges into the shards and drops the temporaries.
Every rank computes the same full values from the same seed, so the result equals single-device
initialisation; no collective is needed. The temporaries hold one copy of the parameters in
their master dtype; for models whose full parameters do not fit on one device, pass an
``init_fn`` that initialises the sharded DTensors directly.

``module.to(device)``/``.cuda()``/``.to(dtype)``/``to_empty`` on a sharded module work too:
:func:`apply_to_group` applies the function to each rank's *local* 1-D shard views (never to
DTensors) and rebuilds the group's DBuffers from the results when device or dtype changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_vescale.fsdp._param_group import ParamGroup, set_param
from lightning_vescale.fsdp._state import get_state, states_in

__all__ = ["materialize", "apply_to_group", "default_init"]


def apply_to_group(module: nn.Module, super_apply: Callable[..., Any], fn: Callable,
                   recurse: bool) -> Any:
    """``nn.Module._apply`` for a sharded module (see design note [fsdp-init])."""
    st = get_state(module)
    group = st.group if st is not None else None
    if group is None or not group.buffers:
        return super_apply(fn, recurse)
    group.reshard()
    temps: dict[str, nn.Parameter] = {}
    for mp in group.params:
        assert mp.buffer is not None
        temps[mp.name] = nn.Parameter(mp.buffer.local_view(mp.name), requires_grad=mp.requires_grad)
        for m, a in mp.owners:
            set_param(m, a, temps[mp.name])
    try:
        ret = super_apply(fn, recurse)
    finally:
        new = {mp.name: mp.owners[0][0]._parameters[mp.owners[0][1]] for mp in group.params}
        old_dtype = {mp.name: mp.buffer.dtype for mp in group.params}  # type: ignore[union-attr]
        changed = False
        for mp in group.params:
            t, buf = new[mp.name], mp.buffer
            assert t is not None and buf is not None
            same_storage = (t.device.type == "meta" and buf.is_meta) or (
                t.device == buf.device and not buf.is_meta
                and t.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr())
            if not same_storage or t.dtype != old_dtype[mp.name]:
                changed = True
        if changed:
            _rebuild(group, {n: t.detach() for n, t in new.items()})
        else:
            group.swap(sharded=True)
    return ret


def _rebuild(group: ParamGroup, locals_: dict[str, torch.Tensor]) -> None:
    device = next(iter(locals_.values())).device
    if device.type != "meta" and device.type != group.mesh.device_type:
        from lightning_vescale.fsdp.api import default_mesh
        group.mesh = default_mesh(device.type)
    group.build(locals_, device, local_sources=True)


def default_init(module: nn.Module) -> None:
    """Call ``reset_parameters()`` on every submodule that defines it (Lightning's order)."""
    for m in module.modules():
        fn = getattr(m, "reset_parameters", None)
        if callable(fn):
            fn()


def materialize(module: nn.Module, device: torch.device | str,
                init_fn: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Allocate a (meta-)sharded module's DBuffers on ``device`` and initialise it.

    Args:
        module: a module whose groups were created with ``fully_shard`` (on meta or not).
        device: target device.
        init_fn: called once with ``module`` while every managed parameter is a full-size plain
            tensor (default :func:`default_init`). Runs under ``torch.no_grad()``.

    Returns:
        ``module``. See design note [fsdp-init].
    """
    device = torch.device(device)
    module.to_empty(device=device)
    states = [st for st in states_in(module) if st.group is not None]
    temps: list[tuple[Any, Any, nn.Parameter]] = []
    for st in states:
        g = st.group
        assert g is not None
        for mp in g.params:
            assert mp.buffer is not None
            full = torch.empty(mp.shape, dtype=mp.buffer.dtype, device=device)
            tp = nn.Parameter(full, requires_grad=mp.requires_grad)
            for m, a in mp.owners:
                set_param(m, a, tp)
            temps.append((g, mp, tp))
    try:
        with torch.no_grad():
            (init_fn or default_init)(module)
            for g, mp, _ in temps:
                m, a = mp.owners[0]
                mp.buffer.load_local_(mp.name, m._parameters[a])
    finally:
        for st in states:
            assert st.group is not None
            st.group.swap(sharded=True)
    return module
