"""Norms and full reductions of ``RaggedShard`` DTensors (private; answered by ``_ops``'s hook).

Design note [ragged-reductions]
-------------------------------
A ragged rank holds a flat slice of the tensor, so a *full* reduction (``dim=None``, or every
dim) is a local partial plus one collective over the mesh dimension the tensor is ragged over
(all other mesh dims must be ``Replicate``). Results are ``Replicate`` DTensors, as torch's own
sharded reductions return after their collective.

On an N-D mesh (HSDP's ``(Replicate(), RaggedShard)``, design note [ragged-nd]) the collective
runs only in the ragged dim's group: the replicas along the other dims hold the same slices, so
their partials are identical and the result is ``Replicate`` there without any communication.
Reducing over the replicate dims too would count every element once per replica (a gradient
norm ``sqrt(replicas)`` times too large, and ``clip_grad_norm_`` clipping too hard).
Reductions over some dims are described below.

* Partials of many tensors are bucketed by (process groups, combine, dtype, device) and combined
  with one collective per bucket (:func:`_all_reduce_many`): ``_foreach_norm`` costs one
  all-reduce per *list*, so ``clip_grad_norm_(foreach=True)`` costs one all-reduce per step.
  Its hot path, same-layout items with ``ord > 0``, runs one ``_foreach_norm`` kernel on the
  local tensors (:func:`_foreach_norm_batched`); other lists take the per-item path.
* Half-precision partials are accumulated in fp32, as torch's dense kernels do internally.
* max/min (and ``inf``-norms, any/all) combine by all-gather + local amax/amin, not a MAX
  all-reduce, so NaN propagates exactly as in the dense kernel (``clip_grad_norm_`` relies on
  it). Ranks without elements contribute the neutral element.
* ``equal``/``allclose`` compare locally, then AND the flags over the ragged ranks.
* Reductions over *some* dims (``vector_norm(w, dim=1)``, ``sum``/``mean``/``amax``/``amin``
  with ``dim=``): a rank's flat range cuts rows anywhere, so each local element is sent to its
  output element by index (``index_add_`` / ``scatter_reduce_`` into a zero/neutral vector of
  the *result's* size), and one collective combines the vectors: traffic is the result's size,
  not the tensor's (:func:`_dims_reduction`). Results are ``Replicate``, like full reductions.
* The collectives run under ``record_function("vescale::ragged_reduce")`` (profiler traces).

:data:`REDUCTION_HANDLERS` maps each supported op to its handler; ``_ops``'s slow path
calls it with the op's unwrapped ``(op, args, kwargs)`` and returns its result as is.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.profiler import record_function

from lightning_vescale.mesh import all_reduce_anywhere
from lightning_vescale.placement._common import (
    all_gather_flat,
    aten,
    bind_args,
    has_ragged,
    same_layout,
    unsupported,
)
from lightning_vescale.placement._ragged_shard import RaggedShard, ragged_mesh_dim

__all__ = ["REDUCTION_HANDLERS"]


# ---------------------------------------------------------------------------------------------
# Local partials and their combination across ranks.
# ---------------------------------------------------------------------------------------------
def _reduce_groups(op: object, x: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """Process groups of the mesh dims ``x`` is ragged (or, beside a RaggedShard, ``Shard``)
    over; all others must be Replicate. A full reduction of ``(RaggedShard, Shard(k))``
    (design note [ragged-tp]) combines over both dims: every element lives on one rank of
    the two (the ``dim=`` form refuses such layouts earlier, in ``ragged_mesh_dim``)."""
    groups = []
    for d, p in enumerate(x._spec.placements):
        if type(p) is RaggedShard or type(p) is Shard:
            groups.append(x.device_mesh.get_group(d))
        elif not p.is_replicate():
            raise unsupported(
                op, [x._spec], f": a reduction over RaggedShard mixed with {p} is not defined"
            )
    return tuple(groups)


def _check_full(op: object, x: DTensor, dim: Any) -> None:
    if _partial_dims(x, dim) is not None:
        raise unsupported(
            op, [x._spec], f" with dim={dim}: only full reductions (dim=None) are supported"
        )


def _partial_dims(x: DTensor, dim: Any) -> list[int] | None:
    """The sorted reduced dims when ``dim`` reduces some but not all dims, else ``None``."""
    if dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    ndim = x.ndim
    reduced = sorted({d % max(ndim, 1) for d in dims})
    if not dims or reduced == list(range(ndim)):
        return None
    return reduced


def _dims_reduction(op: object, x: DTensor, dims: list[int], keepdim: bool, *,
                    kind: Literal["sum", "max", "min"], values: torch.Tensor,
                    out_dtype: torch.dtype, root: float | None = None,
                    mean: bool = False) -> _Reduction:
    """A reduction of ``x`` over ``dims`` (not all): ``values`` (this rank's local elements,
    already mapped, e.g. ``|x|^p``) reduced into the result's elements by index."""
    try:
        mesh_dim = ragged_mesh_dim(x._spec.placements, f"{op} with dim=")
    except NotImplementedError as e:
        raise unsupported(op, [x._spec], f" with dim=: {e}") from None
    placement = x._spec.placements[mesh_dim]
    shape = tuple(x.shape)
    kept = [d for d in range(len(shape)) if d not in dims]
    out_numel = math.prod(shape[d] for d in kept)
    full_stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out_stride = [math.prod(shape[k] for k in kept[i + 1:]) for i in range(len(kept))]
    start, end = placement.local_range(shape, x.device_mesh.get_local_rank(mesh_dim))
    device = values.device
    flat = torch.arange(start, end, device=device)
    index = torch.zeros_like(flat)
    for i, d in enumerate(kept):
        index += (flat // full_stride[d]) % shape[d] * out_stride[i]
    if kind == "sum":
        partial = torch.zeros(out_numel, dtype=values.dtype, device=device)
        partial.index_add_(0, index, values.reshape(-1))
    else:
        if values.dtype.is_floating_point:
            neutral = -math.inf if kind == "max" else math.inf
        else:
            info = torch.iinfo(values.dtype)
            neutral = info.min if kind == "max" else info.max
        partial = torch.full((out_numel,), neutral, dtype=values.dtype, device=device)
        partial.scatter_reduce_(0, index, values.reshape(-1), "amax" if kind == "max" else "amin")
    out_shape = tuple(1 if d in dims else shape[d] for d in range(len(shape))) if keepdim \
        else tuple(shape[d] for d in kept)
    return _Reduction(partial=partial, combine=kind, groups=_reduce_groups(op, x),
                      out_dtype=out_dtype, out_shape=out_shape, root=root,
                      mean_of=math.prod(shape[d] for d in dims) if mean else None)


_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Reduction:
    """One tensor's local partial (or a vector of them) and how to combine it across ranks.

    Attributes:
        partial: this rank's partial result (0-d, or 1-d for a batched ``_foreach_norm``).
        combine: ``"sum"`` (all-reduce SUM), ``"max"`` or ``"min"`` (all-gather + amax/amin).
        groups: the process groups to combine over (the mesh dims the tensor is ragged over).
        out_dtype, out_shape: dtype and shape of the final result.
        root: ``1/p`` for p-norms (applied after the sum), else ``None``.
        mean_of: the global element count to divide by (``mean``), else ``None``.
    """

    partial: torch.Tensor
    combine: Literal["sum", "max", "min"]
    groups: tuple[dist.ProcessGroup, ...]
    out_dtype: torch.dtype
    out_shape: tuple[int, ...]
    root: float | None = None
    mean_of: int | None = None


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
        raise unsupported(op, [x._spec], f" with ord={ord}")
    if p == math.inf or p == -math.inf:
        if local.numel() == 0:  # neutral element of max(|x|) is 0, of min(|x|) is +inf
            partial = torch.full((), 0.0 if p > 0 else math.inf, dtype=acc, device=local.device)
        else:
            partial = torch.linalg.vector_norm(local, p, dtype=acc)
        return _Reduction(partial=partial, combine="max" if p > 0 else "min", groups=groups,
                          out_dtype=out_dtype, out_shape=keep_shape)
    if p == 0 or p == 1:  # count of non-zeros / sum of |x|: no root
        partial = torch.linalg.vector_norm(local, p, dtype=acc)
        return _Reduction(partial=partial, combine="sum", groups=groups, out_dtype=out_dtype,
                          out_shape=keep_shape)
    if p > 0:
        partial = torch.linalg.vector_norm(local, p, dtype=acc).pow(p)
    else:
        partial = local.abs().to(acc).pow(p).sum()
    return _Reduction(partial=partial, combine="sum", groups=groups, out_dtype=out_dtype,
                      out_shape=keep_shape, root=None if power_sum else 1.0 / p)


def _all_reduce_many(reductions: Sequence[_Reduction]) -> list[torch.Tensor]:
    """Combine many partials with one collective per (groups, combine, dtype) bucket."""
    buckets: dict[tuple, list[int]] = {}
    for i, r in enumerate(reductions):
        key = (tuple(id(g) for g in r.groups), r.combine, r.partial.dtype, r.partial.device)
        buckets.setdefault(key, []).append(i)
    totals: list[torch.Tensor | None] = [None] * len(reductions)
    for members in buckets.values():
        first = reductions[members[0]]
        flat = torch.cat([reductions[i].partial.reshape(-1) for i in members])
        for g in first.groups:
            flat = _combine_across(flat, first.combine, g)
        offset = 0
        for i in members:
            n = reductions[i].partial.numel()
            totals[i] = flat[offset:offset + n]
            offset += n
    out = []
    for r, t in zip(reductions, totals):
        assert t is not None
        if r.root is not None:
            t = t.pow(r.root)
        if r.mean_of is not None:
            t = t / r.mean_of
        out.append(t.to(r.out_dtype).reshape(r.out_shape))
    return out


def _combine_across(flat: torch.Tensor, combine: str, group: dist.ProcessGroup) -> torch.Tensor:
    """The element-wise ``combine`` (sum/max/min) of ``flat`` over the ranks of ``group``."""
    world = dist.get_world_size(group)
    if world == 1:
        return flat
    with record_function("vescale::ragged_reduce"):
        if combine == "sum":
            buf = torch.view_as_real(flat) if flat.is_complex() else flat
            # a CPU-offloaded shard's partial sum on NCCL goes through the device and back
            all_reduce_anywhere(buf, op=dist.ReduceOp.SUM, group=group)
            return flat
        # max/min via all-gather + local amax/amin: unlike a MAX all-reduce, this propagates
        # NaN exactly like the dense kernel (clip_grad_norm_ relies on it).
        gathered = flat.new_empty(world * flat.numel())
        all_gather_flat(gathered, flat.reshape(-1), group=group)
        gathered = gathered.view(world, -1)
        return gathered.amax(0) if combine == "max" else gathered.amin(0)


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


def _reduce_one(reduction: _Reduction, like: DTensor) -> DTensor:
    """Combine one tensor's partial across ranks: the Replicate DTensor result."""
    return _replicate(_all_reduce_many([reduction])[0], like)


# ---------------------------------------------------------------------------------------------
# Handlers: (op, args, kwargs) -> the op's result, for REDUCTION_HANDLERS.
# ---------------------------------------------------------------------------------------------
def _vector_norm(op, args, kwargs):
    bound = bind_args(op, args, kwargs)
    x = bound["self"]
    dims = _partial_dims(x, bound["dim"])
    if dims is not None:
        return _reduce_one(_norm_dims_reduction(op, x, dims, bool(bound["keepdim"]),
                                                float(bound["ord"]), bound["dtype"]), x)
    reduction = _norm_reduction(
        op, x, bound["ord"], bound["dtype"], keep_shape=_keep_shape(x, bound["keepdim"])
    )
    return _reduce_one(reduction, x)


def _norm_dims_reduction(op, x: DTensor, dims: list[int], keepdim: bool, p: float,
                         dtype) -> _Reduction:
    local = x._local_tensor
    out_dtype = dtype if dtype is not None else local.dtype
    if not out_dtype.is_floating_point or local.is_complex():
        raise unsupported(op, [x._spec], f" with dim= and dtype {out_dtype}")
    acc = torch.float32 if out_dtype in _LOW_PRECISION else out_dtype
    mag = local.detach().abs().to(acc)
    if math.isinf(p):
        return _dims_reduction(op, x, dims, keepdim, kind="max" if p > 0 else "min",
                               values=mag, out_dtype=out_dtype)
    if p == 0:
        return _dims_reduction(op, x, dims, keepdim, kind="sum", values=mag.ne(0).to(acc),
                               out_dtype=out_dtype)
    if p == 1:
        return _dims_reduction(op, x, dims, keepdim, kind="sum", values=mag,
                               out_dtype=out_dtype)
    return _dims_reduction(op, x, dims, keepdim, kind="sum", values=mag.pow(p),
                           out_dtype=out_dtype, root=1.0 / p)


def _foreach_reduction(op, args, kwargs, make):
    """Reduce each list item; ragged items share collectives, others take DTensor's path."""
    bound = bind_args(op, args, kwargs)
    tensors = bound["self"]
    reductions, where, out = [], [], [None] * len(tensors)
    for i, t in enumerate(tensors):
        if isinstance(t, DTensor) and has_ragged(t._spec):
            reductions.append(make(t, bound))
            where.append(i)
        else:
            out[i] = _dense_fallback(op, t, bound)
    for i, total in zip(where, _all_reduce_many(reductions)):
        out[i] = _replicate(total, tensors[i])
    return out


def _dense_fallback(op, t, bound):
    # A non-ragged item of a list that also holds ragged ones: DTensor's own path for it.
    rest = {k: v for k, v in bound.items() if k != "self"}
    return op([t], **rest)[0]


def _foreach_norm(op, args, kwargs):
    fast = _foreach_norm_batched(op, args, kwargs)
    if fast is not None:
        return fast
    return _foreach_reduction(
        op, args, kwargs, lambda t, bound: _norm_reduction(op, t, bound["ord"], bound["dtype"])
    )


def _foreach_norm_batched(op, args, kwargs):
    """``_foreach_norm`` over same-layout-family ragged items with ord in (0, inf]: one
    ``_foreach_norm`` kernel on the local tensors, one collective, one shared output spec.

    This is the path ``clip_grad_norm_(foreach=True)`` takes every step, so per-item Python is
    kept out of it. Returns ``None`` when the general per-item path must be used instead.
    """
    bound = bind_args(op, args, kwargs)
    tensors, p, dtype = bound["self"], float(bound["ord"]), bound["dtype"]
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
    if not has_ragged(first._spec) or local_dtype.is_complex:
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
        combine, root = "max", None
    else:
        partial = torch.stack(torch._foreach_norm(locals_, p, dtype=acc))
        if p != 1:
            partial = partial.pow(p)
        combine, root = "sum", (None if p == 1 else 1.0 / p)
    reduction = _Reduction(partial=partial, combine=combine, groups=groups, out_dtype=out_dtype,
                           out_shape=(len(locals_),), root=root)
    total = _all_reduce_many([reduction])[0]
    spec = DTensorSpec(
        mesh, (Replicate(),) * mesh.ndim, tensor_meta=TensorMeta((), (), out_dtype)
    )
    return [DTensor(v, spec, requires_grad=False) for v in total.unbind(0)]


def _foreach_powsum(op, args, kwargs):
    return _foreach_reduction(
        op, args, kwargs,
        lambda t, bound: _norm_reduction(op, t, bound["ord"], bound["dtype"], power_sum=True),
    )


def _extremum_reduction(op, x: DTensor, combine: str, keep_shape=(), as_bool=False) -> _Reduction:
    """max/min (and any/all, which are max/min over ``bool``) of one tensor."""
    local = x._local_tensor
    if math.prod(x.shape) == 0 and not as_bool:  # any/all of nothing: False/True, as torch
        raise RuntimeError(f"{op}: the reduction of an empty tensor has no identity")
    dtype = torch.bool if as_bool else local.dtype
    work = local.ne(0) if as_bool and local.dtype != torch.bool else local
    if work.dtype == torch.bool:  # collectives do not reduce bool: 0/1 in int32
        work = work.to(torch.int32)
    if work.numel():
        partial = work.amax() if combine == "max" else work.amin()
    else:  # a rank without elements contributes the neutral element
        if dtype == torch.bool:
            neutral = 0 if combine == "max" else 1
        elif work.dtype.is_floating_point:
            neutral = -math.inf if combine == "max" else math.inf
        else:
            info = torch.iinfo(work.dtype)
            neutral = info.min if combine == "max" else info.max
        partial = torch.full((), neutral, dtype=work.dtype, device=local.device)
    return _Reduction(partial=partial, combine=combine, groups=_reduce_groups(op, x),
                      out_dtype=dtype, out_shape=keep_shape)


def _foreach_max(op, args, kwargs):
    return _foreach_reduction(
        op, args, kwargs, lambda t, bound: _extremum_reduction(op, t, "max")
    )


def _max_min(combine: str, as_bool: bool = False):
    def handler(op, args, kwargs):
        bound = bind_args(op, args, kwargs)
        x = bound["self"]
        dims = _partial_dims(x, bound["dim"]) if "dim" in bound else None
        if dims is not None and not as_bool:  # amax / amin over some dims
            local = x._local_tensor.detach()
            if math.prod(x.shape) == 0:
                raise RuntimeError(f"{op}: the reduction of an empty tensor has no identity")
            return _reduce_one(_dims_reduction(
                op, x, dims, bool(bound.get("keepdim", False)), kind=combine, values=local,
                out_dtype=local.dtype), x)
        if "dim" in bound:  # amax / amin: dim=[] means all dims
            _check_full(op, x, bound["dim"])
        keep = _keep_shape(x, bool(bound.get("keepdim", False)))
        reduction = _extremum_reduction(op, x, combine, keep, as_bool=as_bool)
        return _reduce_one(reduction, x)

    return handler


def _sum_mean(mean: bool):
    def handler(op, args, kwargs):
        bound = bind_args(op, args, kwargs)
        x = bound["self"]
        dims = _partial_dims(x, bound.get("dim"))
        local, dtype = x._local_tensor, bound["dtype"]
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
        if dims is not None:  # over some dims
            return _reduce_one(_dims_reduction(
                op, x, dims, bool(bound.get("keepdim", False)), kind="sum",
                values=local.detach().to(acc), out_dtype=out_dtype, mean=mean), x)
        reduction = _Reduction(
            partial=local.sum(dtype=acc), combine="sum", groups=_reduce_groups(op, x),
            out_dtype=out_dtype, out_shape=_keep_shape(x, bool(bound.get("keepdim", False))),
            mean_of=math.prod(x.shape) if mean else None,
        )
        return _reduce_one(reduction, x)

    return handler


def _compare(op, args, kwargs):
    """``equal`` / ``allclose``: local comparison, then a logical AND over the ragged ranks."""
    bound = bind_args(op, args, kwargs)
    a, o = bound["self"], bound["other"]
    if not (isinstance(a, DTensor) and isinstance(o, DTensor)):
        raise unsupported(op, [getattr(a, "_spec", a), getattr(o, "_spec", o)])
    if tuple(a.shape) != tuple(o.shape):
        if op is aten.equal.default:
            return False
        raise RuntimeError(f"{op}: shapes {tuple(a.shape)} and {tuple(o.shape)} differ")
    if not same_layout(a._spec, o._spec):
        raise unsupported(op, [a._spec, o._spec], ": operands have different layouts")
    if op is aten.equal.default:
        ok = torch.equal(a._local_tensor, o._local_tensor)
    else:
        ok = torch.allclose(
            a._local_tensor, o._local_tensor, bound["rtol"], bound["atol"], bound["equal_nan"]
        )
    flag = torch.tensor(int(ok), device=a._local_tensor.device)
    groups = _reduce_groups(op, a)
    with record_function("vescale::ragged_reduce"):
        for g in groups:  # offloaded (CPU) operands on NCCL: via the mesh's device
            all_reduce_anywhere(flag, op=dist.ReduceOp.MIN, group=g, mesh=a.device_mesh)
    return bool(flag.item())


#: Norms, full reductions and comparisons of ragged DTensors; ``_ops``'s slow path answers
#: these ops with the handler's result (never cached: each call needs its collective).
REDUCTION_HANDLERS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
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
