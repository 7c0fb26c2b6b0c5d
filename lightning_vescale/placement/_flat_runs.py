"""Memory layout of the flat step: runs of back-to-back tensors, compaction, cached views.

Pure address arithmetic on plain tensors (no DTensor, no process group), used by the flat
optimizer step (design note [flat-step] in ``_flat_step``) and by optimizers that keep their own
per-parameter states (``compact_``, ``contiguous_runs``, ``run_view`` are public through
``lightning_vescale.placement``).
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["compact_", "contiguous_runs", "flat_step_stats", "run_bounds", "run_view",
           "runs_follow"]

_Tensor = torch.Tensor
_data_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_RUN_CACHE_SIZE = 256
_SINGLETON = 0  # alignment value meaning "never merge items" (the probe found no exact form)

#: Bytes at most in one run's result of an out-of-place op on CPU (a single larger item is
#: never split). Large blocks come from fresh pages: glibc maps blocks above its mmap threshold
#: (at most 32 MiB) anew and trims its heap's top, so a 50 MB ``_foreach_sqrt`` result cost
#: 18 ms of page faults per step on a 25M-parameter model (16 MiB results still ~0.5 ms at
#: 3M), where per-tensor results (at most one parameter each) are recycled from the heap.
CPU_OUTPUT_CAP_BYTES = 2**20

#: Counters for tests and benchmarks: how calls were served (reset with ``.clear()``).
flat_step_stats: dict[str, int] = {}


def _count(key: str, n: int = 1) -> None:
    flat_step_stats[key] = flat_step_stats.get(key, 0) + n


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
    breaks = {k for k in range(n - 1) if not (
        ok[k] and ok[k + 1] and all(runs_follow(lst[k], lst[k + 1]) for lst in lists))}
    # an item that is not ok is a run alone (breaks on both sides): dropped
    return [(a, b) for a, b in run_bounds([1] * n, breaks) if ok[a]]


def runs_follow(x: torch.Tensor, y: torch.Tensor, *, empty_joins: bool = False) -> bool:
    """Whether ``y`` continues ``x``'s run: one dtype, and ``y`` starts where ``x`` ends in one
    storage (with ``empty_joins``, an empty tensor on either side joins: no memory to line up).
    The one adjacency rule of every run builder ([flat-step], [flat-params])."""
    if x.dtype != y.dtype:
        return False
    if empty_joins and not (x.numel() and y.numel()):
        return True
    return (x.data_ptr() + x.numel() * x.element_size() == y.data_ptr()
            and x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr())


def run_bounds(numels: Sequence[int], breaks: Collection[int],
               align: int | Sequence[int] = 1, cap: int | None = None) -> list[tuple[int, int]]:
    """Items ``0..n-1`` (of ``numels`` elements each) cut into runs ``[a, b)``: the one run
    builder of the flat step and of ``FlatParamOptimizer``.

    A run ends after item ``k`` when ``k`` is in ``breaks``; when the alignment of item ``k+1``
    (``align``: one for all, or one per item, from the exactness probe) is ``_SINGLETON``
    (never join) or is above 1 and does not divide item ``k``'s length (vector lanes would not
    line up); and before an item that would take the run beyond ``cap`` elements (a single
    larger item is never split).
    """
    n = len(numels)
    cut = set(breaks)
    for k in range(n - 1):
        al = align if isinstance(align, int) else align[k + 1]
        if al == _SINGLETON or (al > 1 and numels[k] % al):
            cut.add(k)
    bounds, a = [], 0
    size = 0
    for k in range(n):
        size += numels[k]
        if cap is not None and k > a and size > cap:  # close the run before item k
            bounds.append((a, k))
            a, size = k, numels[k]
        if k == n - 1 or k in cut:
            bounds.append((a, k + 1))
            a, size = k + 1, 0
    return bounds


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


def clear_flat_caches() -> None:
    """Forget every cached layout and run split (tests that count the steady state's work start
    from here: a cache that earlier work in the process left nearly full clears itself at the
    next new entry, ``_cache_put``, which a count of cache misses would see)."""
    _layouts.clear()
    _runs_cache.clear()


def _breaks_of(locs: Sequence[torch.Tensor], nz: Sequence[int]) -> frozenset[int]:
    """Where consecutive non-empty items (positions in ``nz``) do not follow in memory."""
    return frozenset(k for k in range(len(nz) - 1)
                     if not runs_follow(locs[nz[k]], locs[nz[k + 1]]))


def _runs_of(bounds: Sequence[tuple[int, int]], nz: Sequence[int],
             numels: Sequence[int]) -> _Runs:
    pieces = tuple(tuple(numels[nz[k]] for k in range(a, b)) for a, b in bounds)
    return _Runs(tuple(bounds), tuple(sum(p) for p in pieces), pieces)


def _make_runs(nz: Sequence[int], numels: Sequence[int], breaks: frozenset[int] | set[int],
               align: int, cap: int | None = None) -> _Runs:
    """The runs of the non-empty items ``nz`` (:func:`run_bounds`; ``cap``: see
    :data:`CPU_OUTPUT_CAP_BYTES`)."""
    return _runs_of(run_bounds([numels[i] for i in nz], breaks, align, cap), nz, numels)


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
    return _runs_of(bounds, nz, numels)


def _uniform(values: Sequence[Any]) -> bool:
    """All equal and of one type (then no run is cut); NaNs count as different."""
    return len(set(values)) == 1 and len(set(map(type, values))) == 1
