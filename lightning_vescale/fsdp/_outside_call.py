"""A submodule called outside its group's forward: say which module to call instead.

Design note [fsdp-outside-call]
-------------------------------
A group's parameters are gathered by the pre-forward of the module(s) ``fully_shard`` was
called on, as in FSDP2. Calling one of their submodules directly (``pl_module.model(x)`` in
``on_fit_end``, with the LightningModule as the root group) runs it on the *sharded* DTensor
parameters, and DTensor fails deep inside with ``aten.embedding.default got mixed torch.Tensor
and DTensor``, naming neither the module nor the fix. So every module that registers a
group's parameter (an *owner*) and is not itself one of the group's modules gets a forward
pre-hook that raises a ``RuntimeError`` naming the module called, the module whose forward
gathers its parameters, and the alternative (``unshard()`` first, ``reshard()`` after). The
hook reads one attribute while the group is gathered (inside its forward, and after
``unshard()``), so a normal step pays one Python call per owner module; under ``torch.compile``
dynamo inlines it as a guard on that attribute, which is the same on every call of a block's
compiled forward.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from lightning_vescale.fsdp._param_group import ParamGroup

__all__ = ["guard_outside_calls"]


def guard_outside_calls(group: ParamGroup, modules: list[nn.Module]) -> None:
    """Install the pre-hook on every owner of ``group``'s parameters outside ``modules`` (the
    group's own modules, whose pre-forward gathers them)."""
    own = {id(m) for m in modules}
    group_ref = weakref.ref(group)
    seen: set[int] = set()
    for mp in group.params:
        for owner in mp.owners:
            m = owner.module
            if id(m) in own or id(m) in seen:
                continue
            seen.add(id(m))
            m.register_forward_pre_hook(_hook(group_ref, [weakref.ref(x) for x in modules]))


def _hook(group_ref: weakref.ref, module_refs: list[weakref.ref]) -> Any:
    def check(module: nn.Module, args: Any) -> None:
        group = group_ref()
        if group is None or group.modules_hold_unsharded or group.is_unsharded:
            return
        raise RuntimeError(_message(module, group, [r() for r in module_refs]))
    return check


def _message(module: nn.Module, group: ParamGroup, modules: list[nn.Module | None]) -> str:
    names = group.module_fqns if len(group.module_fqns) == len(modules) else [None] * len(modules)
    where = [_cls_name(m) + (f" ({n!r})" if n and n != "<root>" else "")
             for m, n in zip(modules, names) if m is not None]
    if group.module_fqn == "<root>" or names[0] == "":
        where = [w + " (the root module: the model or LightningModule sharded last)"
                 for w in where]
    return (
        f"{_cls_name(module)} ran while its parameters are sharded: they belong to the "
        f"fully_shard group of {' / '.join(where)}, whose forward gathers them (as in FSDP2), "
        "and that forward is not running around this call. Call that module instead of one "
        "of its submodules (e.g. the LightningModule itself, not pl_module.model(...)), or "
        "gather the parameters first: `m.unshard()` on that module, then your call, then "
        "`m.reshard()`.")


def _cls_name(module: nn.Module) -> str:
    """The user's class name (not the ``VeScaleFSDP<Cls>`` wrapper class)."""
    cls = type(module)
    if cls.__name__.startswith("VeScaleFSDP") and len(cls.__bases__) == 2:
        cls = cls.__bases__[1]
    return cls.__name__
