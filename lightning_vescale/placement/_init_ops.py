"""Factories and dim-0 slices of ``RaggedShard`` DTensors (private; answered by ``_ops``'s hook).

Design note [ragged-init]
-------------------------
Model initialisation code written for FSDP2 runs on the *sharded* parameters after
``to_empty()`` (torchtitan's ``init_weights()``, a ``reset_parameters()`` called by hand). Besides
the in-place random fills (design note [ragged-random]) and element-wise ``zero_``/``fill_``/
``mul_``/``clamp_`` (design note [ragged-ops]), such code uses two more families, answered here
with DTensor's own semantics for a sharded input:

* ``new_empty``/``new_zeros``/``new_ones``/``new_full``/``new_empty_strided``: with the input's
  global shape (and a contiguous stride) the result keeps the input's placements (the same
  ragged range on every rank, as DTensor's ``new_factory_strategy`` keeps a sharded input's
  placement); with any other shape the result is ``Replicate`` on every mesh dim and each rank
  holds the full tensor. torchtitan's fused-QKV init relies on the latter:
  ``q = t.new_empty(n_heads * head_dim, dim)`` is a Replicate DTensor, ``trunc_normal_(q)``
  draws it whole on every rank, ``torch.cat`` keeps it Replicate, and ``t.copy_(fused)`` keeps
  each rank's range (``copy_`` across layouts in ``_ops``).
* ``aten.slice.Tensor`` on dim 0 with step 1 (``w[a:b]``, ``w.narrow(0, a, n)``): the rows
  ``[a, b)`` of a row-major tensor are one flat range, so each rank's part of the slice is one
  contiguous piece of its flat local tensor, and the result is a *view* (its local tensor
  aliases the parameter's): ``w[:k].copy_(x)``, ``nn.init.normal_(w[:k])`` or ``w[:k].zero_()``
  write into ``w``. Its placement is a ``RaggedShard`` with the same ``dims`` whose units are one
  row of the leading ``dims`` each (the slice's ranges are multiples of that row, since the
  parameter's ranges and the slice's bounds both are), reduced by their common divisor; with
  ``dims=()`` (one-hot) the placement is unchanged. Other slices (another dim, a step) are not
  one flat range per rank and raise the named-op error. (For comparison, torch 2.13's DTensor
  answers a slice of a ``Shard(0)`` tensor on its sharded dim with a gathered *copy*, so a write
  into it is silently lost; a slice on another dim is a local view.)

The factories take tensor-parallel layouts too (``(RaggedShard, Shard(k))``, design note
[ragged-tp]): the same shape keeps the placements (each rank's local tensor has its local
size), another shape is ``Replicate`` on every mesh dim; the slices refuse them (a dim-0 slice
of a TP-local box is not a range of the global rows). No collective runs in either family. A
result built here is returned to DTensor's dispatcher as the op's final value (nothing cached):
these ops run at initialisation, not per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from lightning_vescale.placement._common import aten, bind_args, has_ragged, unsupported
from lightning_vescale.placement._ragged_shard import (
    RaggedShard,
    ragged_mesh_dim,
    ragged_ranges,
)
from lightning_vescale.placement._ragged_tp import is_tp_layout

__all__ = ["INIT_HANDLERS"]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _wrap(local: torch.Tensor, x: DTensor, placements: tuple, shape: tuple[int, ...]) -> DTensor:
    """A DTensor over ``local`` (no copy, no autograd history) on ``x``'s mesh."""
    meta = TensorMeta(torch.Size(shape), _contiguous_stride(shape), local.dtype)
    return DTensor(local, DTensorSpec(x.device_mesh, placements, tensor_meta=meta),
                   requires_grad=False)


def _ragged_input(op: Any, args: tuple, *, tp: bool = False) -> DTensor:
    """The ragged DTensor ``self``: a layout of design note [ragged-nd], or with ``tp`` also a
    tensor-parallel one ([ragged-tp]: the factories keep or replace placements whole)."""
    x = args[0] if args else None
    if not (isinstance(x, DTensor) and has_ragged(x._spec)):
        raise unsupported(op, [getattr(x, "_spec", x)])
    if tp and is_tp_layout(x.placements, x.placements):
        return x
    try:
        ragged_mesh_dim(x.placements, str(op))
    except NotImplementedError as e:
        raise unsupported(op, [x._spec], f": {e}") from None
    return x


