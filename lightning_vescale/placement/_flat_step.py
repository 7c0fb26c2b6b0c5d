"""The flat optimizer step: list ops on ``RaggedShard`` DTensors run on whole flat runs.

Design note [flat-step]
-----------------------
``torch.optim.AdamW/Adam/SGD(foreach=True)`` issue about ten ``_foreach_*`` ops per step, each
over a list with one item per parameter (``fused=True`` issues one ``_fused_*_`` op over several
such lists). On DTensors each item costs a DTensor wrap/unwrap and, on CPU, one kernel per item:
~57 ms for 290 small tensors at world 2, against 2-5 ms for the same element-wise work on one
flat tensor. After ``fully_shard`` the local tensors of a group's parameters (and gradients)
are 1-D views that *tile* one DBuffer shard, so the per-item work can run on the shard.

:func:`flat_list_op` is DTensor's custom handler of every element-wise ``_foreach_*`` overload
and of ``_fused_adam(w)_`` / ``_fused_sgd_`` / ``_fused_adagrad_``, registered at the process's
first RaggedShard op (:func:`activate`, called by ``_ops``'s hook), so a process without
RaggedShard DTensors never routes list ops through Python. For a call whose tensor lists are RaggedShard DTensors
of matching layouts it

1. takes each list's local tensors and cuts the item sequence into *runs*: maximal sequences of
   consecutive items that are adjacent in memory (item ``i+1`` starts where item ``i`` ends, in
   one storage) in *every* list, with equal per-item scalars (``ScalarList`` values, per-item
   0-d tensors such as fused ``state_steps``: read on the host only on CPU, elsewhere told
   apart by identity, so a CUDA step never waits for a host read). Gaps never join a run, so
   padding between parameters (planner alignment, parameters without gradients, another param
   group's parameters) is never read or written. The run structure is cached by the lists'
   pointers;
2. calls the *same* op once, on plain 1-D views spanning each run (one list item per run), and
   for out-of-place ops returns per-item DTensor views of each run's result (same placement;
   the items of one run share that result's storage);
3. for lists that are not flat yet (optimizer states: ``zeros_like`` gives each parameter its
   own storage) first *compacts* them: when every item is the sole owner of its storage, the
   items are copied into one buffer in list order and each local tensor is re-pointed into it
   (``Tensor.set_``; the DTensor objects, hence ``optimizer.state``, are unchanged). This
   happens once (first step, or after ``load_state_dict``); the state buffers then follow the
   parameters' runs on every later step. Transient memory: one state list, at the first step.

**Exactness.** Results are bitwise equal to the per-tensor step only if the op computes every
element the same way wherever it sits in a tensor. CPU kernels run a vector body and a scalar
tail per tensor; for most ops both compute the same bits, for some they do not (measured on
torch 2.13 AVX512: ``add/sub(alpha != 1)`` on bf16/fp16, ``_fused_adamw_``/``_fused_sgd_``).
So the first call of each (op, dtypes, device, scalar kind) runs a *probe*: the op on synthetic
items with ragged tails, per item and flat, compared bit for bit. If the flat form differs,
fused ops retry with items aligned to 16 then 64 elements (runs then also break after any item
whose length is not a multiple), other ops keep one item per run (the exact per-tensor kernels,
still without per-item DTensor overhead).

**Falls back to DTensor's normal path** (unchanged semantics and errors) when any tensor list
holds a non-ragged item, when layouts (placements, global shapes, meshes) differ between
lists, under ``torch.compile`` tracing or fake/meta tensors, when autograd would record the op
(grad mode on and an input requires grad), for complex dtypes, and when the feature is off
(:func:`~lightning_vescale.placement.flat_step_enabled`). The fallback removes this handler
for the one call and re-dispatches, so ordinary DTensors (FSDP2's ``Shard``) pay only the
handler's entry (measured in ``benchmarks/RESULTS_fsdp.md``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from lightning_vescale.placement._flat_ops import (
    FLAT_STEP_FUSED,
    _call,
    _bind,
    _op_info,
    _OpInfo,
    flat_step_ops,
)
from lightning_vescale.placement._flat_probe import op_alignment
from lightning_vescale.placement._flat_runs import (
    CPU_OUTPUT_CAP_BYTES,
    _cache_put,
    _compact,
    _count,
    _data_ptr,
    _Layout,
    _layouts,
    _make_runs,
    _numel,
    _Runs,
    _runs_cache,
    _span_view,
    _split_by_values,
    _Tensor,
    _uniform,
    _breaks_of,
    compact_,
    contiguous_runs,
    flat_step_stats,
    run_view,
)
from lightning_vescale.placement._ragged_shard import RaggedShard

__all__ = ["FLAT_STEP_FUSED", "activate", "compact_", "contiguous_runs", "flat_list_op",
           "flat_step_ops", "flat_step_stats", "is_enabled", "run_view", "set_enabled"]

# ``DTensor(local, spec, requires_grad=...)`` is ``_dtensor__new__`` (C++, sets ``_spec`` and
# ``_local_tensor``) plus an ``__init__`` that does nothing but costs ~2 us behind a dynamo
# wrapper: calling ``__new__`` alone makes the same object.
_new_dtensor = DTensor.__new__


# ---------------------------------------------------------------------------------------------
# The fallback: DTensor's normal path for this one call.
# ---------------------------------------------------------------------------------------------
def _fallback(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run ``op`` through DTensor's normal dispatch (this handler removed for the call).

    Another thread dispatching the op meanwhile takes the normal path too: correct, only not
    flat. The handler is put back only if this call removed it.
    """
    _count("fallback")
    handlers = DTensor._op_dispatcher._custom_op_handlers
    removed = handlers.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        if removed is not None:
            handlers[op] = removed


