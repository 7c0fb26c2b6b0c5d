"""The exactness probe of flat runs: at which item alignment a flat form is bitwise exact.

Joining tensors into one flat run is exact only if a kernel computes every element the same
wherever it sits in a tensor. CPU kernels run a vector body and a scalar tail per tensor, which
differ for some ops (design note [flat-step] in ``_flat_step``; [flat-params] in
``lightning_vescale.optim._flat_params``). So the first use of each form runs a *probe*:
synthetic ragged items stepped per item and flat, compared bit for bit, at alignment 1 (any
run), then (where allowed) 16 and 64 (runs break after any item whose length is not a multiple);
``0`` (:data:`~._flat_runs._SINGLETON`): no alignment is exact, one item per run.

This module owns both probes and their one cache:

* :func:`op_alignment`: one list op (``_foreach_*`` / fused optimizer kernel) with the call's
  scalars, for the flat step's DTensor handler;
* :func:`optimizer_alignment`: three steps of a whole ``torch.optim`` class with a group's
  options, for ``FlatParamOptimizer`` (layer 4 imports it from here).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_vescale.placement._flat_ops import _call, _OpInfo
from lightning_vescale.placement._flat_runs import _SINGLETON, _count

__all__ = ["is_elementwise_state", "op_alignment", "optimizer_alignment"]

_PROBE_SIZES = (1, 2, 3, 5, 8, 13, 16, 17, 31, 33, 64, 65, 100, 129, 255, 300)
_PROBE_MULTIPLES = (1, 2, 3, 5, 8, 1, 4)
_PROBE_ALIGNMENTS = (1, 16, 64)
#: group keys that are not optimizer options (the probe's key and constructor ignore them)
_GROUP_KEYS_NOT_OPTIONS = ("params", "param_names", "initial_lr")
#: (op or optimizer class, what else decides the kernel branch) -> the exact alignment
_probe_cache: dict[tuple, int] = {}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _cached_alignment(key: tuple, alignments: tuple[int, ...],
                      exact_at: Callable[[int], bool]) -> tuple[int, bool]:
    """The first of ``alignments`` at which ``exact_at`` holds (``_SINGLETON``: none), cached
    by ``key``; and whether the probe ran now."""
    found = _probe_cache.get(key)
    if found is not None:
        return found, False
    found = _SINGLETON
    for align in alignments:
        if exact_at(align):
            found = align
            break
    _probe_cache[key] = found
    return found, True


def _int_view(t: Tensor) -> Tensor:
    """``t``'s bits as integers of its element size (for bitwise comparisons)."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _bits(t: Tensor) -> Tensor:
    return _int_view(t) if t.dtype.is_floating_point else t


def _magnitudes(n: int, gen: torch.Generator) -> Tensor:
    """``n`` float64 values in [0.05, 2): many rounding cases, no zeros."""
    return torch.rand(n, generator=gen, dtype=torch.float64) * 1.95 + 0.05


def is_elementwise_state(v: Any, numel: int) -> bool:
    """An optimizer state with one element per parameter element (``exp_avg``...)."""
    return isinstance(v, Tensor) and v.dim() == 1 and v.numel() == numel


# ---------------------------------------------------------------------------------------------
# One list op (the flat step's handler).
# ---------------------------------------------------------------------------------------------
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