def _new_factory(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``x.new_empty(size)`` and friends (see design note [ragged-init])."""
    x = _ragged_input(op, args, tp=True)
    bound = bind_args(op, args, kwargs)
    shape = tuple(int(s) for s in bound["size"])
    stride = bound.get("stride")
    same = shape == tuple(x.shape) and (
        stride is None or tuple(int(s) for s in stride) == _contiguous_stride(shape))
    local = x._local_tensor
    rest = list(args[2:])
    if same:  # the input's layout: this rank's flat range, as a flat local tensor
        n = local.numel()
        sized = [[n], [1]] if op is aten.new_empty_strided.default else [[n]]
        out = op(local, *sized, *rest[len(sized) - 1:], **kwargs)
        return _wrap(out, x, tuple(x.placements), shape)
    out = op(local, *args[1:], **kwargs)  # the full tensor, on every rank
    if out.is_contiguous():
        return _wrap(out, x, (Replicate(),) * x.device_mesh.ndim, shape)
    return DTensor.from_local(out, x.device_mesh, [Replicate()] * x.device_mesh.ndim,
                              run_check=False, shape=out.shape, stride=out.stride())


def _slice_placement(p: RaggedShard, shape: tuple[int, ...], lo: int, hi: int,
                     pieces: list[tuple[int, int]]) -> RaggedShard:
    """The ``RaggedShard`` of rows ``[lo, hi)`` of dim 0 whose per-rank flat ranges are
    ``pieces`` (relative to the slice's start)."""
    if not p.dims:  # one-hot: the owner keeps the whole slice
        return p
    row = math.prod(shape[len(p.dims):])  # one row of the leading dims
    counts = [(e - s) // row for s, e in pieces]
    total = (hi - lo) * math.prod(shape[1:len(p.dims)])
    if total == 0:  # an empty slice: every range is empty; rank 0 "owns" it
        return RaggedShard(p.dims, (1,) + (0,) * (len(counts) - 1))
    g = math.gcd(total, *counts)
    return RaggedShard(p.dims, tuple(c // g for c in counts))


def _slice(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``x[a:b]`` on dim 0 with step 1: a view of this rank's part of rows ``[a, b)``."""
    x = _ragged_input(op, args)
    b = bind_args(op, args, kwargs)
    shape, ndim = tuple(x.shape), x.dim()
    dim = b["dim"] + ndim if b["dim"] < 0 else b["dim"]
    contiguous = tuple(x.stride()) == _contiguous_stride(shape)
    if ndim == 0 or dim != 0 or b["step"] != 1 or not contiguous:
        raise unsupported(
            op, [x._spec], ": only slices of dim 0 with step 1 of a contiguous tensor (rows "
            "[a, b): one flat range per rank) are views of a RaggedShard DTensor; got "
            f"dim={b['dim']}, step={b['step']}")
    lo, hi, _ = slice(b["start"], b["end"]).indices(shape[0])
    hi = max(hi, lo)
    inner = math.prod(shape[1:])
    s_lo, s_hi = lo * inner, hi * inner  # the slice's flat range in x
    mesh_dim = ragged_mesh_dim(x.placements, str(op))
    placement = x.placements[mesh_dim]
    ranges = ragged_ranges(shape, placement)

    def clip(v: int) -> int:
        return min(max(v, s_lo), s_hi)

    pieces = [(clip(s) - s_lo, clip(e) - s_lo) for s, e in ranges]  # relative to the slice
    r = x.device_mesh.get_local_rank(mesh_dim)
    a, e = (clip(v) - ranges[r].start for v in ranges[r])  # relative to this rank's range
    local = x._local_tensor[a:e] if e > a else x._local_tensor[0:0]
    new_shape = (hi - lo,) + shape[1:]
    placements = list(x.placements)
    placements[mesh_dim] = _slice_placement(placement, shape, lo, hi, pieces)
    return _wrap(local, x, tuple(placements), new_shape)


#: Factories and slices of ragged DTensors (design note [ragged-init]); ``_ops``'s slow path
#: answers these with the handler's result.
INIT_HANDLERS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.new_empty.default: _new_factory,
    aten.new_zeros.default: _new_factory,
    aten.new_ones.default: _new_factory,
    aten.new_full.default: _new_factory,
    aten.new_empty_strided.default: _new_factory,
    aten.slice.Tensor: _slice,
}
