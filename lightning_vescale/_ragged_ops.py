"""Operators on ``RaggedShard`` DTensors: the one place where DTensor dispatch learns about them.

Design note [ragged-ops]
------------------------
The local tensor of a ``RaggedShard`` DTensor is its rank's flat, contiguous slice of the
row-major global tensor. Two operands with the *same* global shape, stride and ``RaggedShard``
placement therefore hold the same flat element range on every rank, so an element-wise op is
exact when run on the local tensors, with the result keeping that placement. Norms and full
reductions are a local partial plus one collective over the mesh dimension. Nothing else
(views, matmuls, indexing, partial-dim reductions, random fills) is defined on a ragged layout,
and such ops must fail loudly instead of returning a tensor with a wrong placement.

How torch 2.13 dispatches a DTensor op (``torch/csrc/autograd/python_variable.cpp``,
``dispatchDTensorOp``), and where this module hooks in:

1. A per-op ``OpDispatcher._custom_op_handlers`` dict is consulted first. Keying an op there
   would route *every* DTensor's call of that op through Python, so this module does not add
   entries for common ops; it only guards the few handlers torch already registers
   (``argmin``/``argmax``/``convolution*``) against ragged inputs.
2. A C++ cache maps (op, input specs incl. placements, shapes, strides, dtypes, static args) to
   an ``OutputSharding``. On a hit, C++ runs the op on the local tensors and wraps the result
   with the cached output spec: no Python at all.
3. On a miss C++ calls ``OpDispatcher._propagate_op_sharding_dispatch_slow_path``. Its result is
   either an ``OutputSharding`` (cached, then step 2's local compute runs) or *the op's final
   result* (returned as is, nothing cached; torch uses this for decompositions).

**Extensions (the only patches of DTensor internals):** (a) ``install()`` wraps torch's
``argmin``/``argmax``/``convolution*`` custom handlers so ragged inputs raise (they assume
Shard/Replicate and would mis-handle a ragged layout); (b) it replaces the bound
``_propagate_op_sharding_dispatch_slow_path`` on the ``DTensor._op_dispatcher`` instance with
:func:`_slow_path`. Why (b): it is the single point every uncached DTensor op passes through,
it sees the op's ``OpSchema`` (placements of every argument) and it may answer with either a
sharding or a result. For schemas with no ``RaggedShard`` it calls the original unchanged, so
ordinary DTensors keep the normal path. For ragged schemas:

* element-wise ops (``torch.Tag.pointwise``, their ``_foreach_*`` forms, copies, casts,
  ``*_like`` factories; see :func:`is_elementwise_op`) get an ``OutputSharding`` that keeps the
  placement and needs no redistribution. C++ caches it, so from the second call on (e.g. every
  optimizer step) the op costs exactly what it costs on a ``Replicate`` DTensor.
* norms and full reductions (:data:`_DIRECT_HANDLERS`) are computed here and returned as
  ``Replicate`` DTensors (one collective per call, one per *list* for ``_foreach_norm``, so
  ``clip_grad_norm_(foreach=True)`` costs one all-reduce; its default for DTensors is the
  per-tensor loop, one all-reduce per gradient).
* ``copy_`` between two layouts of the same tensor redistributes the source, then copies.
* anything else raises :class:`NotImplementedError` naming the op and the supported families;
  operands whose layouts do not match raise ``ValueError`` naming the op and both layouts.

Tested with torch 2.13's C++ DTensor dispatch; ``install()`` raises ``RuntimeError`` with an
explanation on a torch without ``_propagate_op_sharding_dispatch_slow_path``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Partial

from lightning_vescale.placement import RaggedShard

__all__ = ["install", "is_elementwise_op", "SUPPORTED_FAMILIES"]

aten = torch.ops.aten

SUPPORTED_FAMILIES = (
    "element-wise (pointwise) ops and their _foreach_* forms, whose tensor operands have the "
    "same global shape, stride and placement or are scalar-like (Python scalars, 0-d/1-element "
    "plain tensors or Replicate DTensors); copy_ (also from another layout of the same "
    "tensor), dtype casts, clone/detach and *_like "
    "factories; full reductions sum/mean/max/min/amax/amin/any/all, linalg.vector_norm, "
    "_foreach_norm/_foreach_powsum/_foreach_max (results are Replicate); equal/allclose"
)

# Ops that are element-wise on a flat slice but carry no ``torch.Tag.pointwise``.
_EXTRA_ELEMENTWISE = {
    aten.copy_.default,
    aten.copy.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten._to_copy.default,
    aten.detach.default,
    aten.detach_.default,
    aten.alias.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
}
# DTensor's own list of ops it treats as pointwise but that lack the tag (e.g. masked_fill_,
# used by the backward of vector_norm). Private in torch, so optional.
try:
    from torch.distributed.tensor._ops._pointwise_ops import (
        _extra_pointwise_ops as _DTENSOR_EXTRA_POINTWISE,
    )
except ImportError:  # pragma: no cover - layout of torch internals changed
    _DTENSOR_EXTRA_POINTWISE = []
_EXTRA_ELEMENTWISE.update(
    op for op in _DTENSOR_EXTRA_POINTWISE
    if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten"
)
# Fused optimizer steps are element-wise over their tensor lists too; ``state_steps`` (0-d) and
# ``grad_scale``/``found_inf``/tensor ``lr`` are scalar-like operands.
_FUSED_ELEMENTWISE_NAMES = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
for _name in _FUSED_ELEMENTWISE_NAMES:
    _packet = getattr(aten, _name, None)
    if _packet is not None:
        _EXTRA_ELEMENTWISE.update(getattr(_packet, o) for o in _packet.overloads())
# ``_foreach_X`` is element-wise when ``X`` is; these bases are reductions or matmuls instead.
_FOREACH_NOT_ELEMENTWISE = {"max", "norm", "powsum", "mm"}
_FOREACH_EXTRA_BASES = {"copy", "zero"}


@functools.cache
def is_elementwise_op(op: torch._ops.OpOverload) -> bool:
    """True when ``op`` maps each element (or each list item's elements) independently.

    Random ops (``nondeterministic_seeded``) are excluded: DTensor's RNG tracker has no notion
    of a ragged range, so they would draw the same stream on every rank.
    """
    if torch.Tag.nondeterministic_seeded in op.tags:
        return False
    if op in _EXTRA_ELEMENTWISE or torch.Tag.pointwise in op.tags:
        return True
    name = op._schema.name  # "aten::_foreach_add_" (op.name() carries the overload too)
    if name.startswith("aten::_foreach_"):
        base = name[len("aten::_foreach_"):].rstrip("_")
        if base in _FOREACH_NOT_ELEMENTWISE:
            return False
        if base in _FOREACH_EXTRA_BASES:
            return True
        packet = getattr(aten, base, None)
        return packet is not None and any(
            torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()
        )
    return False


def _is_list_op(op: torch._ops.OpOverload) -> bool:
    return op.name().startswith(("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_"))


def _has_ragged(spec: object) -> bool:
    return isinstance(spec, DTensorSpec) and any(
        type(p) is RaggedShard for p in spec.placements
    )


def _schema_has_ragged(op_info: Any) -> bool:
    for s in op_info.flat_args_schema:
        if _has_ragged(s):
            return True
    schema = op_info.schema
    if schema is not None and schema.kwargs_schema:
        for v in schema.kwargs_schema.values():
            if _has_ragged(v) or (
                isinstance(v, (list, tuple)) and any(_has_ragged(e) for e in v)
            ):
                return True
    return False


def _spec_str(spec: object) -> str:
    if isinstance(spec, DTensorSpec):
        shape = tuple(spec.tensor_meta.shape) if spec.tensor_meta is not None else "?"
        return f"{tuple(spec.placements)} shape={shape}"
    return repr(spec)


def _unsupported(op: object, specs: Sequence[object], why: str = "") -> NotImplementedError:
    placements = ", ".join(_spec_str(s) for s in specs if isinstance(s, DTensorSpec))
    return NotImplementedError(
        f"{op} is not supported on RaggedShard DTensors{why} (operand placements: "
        f"{placements}). RaggedShard DTensors support only {SUPPORTED_FAMILIES}. For other "
        "ops, first call .full_tensor() or .redistribute(...) to Replicate/Shard."
    )


# ---------------------------------------------------------------------------------------------
# Element-wise ops: an OutputSharding that keeps the placement (cached by DTensor's C++ path).
# ---------------------------------------------------------------------------------------------
def _is_scalar_like(spec: DTensorSpec) -> bool:
    """A replicated 1-element operand with at most one dim broadcasts against a flat slice."""
    meta = spec.tensor_meta
    return (
        meta is not None
        and len(meta.shape) <= 1
        and math.prod(meta.shape) == 1
        and all(p.is_replicate() for p in spec.placements)
    )


def _same_layout(a: DTensorSpec, b: DTensorSpec) -> bool:
    ma, mb = a.tensor_meta, b.tensor_meta
    return (
        a.placements == b.placements
        and a.mesh == b.mesh
        and ma is not None
        and mb is not None
        and tuple(ma.shape) == tuple(mb.shape)
        and tuple(ma.stride) == tuple(mb.stride)
    )


def _slot_main(
    op: object, specs: Sequence[DTensorSpec], all_specs: Sequence[object]
) -> DTensorSpec:
    """The layout every non-scalar operand of one element-wise application shares."""
    main: DTensorSpec | None = None
    for s in specs:
        if any(isinstance(p, Partial) for p in s.placements):
            raise _unsupported(
                op, all_specs,
                ": an operand is Partial; call .full_tensor() or .redistribute(placements="
                "[Replicate()]) on it first",
            )
        if _is_scalar_like(s):
            continue
        if main is None:
            main = s
        elif not _same_layout(main, s):
            raise ValueError(
                f"{op}: element-wise ops on RaggedShard DTensors need every tensor operand to "
                f"have the same global shape, stride and placement (or be a scalar / 1-element "
                f"Replicate tensor); got {_spec_str(main)} and {_spec_str(s)}. Redistribute "
                "one operand to the other's placement first."
            )
    if main is None:  # only scalar-like operands in this slot: the result is replicated too
        main = specs[0]
    return main


def _tensor_slots(op: torch._ops.OpOverload, schema: OpSchema):
    """Group the DTensorSpecs of ``schema`` by element-wise application.

    A single op is one application. A ``_foreach_*`` op applies item ``i`` of every list
    together, plus any non-list tensor operand (e.g. ``_foreach_mul_.Tensor``'s ``other``)
    which we call *shared*.
    """
    operands = list(schema.args_schema) + list(schema.kwargs_schema.values())
    if not _is_list_op(op):
        flat: list[DTensorSpec] = []
        for a in operands:
            if isinstance(a, DTensorSpec):
                flat.append(a)
            elif isinstance(a, (list, tuple)):
                flat.extend(e for e in a if isinstance(e, DTensorSpec))
        return [flat], []
    lists = [
        a for a in operands
        if isinstance(a, (list, tuple)) and any(isinstance(e, DTensorSpec) for e in a)
    ]
    shared = [a for a in operands if isinstance(a, DTensorSpec)]
    n = len(lists[0]) if lists else 0
    if any(len(lst) != n for lst in lists):
        raise ValueError(f"{op}: tensor lists have different lengths {[len(x) for x in lists]}")
    slots = [[lst[i] for lst in lists if isinstance(lst[i], DTensorSpec)] for i in range(n)]
    return slots, shared


def _elementwise_sharding(op: torch._ops.OpOverload, schema: OpSchema) -> OutputSharding:
    slots, shared = _tensor_slots(op, schema)
    all_specs = [s for slot in slots for s in slot] + shared
    for s in shared:
        if not all(p.is_replicate() for p in s.placements):
            raise _unsupported(
                op, all_specs, f": the shared operand {_spec_str(s)} must be Replicate"
            )
    mains = [_slot_main(op, slot, all_specs) for slot in slots if slot]
    if not mains:
        raise _unsupported(op, all_specs)
    if _is_list_op(op) and op._schema.name.endswith("_"):
        # In place over lists: item i of the first list is written, so it must be the layout
        # every other operand of item i shares (a replicated scalar cannot absorb a shard).
        for slot, main in zip(slots, mains):
            if not _same_layout(slot[0], main):
                raise ValueError(
                    f"{op}: an in-place op would write {_spec_str(main)} into an operand of "
                    f"layout {_spec_str(slot[0])}; use the out-of-place op."
                )
    # Global output metadata (dtype promotion, dtype= kwargs) from DTensor's own fake-tensor
    # propagation. Runs once per (op, layouts): the result is cached by the C++ dispatcher.
    metas = DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_non_cached(schema)

    def out_spec(main: DTensorSpec, meta: TensorMeta | None) -> DTensorSpec | None:
        if meta is None:
            return None
        if tuple(meta.shape) != tuple(main.tensor_meta.shape):
            raise ValueError(
                f"{op}: the result shape {tuple(meta.shape)} differs from the operand shape "
                f"{tuple(main.tensor_meta.shape)} ({_spec_str(main)}); on RaggedShard DTensors "
                "element-wise ops must not broadcast the sharded operand."
            )
        return DTensorSpec(main.mesh, main.placements, tensor_meta=meta)

    if metas is None:
        output: Any = None
    elif isinstance(metas, TensorMeta):
        output = out_spec(mains[0], metas)
    elif _is_list_op(op):
        if len(metas) != len(mains):
            raise _unsupported(op, all_specs, ": unexpected number of outputs")
        output = tuple(out_spec(m, t) for m, t in zip(mains, metas))
    else:  # a single op with several outputs (e.g. frexp): all keep the operand's layout
        output = tuple(out_spec(mains[0], t) for t in metas)
    if isinstance(output, DTensorSpec) and op._schema.name.endswith("_") and not _is_list_op(op):
        self_spec = schema.args_schema[0] if schema.args_schema else None
        if not (isinstance(self_spec, DTensorSpec) and _same_layout(self_spec, output)):
            raise ValueError(
                f"{op}: an in-place op would change self's layout from {_spec_str(self_spec)} "
                f"to {_spec_str(output)}; use the out-of-place op."
            )
    return OutputSharding(output)


@functools.lru_cache(maxsize=4096)
def _elementwise_sharding_cached(op: torch._ops.OpOverload, schema: OpSchema) -> OutputSharding:
    # Used only when C++ could not build its own cache key (it then asks for a cached answer).
    return _elementwise_sharding(op, schema)


# ---------------------------------------------------------------------------------------------
# Norms and full reductions: local partial + one collective; results are Replicate DTensors.
# ---------------------------------------------------------------------------------------------
def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def _reduce_groups(op: object, x: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """Process groups of the mesh dims ``x`` is ragged over; all others must be Replicate."""
    groups = []
    for d, p in enumerate(x._spec.placements):
        if type(p) is RaggedShard:
            groups.append(x.device_mesh.get_group(d))
        elif not p.is_replicate():
            raise _unsupported(
                op, [x._spec], f": a reduction over RaggedShard mixed with {p} is not defined"
            )
    return tuple(groups)


def _check_full(op: object, x: DTensor, dim: Any) -> None:
    if dim is None:
        return
    dims = [dim] if isinstance(dim, int) else list(dim)
    ndim = x.ndim
    if dims and sorted({d % max(ndim, 1) for d in dims}) != list(range(ndim)):
        raise _unsupported(
            op, [x._spec], f" with dim={dim}: only full reductions (dim=None) are supported"
        )


_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _Reduction:
    """One tensor's local partial (or a vector of them) and how to combine it across ranks.

    ``kind`` is ``sum`` (all-reduce SUM), ``max`` or ``min``. ``root`` is ``1/p`` for p-norms
    (applied after the sum), ``mean_of`` divides by the global element count.
    """

    __slots__ = ("partial", "kind", "groups", "root", "mean_of", "out_dtype", "shape")

    def __init__(self, partial, kind, groups, out_dtype, shape, root=None, mean_of=None):
        self.partial, self.kind, self.groups = partial, kind, groups
        self.out_dtype, self.shape, self.root, self.mean_of = out_dtype, shape, root, mean_of


def _norm_reduction(op: object, x: DTensor, ord: float, dtype, power_sum: bool = False,
                    keep_shape: tuple[int, ...] = ()) -> _Reduction:
    local = x._local_tensor
    groups = _reduce_groups(op, x)
    p = float(ord)
    if dtype is not None:
        out_dtype = dtype
    else:
        out_dtype = local.real.dtype if local.is_complex() else local.dtype
    if not (out_dtype.is_floating_point or out_dtype.is_complex):
        raise TypeError(f"{op}: norms need a floating point dtype, got {out_dtype}")
    # Accumulate half-precision partials in fp32, as torch's dense kernels do internally.
    acc = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    if power_sum and (math.isinf(p) or p == 0):
        raise _unsupported(op, [x._spec], f" with ord={ord}")
    if p == math.inf or p == -math.inf:
        if local.numel() == 0:  # neutral element of max(|x|) is 0, of min(|x|) is +inf
            partial = torch.full((), 0.0 if p > 0 else math.inf, dtype=acc, device=local.device)
        else:
            partial = torch.linalg.vector_norm(local, p, dtype=acc)
        return _Reduction(partial, "max" if p > 0 else "min", groups, out_dtype, keep_shape)
    if p == 0 or p == 1:  # count of non-zeros / sum of |x|: no root
        partial = torch.linalg.vector_norm(local, p, dtype=acc)
        return _Reduction(partial, "sum", groups, out_dtype, keep_shape)
    if p > 0:
        partial = torch.linalg.vector_norm(local, p, dtype=acc).pow(p)
    else:
        partial = local.abs().to(acc).pow(p).sum()
    return _Reduction(partial, "sum", groups, out_dtype, keep_shape,
                      root=None if power_sum else 1.0 / p)


# torch 2.13 deprecates ``all_gather_into_tensor`` in favour of ``all_gather_single``.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_reduce_many(reds: Sequence[_Reduction]) -> list[torch.Tensor]:
    """Combine many partials with one collective per (groups, kind, dtype) bucket."""
    buckets: dict[tuple, list[int]] = {}
    for i, r in enumerate(reds):
        key = (tuple(id(g) for g in r.groups), r.kind, r.partial.dtype, r.partial.device)
        buckets.setdefault(key, []).append(i)
    totals: list[torch.Tensor | None] = [None] * len(reds)
    for idx in buckets.values():
        r0 = reds[idx[0]]
        flat = torch.cat([reds[i].partial.reshape(-1) for i in idx])
        for g in r0.groups:
            world = dist.get_world_size(g)
            if world == 1:
                continue
            if r0.kind == "sum":
                buf = torch.view_as_real(flat) if flat.is_complex() else flat
                dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=g)
            else:
                # max/min via all-gather + local amax/amin: unlike a MAX all-reduce, this
                # propagates NaN exactly like the dense kernel (clip_grad_norm_ relies on it).
                gathered = flat.new_empty(world * flat.numel())
                _all_gather_flat(gathered, flat.reshape(-1), group=g)
                gathered = gathered.view(world, -1)
                flat = gathered.amax(0) if r0.kind == "max" else gathered.amin(0)
        offset = 0
        for i in idx:
            n = reds[i].partial.numel()
            totals[i] = flat[offset:offset + n]
            offset += n
    out = []
    for r, t in zip(reds, totals):
        assert t is not None
        if r.root is not None:
            t = t.pow(r.root)
        if r.mean_of is not None:
            t = t / r.mean_of
        out.append(t.to(r.out_dtype).reshape(r.shape))
    return out


def _replicate(result: torch.Tensor, like: DTensor) -> DTensor:
    mesh = like.device_mesh
    spec = DTensorSpec(
        mesh,
        (Replicate(),) * mesh.ndim,
        tensor_meta=TensorMeta(result.shape, result.stride(), result.dtype),
    )
    return DTensor(result, spec, requires_grad=False)


def _keep_shape(x: DTensor, keepdim: bool) -> tuple[int, ...]:
    return (1,) * x.ndim if keepdim else ()


def _vector_norm(op, args, kwargs):
    b = _bind(op, args, kwargs)
    x = b["self"]
    _check_full(op, x, b["dim"])
    red = _norm_reduction(op, x, b["ord"], b["dtype"], keep_shape=_keep_shape(x, b["keepdim"]))
    return _replicate(_all_reduce_many([red])[0], x)


def _foreach_reduction(op, args, kwargs, make):
    """Reduce each list item; ragged items share collectives, others take DTensor's path."""
    b = _bind(op, args, kwargs)
    tensors = b["self"]
    reds, where, out = [], [], [None] * len(tensors)
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor) and _has_ragged(t._spec):
            reds.append(make(t, b))
            where.append(i)
        else:
            out[i] = _dense_fallback(op, t, b)
    for i, total in zip(where, _all_reduce_many(reds)):
        out[i] = _replicate(total, tensors[i])
    return out


def _dense_fallback(op, t, b):
    # A non-ragged item of a list that also holds ragged ones: DTensor's own path for it.
    rest = {k: v for k, v in b.items() if k != "self"}
    return op([t], **rest)[0]


def _foreach_norm(op, args, kwargs):
    fast = _foreach_norm_batched(op, args, kwargs)
    if fast is not None:
        return fast
    return _foreach_reduction(
        op, args, kwargs, lambda t, b: _norm_reduction(op, t, b["ord"], b["dtype"])
    )


def _foreach_norm_batched(op, args, kwargs):
    """``_foreach_norm`` over same-layout-family ragged items with ord in (0, inf]: one
    ``_foreach_norm`` kernel on the local tensors, one collective, one shared output spec.

    This is the path ``clip_grad_norm_(foreach=True)`` takes every step, so per-item Python is
    kept out of it. Returns ``None`` when the general per-item path must be used instead.
    """
    b = _bind(op, args, kwargs)
    tensors, p, dtype = b["self"], float(b["ord"]), b["dtype"]
    if not tensors or not p > 0:
        return None
    first = tensors[0]
    if not isinstance(first, DTensor):
        return None
    mesh, placements = first.device_mesh, first._spec.placements
    local_dtype = first._local_tensor.dtype
    for t in tensors:
        if not (
            isinstance(t, DTensor)
            and t._spec.placements == placements
            and t.device_mesh == mesh
            and t._local_tensor.dtype == local_dtype
        ):
            return None
    if not _has_ragged(first._spec) or local_dtype.is_complex:
        return None
    out_dtype = dtype if dtype is not None else local_dtype
    if not out_dtype.is_floating_point:
        return None
    acc = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    groups = _reduce_groups(op, first)
    locals_ = [t._local_tensor for t in tensors]
    if math.isinf(p):  # the inf-norm kernel rejects empty tensors: their max(|x|) is 0
        partial = torch.zeros(len(locals_), dtype=acc, device=locals_[0].device)
        idx = [i for i, x in enumerate(locals_) if x.numel()]
        if idx:
            norms = torch._foreach_norm([locals_[i] for i in idx], p, dtype=acc)
            partial[idx] = torch.stack(norms)
        kind, root = "max", None
    else:
        partial = torch.stack(torch._foreach_norm(locals_, p, dtype=acc))
        if p != 1:
            partial = partial.pow(p)
        kind, root = "sum", (None if p == 1 else 1.0 / p)
    red = _Reduction(partial, kind, groups, out_dtype, (len(locals_),), root=root)
    total = _all_reduce_many([red])[0]
    spec = DTensorSpec(
        mesh, (Replicate(),) * mesh.ndim, tensor_meta=TensorMeta((), (), out_dtype)
    )
    return [DTensor(v, spec, requires_grad=False) for v in total.unbind(0)]


def _foreach_powsum(op, args, kwargs):
    return _foreach_reduction(
        op, args, kwargs,
        lambda t, b: _norm_reduction(op, t, b["ord"], b["dtype"], power_sum=True),
    )


def _extremum_reduction(op, x: DTensor, kind: str, keep_shape=(), as_bool=False) -> _Reduction:
    """max/min (and any/all, which are max/min over ``bool``) of one tensor."""
    local = x._local_tensor
    if math.prod(x.shape) == 0:
        raise RuntimeError(f"{op}: the reduction of an empty tensor has no identity")
    dtype = torch.bool if as_bool else local.dtype
    work = local.ne(0) if as_bool and local.dtype != torch.bool else local
    if work.dtype == torch.bool:  # collectives do not reduce bool: 0/1 in int32
        work = work.to(torch.int32)
    if work.numel():
        partial = work.amax() if kind == "max" else work.amin()
    else:  # a rank without elements contributes the neutral element
        if dtype == torch.bool:
            neutral = 0 if kind == "max" else 1
        elif work.dtype.is_floating_point:
            neutral = -math.inf if kind == "max" else math.inf
        else:
            info = torch.iinfo(work.dtype)
            neutral = info.min if kind == "max" else info.max
        partial = torch.full((), neutral, dtype=work.dtype, device=local.device)
    return _Reduction(partial, kind, _reduce_groups(op, x), dtype, keep_shape)


def _foreach_max(op, args, kwargs):
    return _foreach_reduction(op, args, kwargs, lambda t, b: _extremum_reduction(op, t, "max"))


def _max_min(kind: str, as_bool: bool = False):
    def handler(op, args, kwargs):
        b = _bind(op, args, kwargs)
        x = b["self"]
        if "dim" in b:  # amax / amin: dim=[] means all dims
            _check_full(op, x, b["dim"])
        keep = _keep_shape(x, bool(b.get("keepdim", False)))
        red = _extremum_reduction(op, x, kind, keep, as_bool=as_bool)
        return _replicate(_all_reduce_many([red])[0], x)

    return handler


def _sum_mean(mean: bool):
    def handler(op, args, kwargs):
        b = _bind(op, args, kwargs)
        x = b["self"]
        _check_full(op, x, b.get("dim"))
        local, dtype = x._local_tensor, b["dtype"]
        if dtype is not None:
            out_dtype = dtype
        elif mean or local.dtype.is_floating_point or local.dtype.is_complex:
            out_dtype = local.dtype
        else:  # torch.sum promotes bool/integer inputs to int64
            out_dtype = torch.int64
        if mean and not (out_dtype.is_floating_point or out_dtype.is_complex):
            raise RuntimeError(
                f"{op}: mean needs a floating point or complex dtype, got {out_dtype}"
            )
        acc = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
        red = _Reduction(
            local.sum(dtype=acc), "sum", _reduce_groups(op, x), out_dtype,
            _keep_shape(x, bool(b.get("keepdim", False))),
            mean_of=math.prod(x.shape) if mean else None,
        )
        return _replicate(_all_reduce_many([red])[0], x)

    return handler


def _compare(op, args, kwargs):
    """``equal`` / ``allclose``: local comparison, then a logical AND over the ragged ranks."""
    b = _bind(op, args, kwargs)
    a, o = b["self"], b["other"]
    if not (isinstance(a, DTensor) and isinstance(o, DTensor)):
        raise _unsupported(op, [getattr(a, "_spec", a), getattr(o, "_spec", o)])
    if tuple(a.shape) != tuple(o.shape):
        if op is aten.equal.default:
            return False
        raise RuntimeError(f"{op}: shapes {tuple(a.shape)} and {tuple(o.shape)} differ")
    if not _same_layout(a._spec, o._spec):
        raise _unsupported(op, [a._spec, o._spec], ": operands have different layouts")
    if op is aten.equal.default:
        ok = torch.equal(a._local_tensor, o._local_tensor)
    else:
        ok = torch.allclose(a._local_tensor, o._local_tensor, b["rtol"], b["atol"], b["equal_nan"])
    flag = torch.tensor(int(ok), device=a._local_tensor.device)
    for g in _reduce_groups(op, a):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)
    return bool(flag.item())