def flat_list_op(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """DTensor custom handler: ``op`` over flat runs of RaggedShard lists (see [flat-step])."""
    info = _op_info(op)
    out = _flat(op, info, args, kwargs) if info is not None else NotImplemented
    if out is NotImplemented:
        return _fallback(op, args, kwargs)
    return out


def _is_ragged_spec(spec: DTensorSpec) -> bool:
    return any(type(p) is RaggedShard for p in spec.placements)


_dtype_of = operator.attrgetter("dtype")
_nonempty: dict[tuple[int, ...], list[int]] = {}


def _validate(ragged: dict[int, list[torch.Tensor]], dtensor_lists: dict[int, Sequence[DTensor]],
              i0: int, numels: tuple[int, ...], device: torch.device) -> bool:
    """A new layout: every item ragged, one dtype and device per list, equal sizes and global
    shapes across lists (else the normal path, which names the mismatch)."""
    first = dtensor_lists[i0]
    if not all(_is_ragged_spec(t._spec) for t in first):
        return False
    shapes0 = [t.shape for t in first]
    for i, locs in ragged.items():
        if i != i0 and (tuple(map(_numel, locs)) != numels
                        or [t.shape for t in dtensor_lists[i]] != shapes0):
            return False
        if len(set(map(_dtype_of, locs))) != 1 or any(x.device != device for x in locs):
            return False
    return True


class _Lists(NamedTuple):
    """A call's list arguments, sorted (see :func:`_read_lists`)."""

    ragged: dict[int, list[torch.Tensor]]  # argument index -> the items' local tensors
    dtensor_lists: dict[int, Sequence[DTensor]]  # argument index -> the DTensor items
    per_item: list[Sequence[Any]]  # per-item scalars that are not uniform (cut runs)
    scalar_tensor_lists: list[int]  # argument indices of per-item scalar tensors


def _read_lists(info: _OpInfo, values: list, n: int) -> _Lists | None:
    """Sort the bound arguments: ragged DTensor lists, per-item scalar tensors, scalar lists;
    replicated DTensor arguments become their local tensors (in ``values``). ``None``: the
    call is not for the flat path."""
    grad_on = torch.is_grad_enabled()
    out = _Lists({}, {}, [], [])
    for i in info.tensor_lists:
        lst = values[i]
        if not isinstance(lst, (list, tuple)):
            return None
        if not lst and info.fused:
            continue  # an optional list (max_exp_avg_sqs without amsgrad)
        if len(lst) != n:
            return None
        x0 = lst[0]
        if isinstance(x0, DTensor):
            try:
                locs = [t._local_tensor for t in lst]
            except AttributeError:
                return None  # a plain tensor among DTensors
            if grad_on and any(t.requires_grad for t in lst):
                return None  # autograd must record the op: per tensor
            l0 = locs[0]
            if type(l0) is not _Tensor or l0.is_meta or l0.is_complex():
                return None  # fake / functional / meta tensors, complex views
            out.ragged[i] = locs
            out.dtensor_lists[i] = lst
        elif isinstance(x0, torch.Tensor):
            if not _read_scalar_tensors(lst, n, out.per_item):
                return None
            out.scalar_tensor_lists.append(i)
        else:
            return None
    for i in info.scalar_lists:
        lst = values[i]
        if not isinstance(lst, (list, tuple)) or len(lst) != n:
            return None
        if not _uniform(lst):
            out.per_item.append([(type(v), v) for v in lst])
    for i in info.tensors:
        v = values[i]
        if isinstance(v, DTensor):
            if not all(p.is_replicate() for p in v._spec.placements):
                return None
            values[i] = v._local_tensor
    return out


#: Devices whose per-item scalars the flat step reads on the host. Reading a CPU tensor is a
#: memory load; reading any other device's tensor (``.tolist()``, ``.item()``) waits for its
#: queue: one host sync per call, several per optimizer step (issue 35).
HOST_READ_DEVICES = frozenset({"cpu"})


def _read_scalar_tensors(lst: Sequence[torch.Tensor], n: int,
                         per_item: list[Sequence[Any]]) -> bool:
    """A list of per-item scalar tensors (fused ``state_steps``): False if not scalars; their
    (value, dtype) pairs go to ``per_item`` unless uniform.

    On a device outside :data:`HOST_READ_DEVICES` the values are never read (no host sync):
    items are told apart by tensor identity instead, so items with distinct scalar tensors
    (torch's per-parameter ``step``) each form their own run (the per-tensor kernel, exact
    without knowing the values; a fused CUDA kernel takes its list in one launch anyway) and
    one tensor shared by every item cuts nothing.
    """
    if any(isinstance(t, DTensor) for t in lst):
        return False
    device = lst[0].device
    if device.type not in HOST_READ_DEVICES:
        if any(t.numel() != 1 or t.device != device for t in lst):
            return False  # not scalars, or mixed devices: the normal path names it
        keys = list(map(id, lst))
        if not _uniform(keys):
            per_item.append(keys)
        return True
    try:  # one stack (0-d state_steps), else 1-element tensors reshaped
        vals = torch.stack(lst).reshape(-1).tolist()
    except RuntimeError:
        try:
            vals = torch.stack([t.reshape(()) for t in lst]).tolist()
        except RuntimeError:
            return False  # mixed dtypes/devices, not scalars: normal path
    if len(vals) != n:
        return False
    dtypes = [t.dtype for t in lst]
    if not (_uniform(vals) and _uniform(dtypes)):
        per_item.append(list(zip(vals, dtypes)))
    return True


def _nonempty_of(numels: tuple[int, ...]) -> list[int]:
    nz = _nonempty.get(numels)
    if nz is None:
        nz = [k for k, m in enumerate(numels) if m]
        _cache_put(_nonempty, numels, nz)
    return nz


def _empty_call(op, info: _OpInfo, values: list, lists: _Lists, i0: int,
                numels: tuple[int, ...], n: int) -> Any:
    """This rank holds no element of any item: the op on the (empty) locals."""
    ragged = lists.ragged
    if not _validate(ragged, lists.dtensor_lists, i0, numels, ragged[i0][0].device):
        return NotImplemented
    new_values = list(values)
    for i, locs in ragged.items():
        new_values[i] = locs
    with torch.no_grad():
        result = _call(op, info, new_values)
    _count("empty_calls")
    if not info.returns_list:
        return None
    every = list(range(n))
    runs = _Runs(tuple((k, k + 1) for k in every), numels, tuple((m,) for m in numels))
    return _wrap_outputs(result, runs, every, numels, n, lists.dtensor_lists[i0])


def _layouts_of(lists: _Lists, i0: int, numels: tuple[int, ...], nz: list[int],
                device: torch.device) -> list[_Layout] | None:
    """Each ragged list's memory layout, from the cache or found now (a new one is validated
    once, and its list compacted when safe). ``None``: not for the flat path."""
    layouts: list[_Layout] = []
    validated = False
    for i, locs in lists.ragged.items():
        dtype = locs[0].dtype
        ptrs = tuple(map(_data_ptr, locs))
        key = (ptrs, numels, dtype)
        layout = _layouts.get(key)
        if layout is None:
            if not validated:
                if not _validate(lists.ragged, lists.dtensor_lists, i0, numels, device):
                    return None
                validated = True
            if len(nz) > 1 and _compact(locs, numels):
                ptrs = tuple(map(_data_ptr, locs))
                key = (ptrs, numels, dtype)
            layout = _Layout(_breaks_of(locs, nz))
            _cache_put(_layouts, key, layout)
            _count("layouts_seen")
        layouts.append(layout)
    return layouts


def _runs_for(op, info: _OpInfo, values: list, lists: _Lists, layouts: list[_Layout], i0: int,
              numels: tuple[int, ...], nz: list[int], device: torch.device) -> _Runs:
    """The call's runs: every list's breaks, the probe's alignment, the CPU output cap, then
    cuts where per-item scalars change."""
    ragged = lists.ragged
    list_dtypes = {i: locs[0].dtype for i, locs in ragged.items()}
    align = op_alignment(op, info, values, list_dtypes, device)
    cap = None
    if info.returns_list and device.type == "cpu":  # see CPU_OUTPUT_CAP_BYTES
        cap = max(1, CPU_OUTPUT_CAP_BYTES // ragged[i0][0].element_size())
    rkey = (numels, align, cap, *(lay.breaks for lay in layouts))
    runs = _runs_cache.get(rkey)
    if runs is None:
        runs = _make_runs(nz, numels, frozenset().union(*(lay.breaks for lay in layouts)),
                          align, cap)
        _cache_put(_runs_cache, rkey, runs)
    if lists.per_item:
        runs = _split_by_values(runs, nz, numels, lists.per_item)
    return runs


def _run_arguments(info: _OpInfo, values: list, lists: _Lists, layouts: list[_Layout],
                   runs: _Runs, firsts: list[int], anchor_at: int) -> list | None:
    """The flat call's arguments: one item per run (its span view, cached per layout while
    the list's first item lives). ``None``: a span outside its storage."""
    new_values = list(values)
    for (i, locs), layout in zip(lists.ragged.items(), layouts):
        anchor = locs[anchor_at]
        cached = layout.views(runs.bounds, anchor)
        if cached is None:
            cached = []
            try:
                for (a, b), f, m in zip(runs.bounds, firsts, runs.lengths):
                    cached.append(None if b - a == 1 else _span_view(locs[f], m))
            except RuntimeError:  # a span outside its storage: adjacent only by chance
                return None
            layout.remember(runs.bounds, cached, anchor)
        new_values[i] = [locs[f] if v is None else v for v, f in zip(cached, firsts)]
    for i in lists.scalar_tensor_lists:
        lst = values[i]
        new_values[i] = [lst[f] for f in firsts]
    for i in info.scalar_lists:
        lst = values[i]
        new_values[i] = [lst[f] for f in firsts]
    return new_values


def _flat(op, info: _OpInfo, args: tuple, kwargs: dict) -> Any:
    """The flat call, or ``NotImplemented`` for DTensor's normal path."""
    if torch.compiler.is_compiling():
        return NotImplemented
    values = _bind(info, args, kwargs)
    if values is None:
        return NotImplemented
    first_list = values[info.tensor_lists[0]]
    if not isinstance(first_list, (list, tuple)) or not first_list:
        return NotImplemented
    head = first_list[0]
    if not isinstance(head, DTensor) or not _is_ragged_spec(head._spec):
        return NotImplemented  # FSDP2 / Shard / Replicate DTensors: the normal path, quickly
    n = len(first_list)
    lists = _read_lists(info, values, n)
    if lists is None:
        return NotImplemented
    # Sizes of list 0 and the addresses of every list key the layout cache. A new layout is
    # validated (sizes, dtypes, global shapes) once; a known one is served from the cache:
    # the same addresses and sizes can only be the same tensors (or an invalid call).
    i0 = next(iter(lists.ragged))
    numels = tuple(map(_numel, lists.ragged[i0]))
    nz = _nonempty_of(numels)
    if not nz:
        return _empty_call(op, info, values, lists, i0, numels, n)
    device = lists.ragged[i0][0].device
    layouts = _layouts_of(lists, i0, numels, nz, device)
    if layouts is None:
        return NotImplemented
    runs = _runs_for(op, info, values, lists, layouts, i0, numels, nz, device)
    firsts = [nz[a] for a, _ in runs.bounds]
    new_values = _run_arguments(info, values, lists, layouts, runs, firsts, nz[0])
    if new_values is None:
        return NotImplemented
    with torch.no_grad():
        result = _call(op, info, new_values)
    _count("flat_calls")
    _count("flat_runs", len(firsts))
    _count("flat_items", n)
    if not info.returns_list:
        return None
    return _wrap_outputs(result, runs, nz, numels, n, lists.dtensor_lists[i0])


def _wrap_outputs(result: Sequence[torch.Tensor], runs: _Runs, nz: Sequence[int],
                  numels: tuple[int, ...], n: int, like: Sequence[DTensor]) -> list[DTensor]:
    """Per-item DTensors: views of each run's result, with the layout of ``like``'s items.

    The output list's layout is registered in the list cache (it is flat by construction),
    so the ops that consume it next find it without a scan.
    """
    locals_: list[Any] = [None] * n
    for (a, b), pieces, r in zip(runs.bounds, runs.pieces, result):
        parts = r.split(pieces) if b - a > 1 else (r,)
        for k, part in zip(range(a, b), parts):
            locals_[nz[k]] = part
    dtype, device = result[0].dtype, result[0].device
    retyped: dict[int, DTensorSpec] = {}
    out = []
    for idx in range(n):
        local = locals_[idx]
        if local is None:
            local = locals_[idx] = torch.empty(0, dtype=dtype, device=device)
        spec = like[idx]._spec
        meta = spec.tensor_meta
        if meta.dtype != dtype:
            new = retyped.get(id(spec))
            if new is None:
                new = retyped[id(spec)] = DTensorSpec(
                    spec.mesh, spec.placements,
                    tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))
            spec = new
        out.append(_new_dtensor(DTensor, local, spec, requires_grad=False))
    # Adjacent within a run (one storage), a break between runs (separate results); the run
    # results are the list's run views for as long as its first item lives.
    ends = {b - 1 for a, b in runs.bounds}
    layout = _Layout(frozenset(k for k in range(len(nz) - 1) if k in ends))
    layout.remember(runs.bounds, [None if b - a == 1 else r
                                  for (a, b), r in zip(runs.bounds, result)], locals_[nz[0]])
    _cache_put(_layouts, (tuple(map(_data_ptr, locals_)), numels, dtype), layout)
    return out


# ---------------------------------------------------------------------------------------------
# Registration: on by default, but only once this process has a RaggedShard DTensor op.
# ---------------------------------------------------------------------------------------------
_switch = {"wanted": True, "active": False}


def _register(on: bool) -> None:
    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in flat_step_ops():
        current = handlers.get(op)
        if on and current is None:
            handlers[op] = flat_list_op
        elif not on and current is flat_list_op:
            del handlers[op]
    _switch["active"] = on


def activate() -> None:
    """Register the handlers if wanted and not yet done (cheap when done).

    Called by the operator hook on the first RaggedShard op of the process (``_ops``), so a
    process that never has a RaggedShard DTensor (an FSDP2 user who imports this package)
    never routes a list op through Python. Handlers another library registered for an op are
    left alone.
    """
    if _switch["wanted"] and not _switch["active"]:
        _register(True)


def set_enabled(enabled: bool) -> None:
    """Wanted or not, registered now or removed now (see ``set_flat_step_enabled``)."""
    _switch["wanted"] = bool(enabled)
    _register(bool(enabled))


def is_enabled() -> bool:
    """Whether the flat step is wanted (it registers at the first RaggedShard op)."""
    return _switch["wanted"]
