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
   0-d tensors such as fused ``state_steps``). Gaps never join a run, so padding between
   parameters (planner alignment, parameters without gradients, another param group's
   parameters) is never read or written. The run structure is cached by the lists' pointers;
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

import functools
import operator
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from lightning_vescale.placement._common import aten
from lightning_vescale.placement._ragged_shard import RaggedShard

__all__ = ["FLAT_STEP_FUSED", "activate", "compact_", "contiguous_runs", "flat_list_op",
           "flat_step_ops", "flat_step_stats", "is_enabled", "run_view", "set_enabled"]

_Tensor = torch.Tensor
# ``DTensor(local, spec, requires_grad=...)`` is ``_dtensor__new__`` (C++, sets ``_spec`` and
# ``_local_tensor``) plus an ``__init__`` that does nothing but costs ~2 us behind a dynamo
# wrapper: calling ``__new__`` alone makes the same object.
_new_dtensor = DTensor.__new__
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel

#: Fused optimizer kernels handled like ``_foreach_*`` ops (their lists are element-wise).
FLAT_STEP_FUSED = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
_FOREACH_NOT_ELEMENTWISE = {"max", "norm", "powsum", "mm"}
_FOREACH_EXTRA = {"copy", "zero"}
_PROBE_ALIGNMENTS_FUSED = (1, 16, 64)
_RUN_CACHE_SIZE = 256
_SINGLETON = 0  # alignment value meaning "never merge items" (the probe found no exact form)

#: Counters for tests and benchmarks: how calls were served (reset with ``.clear()``).
flat_step_stats: dict[str, int] = {}


def _count(key: str, n: int = 1) -> None:
    flat_step_stats[key] = flat_step_stats.get(key, 0) + n


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