def _copy_across_layouts(op, args, kwargs):
    """``dst.copy_(src)`` where exactly the layouts differ (e.g. Replicate/Shard -> RaggedShard).

    Redistributes ``src`` to ``dst``'s placement (``_ragged_dtensor``'s redistribution: a local
    slice from Replicate, one all-to-all from Shard/RaggedShard), then copies locally. Returns
    ``None`` when the element-wise rule applies instead (same layout or a scalar-like ``src``).
    """
    b = _bind(op, args, kwargs)
    dst, src = b["self"], b["src"]
    if not (isinstance(dst, DTensor) and isinstance(src, DTensor)):
        return None
    if _same_layout(dst._spec, src._spec) or _is_scalar_like(src._spec):
        return None
    if tuple(dst.shape) != tuple(src.shape) or dst.device_mesh != src.device_mesh:
        return None
    moved = src.redistribute(dst.device_mesh, dst.placements)
    dst._local_tensor.copy_(moved._local_tensor, non_blocking=bool(b["non_blocking"]))
    return dst


_DIRECT_HANDLERS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.linalg_vector_norm.default: _vector_norm,
    aten._foreach_norm.Scalar: _foreach_norm,
    aten._foreach_powsum.Scalar: _foreach_powsum,
    aten._foreach_max.default: _foreach_max,
    aten.sum.default: _sum_mean(False),
    aten.sum.dim_IntList: _sum_mean(False),
    aten.mean.default: _sum_mean(True),
    aten.mean.dim: _sum_mean(True),
    aten.max.default: _max_min("max"),
    aten.min.default: _max_min("min"),
    aten.amax.default: _max_min("max"),
    aten.amin.default: _max_min("min"),
    aten.any.default: _max_min("max", as_bool=True),
    aten.all.default: _max_min("min", as_bool=True),
    aten.equal.default: _compare,
    aten.allclose.default: _compare,
}


