"""Which list ops the flat step serves, binding their arguments, and the exactness probe.

See design note [flat-step] in ``_flat_step`` (why a probe: CPU kernels compute a tensor's
vector body and its scalar tail differently for some ops, so joining tensors can change bits).
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
from lightning_vescale.placement._flat_runs import _SINGLETON, _count

__all__ = ["FLAT_STEP_FUSED", "flat_step_ops"]

#: Fused optimizer kernels handled like ``_foreach_*`` ops (their lists are element-wise).
FLAT_STEP_FUSED = FUSED_OPTIMIZER_OPS
_PROBE_ALIGNMENTS_FUSED = (1, 16, 64)


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


# ---------------------------------------------------------------------------------------------
# Exactness probe (see the design note).
# ---------------------------------------------------------------------------------------------
_PROBE_SIZES = (1, 2, 3, 5, 8, 13, 16, 17, 31, 33, 64, 65, 100, 129, 255, 300)
_PROBE_MULTIPLES = (1, 2, 3, 5, 8, 1, 4)
_probe_cache: dict[tuple, int] = {}


def _scalar_kind(v: Any) -> tuple:
    """What about a scalar can pick a different kernel branch (lerp's weight < 0.5, alpha == 1)."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return (type(v).__name__, v)
    if isinstance(v, (int, float)):
        return (type(v).__name__, v == 0, v == 1, v == -1, v < 0, abs(v) < 0.5)
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.device.type, tuple(v.shape))
    if isinstance(v, (list, tuple)):
        return tuple(sorted({_scalar_kind(e) for e in v}, key=repr))
    return (type(v).__name__,)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            t.element_size()])
    return t


def _probe_values(n: int, dtype: torch.dtype, device: torch.device,
                  gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        x = torch.rand(n, generator=gen, dtype=torch.float64) * 1.95 + 0.05
        return x.to(device=device, dtype=dtype)
    if dtype == torch.bool:
        return (torch.rand(n, generator=gen) < 0.5).to(device)
    return torch.randint(1, 5, (n,), generator=gen).to(device=device, dtype=dtype)


def _probe(op, info: _OpInfo, values: list, list_dtypes: dict[int, torch.dtype],
           device: torch.device, align: int) -> bool:
    """Run ``op`` per item and flat on synthetic data; True when every bit agrees."""
    sizes = _PROBE_SIZES if align == 1 else tuple(align * m for m in _PROBE_MULTIPLES)
    sizes = sizes + (sizes[-1] + max(1, align // 2) + 3,)  # a ragged tail on the last item
    gen = torch.Generator().manual_seed(1234)
    per_args, flat_args = list(values), list(values)
    per_lists, flat_lists = {}, {}
    for i in info.tensor_lists:
        if i in list_dtypes:
            flat = _probe_values(sum(sizes), list_dtypes[i], device, gen)
            flat_lists[i] = flat
            per_lists[i] = list(flat.clone().split(sizes))
            per_args[i], flat_args[i] = per_lists[i], [flat]
        else:  # per-item scalar tensors (state_steps) or an empty optional list
            lst = values[i]
            per_args[i] = [lst[0]] * len(sizes) if lst else []
            flat_args[i] = [lst[0]] if lst else []
    for i in info.scalar_lists:
        lst = values[i]
        per_args[i] = [lst[0]] * len(sizes)
        flat_args[i] = [lst[0]]
    try:
        with torch.no_grad():
            out_per = _call(op, info, per_args)
            out_flat = _call(op, info, flat_args)
    except Exception:  # noqa: BLE001 - an op the probe cannot exercise: do not merge
        return False
    for i, flat in flat_lists.items():
        if not torch.equal(_bits(torch.cat(per_lists[i])), _bits(flat)):
            return False
    if info.returns_list:
        if not torch.equal(_bits(torch.cat([o.reshape(-1) for o in out_per])),
                           _bits(out_flat[0].reshape(-1))):
            return False
    return True


def _exact_alignment(op, info: _OpInfo, values: list, list_dtypes: dict[int, torch.dtype],
                     device: torch.device) -> int:
    """The item alignment at which the flat op is bitwise exact (``_SINGLETON``: none)."""
    kinds = []
    for i, v in enumerate(values):
        if i in list_dtypes:
            continue
        if i in info.scalar_lists:  # the kinds of the distinct values
            kinds.append(tuple(sorted({_scalar_kind(e) for e in set(v)}, key=repr)))
        elif i in info.tensor_lists:  # per-item scalar tensors: the probe uses the first
            kinds.append(_scalar_kind(v[0]) if v else ())
        else:
            kinds.append(_scalar_kind(v))
    key = (op, tuple(sorted(list_dtypes.items())), device.type, tuple(kinds))
    found = _probe_cache.get(key)
    if found is None:
        found = _SINGLETON
        for align in (_PROBE_ALIGNMENTS_FUSED if info.fused else (1,)):
            if _probe(op, info, values, list_dtypes, device, align):
                found = align
                break
        _probe_cache[key] = found
        _count("probe")
    return found