def _foreach_is_elementwise(base: str) -> bool:
    if base in _FOREACH_NOT_ELEMENTWISE:
        return False
    if base in _FOREACH_EXTRA:
        return True
    packet = getattr(aten, base, None)
    return packet is not None and any(
        torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()
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
        elif not _foreach_is_elementwise(name[len("_foreach_"):].rstrip("_")):
            continue
        packet = getattr(aten, name, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None or torch.Tag.nondeterministic_seeded in op.tags:
            continue
        if _op_info(op) is not None:
            ops.append(op)
    return tuple(sorted(ops, key=str))


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


# ---------------------------------------------------------------------------------------------
# Compaction of fragmented lists (optimizer states).
# ---------------------------------------------------------------------------------------------
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _sole_owner(x: torch.Tensor) -> bool:
    if type(x) is not _Tensor or x.requires_grad or not x.is_contiguous() or x.storage_offset():
        return False
    s = x.untyped_storage()
    # 2 = this tensor + the storage's (preserved) Python object: nothing else views it.
    return s.nbytes() == x.numel() * x.element_size() and _use_count(s._cdata) == 2


def _compact(locs: list[torch.Tensor], numels: list[int]) -> bool:
    """Move the items of ``locs`` into one buffer, in list order; False if not safe."""
    if _use_count is None:
        return False
    items = [x for x, n in zip(locs, numels) if n]
    if len(items) < 2:
        return False
    first = items[0]
    dtype, device = first.dtype, first.device
    for x in items:
        if x.dtype != dtype or x.device != device or not _sole_owner(x):
            return False
    with torch.no_grad():
        flat = torch.cat(items)
        storage = flat.untyped_storage()
        off = 0
        for x in items:
            n = x.numel()
            x.set_(storage, off, (n,), (1,))
            off += n
    _count("compacted_lists")
    _count("compacted_items", len(items))
    return True


def compact_(tensors: Sequence[torch.Tensor]) -> bool:
    """Move plain tensors into one buffer, in order, keeping each tensor object (``set_``).

    Done only when it is safe: every non-empty tensor is contiguous, does not require grad,
    and is the sole user of its whole storage (so no other tensor sees the move); all share
    one dtype and device. Returns whether the tensors were moved. For optimizers that keep
    element-wise states per parameter (AdamW8bit's fp32 moments), so that the states of
    adjacent parameters become adjacent too (see :func:`contiguous_runs`).
    """
    return _compact(list(tensors), [t.numel() for t in tensors])


def contiguous_runs(*lists: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Index ranges ``[a, b)`` whose items lie back to back in one storage in *every* list.

    Items must be contiguous tensors; an empty item, a non-contiguous one or a list length
    mismatch ends a run (empty items form no run). Items ``a..b-1`` of each list are then
    exactly the elements of :func:`run_view`. Pure address arithmetic, no data is read.
    """
    if not lists:
        return []
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        raise ValueError(f"contiguous_runs: lists of different lengths {[len(x) for x in lists]}")
    ok = [all(lst[k].numel() and lst[k].is_contiguous() for lst in lists) for k in range(n)]
    runs: list[tuple[int, int]] = []
    a = None
    for k in range(n):
        if not ok[k]:
            if a is not None:
                runs.append((a, k))
            a = None
            continue
        if a is not None and not all(_follows(lst[k - 1], lst[k]) for lst in lists):
            runs.append((a, k))
            a = None
        if a is None:
            a = k
    if a is not None:
        runs.append((a, n))
    return runs


def _follows(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.dtype == y.dtype
            and x.data_ptr() + x.numel() * x.element_size() == y.data_ptr()
            and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr())


def run_view(tensors: Sequence[torch.Tensor], a: int, b: int) -> torch.Tensor:
    """The 1-D view spanning items ``a..b-1`` of a run found by :func:`contiguous_runs`."""
    x = tensors[a]
    if b - a == 1:
        return x.view(-1)
    n = sum(t.numel() for t in tensors[a:b])
    return x.as_strided((n,), (1,), x.storage_offset())


# ---------------------------------------------------------------------------------------------
# Runs.
# ---------------------------------------------------------------------------------------------
class _Runs(NamedTuple):
    """Runs of one call, over the positions of the non-empty items ``nz``."""

    bounds: tuple[tuple[int, int], ...]  # (a, b): positions nz[a:b] form one run
    lengths: tuple[int, ...]  # elements per run
    pieces: tuple[tuple[int, ...], ...]  # per run: the items' lengths (to split outputs)


def _span_view(x: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D view of ``numel`` elements of ``x``'s storage from ``x``'s first element.

    It must not keep ``x`` itself alive (``x`` may be a layout's anchor, see :class:`_Layout`):
    a view of a view refers to the root base, so ``as_strided`` is fine unless ``x`` is a
    root tensor, which gets a fresh tensor over its storage instead (its own version counter:
    such tensors, compacted states and results of this module, are never saved by autograd).
    """
    if x._base is not None:
        return x.as_strided((numel,), (1,), x.storage_offset())
    out = torch.empty(0, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        out.set_(x.untyped_storage(), x.storage_offset(), (numel,), (1,))
    return out


class _Layout:
    """One list's memory layout: where its runs break, and its run views while valid.

    ``breaks`` holds the positions ``k`` after which ``nz[k]`` and ``nz[k+1]`` are not
    adjacent in one storage. The run views (1-D views spanning each run) are kept while the
    list's first item (the *anchor*) is alive and is the same object: a weak reference's
    callback drops them when it dies, so a cached view never keeps freed memory (released
    gradients, temporaries) alive longer than the list itself. Nothing cached may refer to
    the anchor (it would never die): single-item runs are cached as ``None`` (the item is
    taken from the call), spans are built by :func:`_span_view`.
    """

    __slots__ = ("breaks", "_views", "_anchor", "__weakref__")

    def __init__(self, breaks: frozenset[int]) -> None:
        self.breaks = breaks
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self._anchor: weakref.ref | None = None

    def views(self, bounds: tuple, anchor: torch.Tensor) -> list[torch.Tensor] | None:
        if self._anchor is None or self._anchor() is not anchor:
            return None
        return self._views.get(bounds)

    def remember(self, bounds: tuple, views: list[torch.Tensor], anchor: torch.Tensor) -> None:
        if self._anchor is None or self._anchor() is not anchor:
            self._views = {}
            self._anchor = weakref.ref(anchor, self._drop)
        self._views[bounds] = views

    def _drop(self, ref: weakref.ref) -> None:
        if self._anchor is ref:
            self._views = {}
            self._anchor = None


#: (pointers, lengths, dtype) of one list -> its _Layout. Keyed by memory layout, so a list
#: object is never held (only run views, see _Layout).
_layouts: dict[tuple, _Layout] = {}
#: (lengths, breaks of every list..., alignment) -> _Runs
_runs_cache: dict[tuple, _Runs] = {}


def _cache_put(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= _RUN_CACHE_SIZE:
        cache.clear()
    cache[key] = value


def _breaks_of(locs: Sequence[torch.Tensor], ptrs: Sequence[int], numels: Sequence[int],
               nz: Sequence[int]) -> frozenset[int]:
    """Where consecutive non-empty items are not adjacent in memory in one storage."""
    itemsize = locs[nz[0]].element_size()
    out = set()
    prev_storage = locs[nz[0]].untyped_storage().data_ptr()
    for k in range(len(nz) - 1):
        i, j = nz[k], nz[k + 1]
        storage = locs[j].untyped_storage().data_ptr()
        if ptrs[i] + numels[i] * itemsize != ptrs[j] or storage != prev_storage:
            out.add(k)
        prev_storage = storage
    return frozenset(out)


def _make_runs(nz: Sequence[int], numels: Sequence[int], breaks: frozenset[int] | set[int],
               align: int) -> _Runs:
    if align == _SINGLETON:
        cut = set(range(len(nz) - 1))
    elif align > 1:
        cut = set(breaks) | {k for k, i in enumerate(nz[:-1]) if numels[i] % align}
    else:
        cut = breaks
    bounds, a = [], 0
    last = len(nz) - 1
    for k in range(len(nz)):
        if k == last or k in cut:
            bounds.append((a, k + 1))
            a = k + 1
    pieces = tuple(tuple(numels[nz[k]] for k in range(a, b)) for a, b in bounds)
    return _Runs(tuple(bounds), tuple(sum(p) for p in pieces), pieces)


def _split_by_values(runs: _Runs, nz: Sequence[int], numels: Sequence[int],
                     per_item: Sequence[Sequence[Any]]) -> _Runs:
    """Cut runs where a per-item scalar (ScalarList value, step tensor) changes."""
    bounds = []
    for a, b in runs.bounds:
        start = a
        for k in range(a + 1, b):
            i, j = nz[k - 1], nz[k]
            if any(v[i] != v[j] for v in per_item):
                bounds.append((start, k))
                start = k
        bounds.append((start, b))
    pieces = tuple(tuple(numels[nz[k]] for k in range(a, b)) for a, b in bounds)
    return _Runs(tuple(bounds), tuple(sum(p) for p in pieces), pieces)


def _uniform(values: Sequence[Any]) -> bool:
    """All equal and of one type (then no run is cut); NaNs count as different."""
    return len(set(values)) == 1 and len(set(map(type, values))) == 1


# ---------------------------------------------------------------------------------------------
# The handler.
# ---------------------------------------------------------------------------------------------
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


def _flat(op, info: _OpInfo, args: tuple, kwargs: dict) -> Any:  # noqa: C901 - one pipeline
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
    grad_on = torch.is_grad_enabled()
    # -- the tensor lists: ragged DTensor lists, or per-item scalar tensors -------------------
    ragged: dict[int, list[torch.Tensor]] = {}
    dtensor_lists: dict[int, Sequence[DTensor]] = {}
    per_item: list[Sequence[Any]] = []
    scalar_tensor_lists: list[int] = []
    for i in info.tensor_lists:
        lst = values[i]
        if not isinstance(lst, (list, tuple)):
            return NotImplemented
        if not lst and info.fused:
            continue  # an optional list (max_exp_avg_sqs without amsgrad)
        if len(lst) != n:
            return NotImplemented
        x0 = lst[0]
        if isinstance(x0, DTensor):
            try:
                locs = [t._local_tensor for t in lst]
            except AttributeError:
                return NotImplemented  # a plain tensor among DTensors
            if grad_on and any(t.requires_grad for t in lst):
                return NotImplemented  # autograd must record the op: per tensor
            l0 = locs[0]
            if type(l0) is not _Tensor or l0.is_meta or l0.is_complex():
                return NotImplemented  # fake / functional / meta tensors, complex views
            ragged[i] = locs
            dtensor_lists[i] = lst
        elif isinstance(x0, torch.Tensor):
            if any(isinstance(t, DTensor) for t in lst):
                return NotImplemented
            try:  # one stack (0-d state_steps), else 1-element tensors reshaped
                vals = torch.stack(lst).reshape(-1).tolist()
            except RuntimeError:
                try:
                    vals = torch.stack([t.reshape(()) for t in lst]).tolist()
                except RuntimeError:
                    return NotImplemented  # mixed dtypes/devices, not scalars: normal path
            if len(vals) != n:
                return NotImplemented
            dtypes = [t.dtype for t in lst]
            if not (_uniform(vals) and _uniform(dtypes)):
                per_item.append(list(zip(vals, dtypes)))
            scalar_tensor_lists.append(i)
        else:
            return NotImplemented
    for i in info.scalar_lists:
        lst = values[i]
        if not isinstance(lst, (list, tuple)) or len(lst) != n:
            return NotImplemented
        if not _uniform(lst):
            per_item.append([(type(v), v) for v in lst])
    for i in info.tensors:
        v = values[i]
        if isinstance(v, DTensor):
            if not all(p.is_replicate() for p in v._spec.placements):
                return NotImplemented
            values[i] = v._local_tensor
    # -- per-item sizes and dtypes (checked on every call: they define the memory touched) -----
    ragged_idx = list(ragged)
    i0 = ragged_idx[0]
    # Sizes of list 0 and the addresses of every list key the layout cache. A new layout is
    # validated (sizes, dtypes, global shapes) once; a known one is served from the cache:
    # the same addresses and sizes can only be the same tensors (or an invalid call).
    numels = tuple(map(_numel, ragged[i0]))
    nz = _nonempty.get(numels)
    if nz is None:
        nz = [k for k, m in enumerate(numels) if m]
        _cache_put(_nonempty, numels, nz)
    if not nz:  # this rank holds no element of any item: the op on the (empty) locals
        if not _validate(ragged, dtensor_lists, i0, numels, ragged[i0][0].device):
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
        return _wrap_outputs(result, runs, every, numels, n, dtensor_lists[i0])
    device = ragged[i0][0].device
    list_dtypes: dict[int, torch.dtype] = {}
    layouts: list[_Layout] = []
    validated = False
    for i in ragged_idx:
        locs = ragged[i]
        dtype = locs[0].dtype
        list_dtypes[i] = dtype
        ptrs = tuple(map(_data_ptr, locs))
        key = (ptrs, numels, dtype)
        layout = _layouts.get(key)
        if layout is None:
            if not validated:
                if not _validate(ragged, dtensor_lists, i0, numels, device):
                    return NotImplemented
                validated = True
            if len(nz) > 1 and _compact(locs, numels):
                ptrs = tuple(map(_data_ptr, locs))
                key = (ptrs, numels, dtype)
            layout = _Layout(_breaks_of(locs, ptrs, numels, nz))
            _cache_put(_layouts, key, layout)
            _count("layouts_seen")
        layouts.append(layout)
    align = _exact_alignment(op, info, values, list_dtypes, device)
    rkey = (numels, align, *(lay.breaks for lay in layouts))
    runs = _runs_cache.get(rkey)
    if runs is None:
        runs = _make_runs(nz, numels, frozenset().union(*(lay.breaks for lay in layouts)),
                          align)
        _cache_put(_runs_cache, rkey, runs)
    if per_item:
        runs = _split_by_values(runs, nz, numels, per_item)
    # -- the flat call ---------------------------------------------------------------------------
    new_values = list(values)
    firsts = [nz[a] for a, _ in runs.bounds]
    anchor_at = nz[0]
    for i, layout in zip(ragged_idx, layouts):
        locs = ragged[i]
        anchor = locs[anchor_at]
        cached = layout.views(runs.bounds, anchor)
        if cached is None:
            cached = []
            try:
                for (a, b), f, m in zip(runs.bounds, firsts, runs.lengths):
                    cached.append(None if b - a == 1 else _span_view(locs[f], m))
            except RuntimeError:  # a span outside its storage: adjacent only by chance
                return NotImplemented
            layout.remember(runs.bounds, cached, anchor)
        new_values[i] = [locs[f] if v is None else v for v, f in zip(cached, firsts)]
    for i in scalar_tensor_lists:
        lst = values[i]
        new_values[i] = [lst[f] for f in firsts]
    for i in info.scalar_lists:
        lst = values[i]
        new_values[i] = [lst[f] for f in firsts]
    with torch.no_grad():
        result = _call(op, info, new_values)
    _count("flat_calls")
    _count("flat_runs", len(firsts))
    _count("flat_items", n)
    if not info.returns_list:
        return None
    return _wrap_outputs(result, runs, nz, numels, n, dtensor_lists[i0])


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