# ---------------------------------------------------------------------------------------------
# The hook and its installation.
# ---------------------------------------------------------------------------------------------
def _make_slow_path(original: Callable[..., object]) -> Callable[..., object]:
    def _slow_path(op_call, args, kwargs, op_info, try_cache):
        # Runs only on a C++ sharding-cache miss. Non-ragged schemas: untouched torch path.
        if not _schema_has_ragged(op_info):
            return original(op_call, args, kwargs, op_info, try_cache)
        direct = _DIRECT_HANDLERS.get(op_call)
        if direct is not None:
            return direct(op_call, args, kwargs)
        if op_call is aten.copy_.default:
            out = _copy_across_layouts(op_call, args, kwargs)
            if out is not None:
                return out
        if is_elementwise_op(op_call):
            if try_cache:
                return _elementwise_sharding_cached(op_call, op_info.schema)
            return _elementwise_sharding(op_call, op_info.schema)
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            op_call.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        ):
            # Same as torch's slow path: composite ops reaching dispatch (inference mode) are
            # decomposed; their parts come back through here and are checked one by one.
            out = op_call.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        raise _unsupported(op_call, op_info.flat_args_schema)

    _slow_path._lv_ragged_ops = True  # type: ignore[attr-defined]
    return _slow_path


def _guard_handler(handler: Callable[..., object]) -> Callable[..., object]:
    """Wrap a torch-provided custom op handler so that ragged inputs fail loudly."""

    def guarded(op_call, args, kwargs):
        specs = [a._spec for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
        if any(_has_ragged(s) for s in specs):
            raise _unsupported(op_call, specs)
        return handler(op_call, args, kwargs)

    guarded._lv_ragged_ops = True  # type: ignore[attr-defined]
    return guarded


# torch's own custom handlers that would mis-handle a ragged layout (they assume Shard/Replicate).
_GUARDED_CUSTOM_OPS = (
    aten.argmin.default,
    aten.argmax.default,
    aten.convolution.default,
    aten.convolution_backward.default,
)


def install() -> None:
    """Teach DTensor's op dispatcher about ``RaggedShard`` (idempotent, process-wide).

    See design note [ragged-ops] in this module for what is patched and why.
    """
    dispatcher = DTensor._op_dispatcher
    current = getattr(dispatcher, "_propagate_op_sharding_dispatch_slow_path", None)
    if current is None:
        raise RuntimeError(
            "lightning_vescale RaggedShard ops need torch's C++ DTensor dispatch "
            "(OpDispatcher._propagate_op_sharding_dispatch_slow_path, torch >= 2.13); "
            f"torch {torch.__version__} does not have it. Upgrade torch."
        )
    if getattr(current, "_lv_ragged_ops", False):
        return
    dispatcher._propagate_op_sharding_dispatch_slow_path = _make_slow_path(current)
    handlers = dispatcher._custom_op_handlers
    for op in _GUARDED_CUSTOM_OPS:
        h = handlers.get(op)
        if h is not None and not getattr(h, "_lv_ragged_ops", False):
            handlers[op] = _guard_handler(h)


install()