def _probe_values(n: int, dtype: torch.dtype, device: torch.device,
                  gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return _magnitudes(n, gen).to(device=device, dtype=dtype)
    if dtype == torch.bool:
        return (torch.rand(n, generator=gen) < 0.5).to(device)
    return torch.randint(1, 5, (n,), generator=gen).to(device=device, dtype=dtype)


def _probe_op(op, info: _OpInfo, values: list, list_dtypes: dict[int, torch.dtype],
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


def op_alignment(op, info: _OpInfo, values: list, list_dtypes: dict[int, torch.dtype],
                 device: torch.device) -> int:
    """The item alignment at which the flat ``op`` is bitwise exact (``_SINGLETON``: none).

    Cached per (op, list dtypes, device type, kinds of the scalars); fused kernels try 1, 16
    and 64, other ops 1 only.
    """
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
    found, probed = _cached_alignment(
        key, _PROBE_ALIGNMENTS if info.fused else (1,),
        lambda align: _probe_op(op, info, values, list_dtypes, device, align))
    if probed:
        _count("probe")
    return found


# ---------------------------------------------------------------------------------------------
# A whole torch.optim class (FlatParamOptimizer).
# ---------------------------------------------------------------------------------------------
def _option_key(group: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in group.items()
                        if k not in _GROUP_KEYS_NOT_OPTIONS))


def _probe_optimizer(cls: type[torch.optim.Optimizer], options: dict[str, Any],
                     dtype: torch.dtype, device: torch.device, align: int) -> bool:
    """Three steps of ``cls`` on ragged items, per item and as flat runs of ``align``: do the
    parameters and every element-wise state agree bit for bit?"""
    gen = torch.Generator().manual_seed(1234)
    sizes = _PROBE_SIZES
    total = sum(sizes)

    def values(scale: float) -> Tensor:  # mixed signs and magnitudes: many rounding cases
        x = _magnitudes(total, gen) * scale
        sign = torch.where(torch.rand(total, generator=gen) < 0.5, -1.0, 1.0)
        return (x * sign).to(device=device, dtype=dtype)

    p0 = values(1.0)
    grads = [values(0.1) for _ in range(3)]
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    bounds = [0] + [i + 1 for i, n in enumerate(sizes) if align > 1 and n % align]
    if bounds[-1] != len(sizes):
        bounds.append(len(sizes))
    runs = list(zip(bounds, bounds[1:]))
    per_item_flat, flat_flat = p0.clone(), p0.clone()
    per_item = [per_item_flat[offs[i]:offs[i + 1]] for i in range(len(sizes))]
    flat = [flat_flat[offs[a]:offs[b]] for a, b in runs]
    accepted = inspect.signature(cls.__init__).parameters
    opts = {k: v for k, v in options.items()
            if k not in _GROUP_KEYS_NOT_OPTIONS and k in accepted}
    o1, o2 = cls(per_item, **opts), cls(flat, **opts)
    for g in grads:
        g1, g2 = g.clone(), g.clone()  # some steps edit gradients in place (SGD nesterov)
        for i, t in enumerate(per_item):
            t.grad = g1[offs[i]:offs[i + 1]]
        for (a, b), t in zip(runs, flat):
            t.grad = g2[offs[a]:offs[b]]
        o1.step()
        o2.step()
    if not torch.equal(_int_view(per_item_flat), _int_view(flat_flat)):
        return False
    for (a, b), t in zip(runs, flat):
        for k, v in o2.state[t].items():
            if is_elementwise_state(v, t.numel()):
                ref = torch.cat([o1.state[per_item[i]][k] for i in range(a, b)])
                if not torch.equal(_int_view(ref), _int_view(v)):
                    return False
    return True


def optimizer_alignment(cls: type[torch.optim.Optimizer], options: dict[str, Any],
                        dtype: torch.dtype, device: torch.device) -> int:
    """The run alignment at which ``cls(**options)`` on flat runs is bitwise its per-tensor step.

    ``1``: any run; ``16``/``64``: runs break after every parameter whose length is not a
    multiple; ``0``: none (one parameter per segment). Cached per (class, options, dtype,
    device type); the probe runs a few small steps on ``device``.
    """
    def exact_at(align: int) -> bool:
        with torch.no_grad():
            return _probe_optimizer(cls, options, dtype, device, align)

    return _cached_alignment((cls, _option_key(options), dtype, device.type),
                             _PROBE_ALIGNMENTS, exact_at)[0]
