"""Which list ops the flat step serves, and binding their arguments.

See design note [flat-step] in ``_flat_step``; the exactness probe of these ops is in
``_flat_probe``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch

from lightning_vescale.placement._common import (
    FUSED_OPTIMIZER_OPS,
    aten,
    foreach_is_elementwise,
)

__all__ = ["FLAT_STEP_FUSED", "flat_step_ops"]

#: Fused optimizer kernels handled like ``_foreach_*`` ops (their lists are element-wise).
FLAT_STEP_FUSED = FUSED_OPTIMIZER_OPS


# ---------------------------------------------------------------------------------------------
# Which ops, and what their arguments are.
# ---------------------------------------------------------------------------------------------
class _OpInfo(NamedTuple):
    names: tuple[str, ...]
    tensor_lists: tuple[int, ...]  # argument indices typed Tensor[]
    scalar_lists: tuple[int, ...]  # argument indices typed Scalar[] / float[] / ...
    tensors: tuple[int, ...]  # argument indices typed Tensor / Tensor?
    kwarg_only: tuple[bool, ...]
    defaults: tuple[Any, ...]
    returns_list: bool  # one Tensor[] return (out-of-place); else no return (in place)
    fused: bool


def _is_list_type(t: Any, elem: type) -> bool:
    return isinstance(t, torch.ListType) and isinstance(t.getElementType(), elem)


@functools.cache
def _op_info(op: torch._ops.OpOverload) -> _OpInfo | None:
    schema = op._schema
    args = schema.arguments
    if any(a.name == "out" for a in args):
        return None
    rets = schema.returns
    if len(rets) == 0:
        returns_list = False
    elif len(rets) == 1 and _is_list_type(rets[0].type, torch.TensorType):
        returns_list = True
    else:
        return None
    tl, sl, ts = [], [], []
    for i, a in enumerate(args):
        t = a.type
        if _is_list_type(t, torch.TensorType):
            tl.append(i)
        elif isinstance(t, torch.ListType):
            sl.append(i)
        elif isinstance(t, torch.TensorType) or (
            isinstance(t, torch.OptionalType) and isinstance(t.getElementType(), torch.TensorType)
        ):
            ts.append(i)
    if not tl:
        return None
    return _OpInfo(
        names=tuple(a.name for a in args),
        tensor_lists=tuple(tl), scalar_lists=tuple(sl), tensors=tuple(ts),
        kwarg_only=tuple(a.kwarg_only for a in args),
        defaults=tuple(a.default_value if a.has_default_value() else None for a in args),
        returns_list=returns_list,
        fused=schema.name.startswith("aten::_fused_"),
    )


@functools.cache
def flat_step_ops() -> tuple[torch._ops.OpOverload, ...]:
    """Every op :func:`flat_list_op` serves: element-wise ``_foreach_*`` overloads (no ``out=``
    variants) and the fused optimizer kernels of :data:`FLAT_STEP_FUSED`."""
    ops = []
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith(("aten::_foreach_", "aten::_fused_")):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        if name.startswith("_fused_"):
            if name not in FLAT_STEP_FUSED:
                continue
        elif not foreach_is_elementwise(name[len("_foreach_"):].rstrip("_")):
            continue
        packet = getattr(aten, name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None or torch.Tag.nondeterministic_seeded in op.tags:
            continue
        if _op_info(op) is not None:
            ops.append(op)
    return tuple(sorted(ops, key=str))


def _bind(info: _OpInfo, args: tuple, kwargs: dict) -> list[Any] | None:
    values = list(info.defaults)
    if len(args) > len(info.names):
        return None
    values[: len(args)] = args
    for k, v in kwargs.items():
        try:
            values[info.names.index(k)] = v
        except ValueError:
            return None
    return values


def _call(op, info: _OpInfo, values: list) -> Any:
    pos, kw = [], {}
    for name, ko, v in zip(info.names, info.kwarg_only, values):
        if ko:
            kw[name] = v
        else:
            pos.append(v)
    return op(*pos, **kw)
