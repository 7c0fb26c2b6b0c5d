"""Pure tensor accounting for :class:`~lightning_vescale.callbacks.memory.MemoryProfiler`.

Why it exists
-------------
"How many bytes are parameters, gradients, optimizer states and communication buffers?" sounds
like a sum of ``numel * element_size``, but with a zero-copy sharding engine it is not:

* a parameter at rest is a ``DTensor`` whose *local* tensor is a view into the group's
  ``DBuffer`` shard; while unsharded it is a plain tensor viewing the gathered buffer;
* gradients are views into a gradient buffer; an optimizer may hold references to parameters;
* the same storage is reachable through several views, so naive sums double count.

Contract
--------
:func:`account` takes the tensors of each category (any iterables; ``DTensor`` and other wrapper
subclasses are unwrapped to the tensors that really hold memory) and counts every *byte range of
every untyped storage at most once*, in priority order::

    params_sharded > params_unsharded > grads > optimizer_states > comm_buffers

So the rank's own shard inside a gathered buffer counts as a sharded parameter (the unsharded
figure is the *extra* memory of unsharding), a parameter view inside a ``DBuffer`` counts as a
parameter, and only the rest of that buffer (padding, a gathered copy nobody views, a staging
area) counts as a communication buffer. The per-category figures therefore add up to exactly the
bytes of the distinct storage ranges involved, never more.

Only tensors on the measured device are counted; the bytes of the others (CPU offload, say) are
reported separately as ``off_device``. Pinned host storages among them take more host memory than
their bytes: the caching host allocator rounds each up to a power of two (design note
[pinned-host]), up to 2x; ``off_device_pinned_host`` is what those storages really hold. Meta
tensors and tensors without storage count as zero; FakeTensors (the dry run's,
``lightning_vescale.dryrun``) count by their storages' sizes.
Nothing here needs a process group or a Trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from lightning_vescale._pinned import pinned_host_bytes

__all__ = [
    "CATEGORIES",
    "MemoryBreakdown",
    "MemorySample",
    "account",
    "collect_training_tensors",
    "is_sharded_param",
    "iter_storage_tensors",
]

#: Accounting categories in priority order (an earlier one claims shared bytes first).
CATEGORIES: tuple[str, ...] = (
    "params_sharded",
    "params_unsharded",
    "grads",
    "optimizer_states",
    "comm_buffers",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per category on one device, each storage byte counted once (see module doc)."""

    params_sharded: int = 0
    params_unsharded: int = 0
    grads: int = 0
    optimizer_states: int = 0
    comm_buffers: int = 0
    #: bytes of the given tensors that live on another device (not part of :attr:`total`).
    off_device: int = 0
    #: host bytes held by the pinned storages among them: each storage's size rounded up to a
    #: power of two by the caching host allocator (up to 2x their bytes; design note
    #: [pinned-host]). 0 without pinned tensors (and always on a CPU-only build).
    off_device_pinned_host: int = 0

    @property
    def total(self) -> int:
        """Sum of the categories: the bytes the profiler can name on this device."""
        return sum(getattr(self, c) for c in CATEGORIES)

    def as_dict(self) -> dict[str, int]:
        return {c: getattr(self, c) for c in CATEGORIES}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySample:
    """One observation at a phase boundary on one rank.

    ``phase`` is the phase that just *ended* at this boundary and ``phase_peak`` its high-water
    mark (bytes; ``None`` where the source cannot reset peaks). ``current`` is the device figure
    at the boundary and ``breakdown`` the named bytes at that moment.
    """

    seq: int
    batch: int
    time_s: float
    phase: str
    phase_peak: int | None
    current: int | None
    breakdown: MemoryBreakdown | None

    @property
    def activations_other(self) -> int | None:
        """``current`` minus the named bytes: activations, temporaries, runtime, cache."""
        if self.current is None or self.breakdown is None:
            return None
        return self.current - self.breakdown.total


# --------------------------------------------------------------------------------------------
# Unwrapping tensors to the storages that hold their memory
# --------------------------------------------------------------------------------------------
def iter_storage_tensors(t: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the plain tensors that hold ``t``'s memory.

    ``DTensor`` yields its local tensor; other traceable wrapper subclasses (``__tensor_flatten__``,
    e.g. float8 or quantized tensors) yield their inner tensors, recursively. Plain tensors and
    ``nn.Parameter`` yield themselves. Anything else yields nothing.
    """
    if not isinstance(t, torch.Tensor) or _depth > 8:
        return
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        yield t
        return
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None:
        try:
            attrs, _ = flatten()
        except Exception:  # noqa: BLE001 - an odd subclass: fall back to the tensor itself
            attrs = None
        if attrs is not None:
            for name in attrs:
                yield from iter_storage_tensors(getattr(t, name, None), _depth + 1)
            return
    yield t  # an ordinary subclass that owns its storage (e.g. a Parameter subclass)


def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """``(storage base address, start byte, end byte)`` of the storage range ``t`` can touch.

    The base address is ``data_ptr - storage_offset * element_size`` (no storage object is
    created: this runs for every tensor of the model several times per profiled batch). A freed
    storage (``resize_(0)``, as FSDP engines do) has base 0 and counts as nothing.
    """
    n = t.numel()
    if n == 0:
        return None
    try:
        esize = t.element_size()
        off = t.storage_offset()
        if _is_fake(t):
            # a FakeTensor (the dry run) has a storage with a size but no address: the storage
            # object stands for it (it is one object per storage while any view lives)
            storage = t.untyped_storage()
            base = id(storage) if storage.nbytes() else 0
        else:
            base = t.data_ptr() - off * esize
    except (RuntimeError, NotImplementedError):  # meta/functional tensors: no storage
        return None
    if base <= 0:
        return None
    if t.is_contiguous():
        extent = n
    else:
        extent = 1 + sum((k - 1) * abs(st) for k, st in zip(t.shape, t.stride()))
    start = off * esize
    return base, start, start + extent * esize


def _is_fake(t: torch.Tensor) -> bool:
    """A FakeTensor (``torch._subclasses``; imported lazily: only the dry run makes them)."""
    if type(t).__name__ != "FakeTensor":
        return False
    from torch._subclasses.fake_tensor import is_fake
    return is_fake(t)


_Key = tuple[int, torch.device]  # (storage base address, device)


def _merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ``(start, end)`` byte intervals covering the same bytes as ``intervals``."""
    intervals.sort()
    out: list[tuple[int, int]] = []
    for s, e in intervals:
        if out:
            last_start, last_end = out[-1]
            if s <= last_end:
                if e > last_end:
                    out[-1] = (last_start, e)
                continue
        out.append((s, e))
    return out


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Bytes covered by both of two sorted lists of disjoint intervals."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        (a_start, a_end), (b_start, b_end) = a[i], b[j]
        lo, hi = max(a_start, b_start), min(a_end, b_end)
        if hi > lo:
            total += hi - lo
        if a_end < b_end:
            i += 1
        else:
            j += 1
    return total


def account(
    *,
    device: torch.device | str,
    params_sharded: Iterable[Any] = (),
    params_unsharded: Iterable[Any] = (),
    grads: Iterable[Any] = (),
    optimizer_states: Iterable[Any] = (),
    comm_buffers: Iterable[Any] = (),
    extra_comm_bytes: int = 0,
) -> MemoryBreakdown:
    """Count the bytes of each category on ``device``, each storage byte once (priority order).

    Tensor arguments are iterables (``None``, non-tensors ignored). ``extra_comm_bytes``: bytes
    an engine reports but does not expose as tensors (temporaries of in-flight collectives).
    """
    device = torch.device(device)
    plain = (torch.Tensor, torch.nn.Parameter)
    # ``torch.device`` attribute access costs ~0.2 us: classify each distinct device once
    where: dict[torch.device, int] = {}  # 1: the measured device, 0: another one, -1: meta
    claimed: dict[_Key, list[tuple[int, int]]] = {}
    counts: dict[str, int] = {}
    off_device: dict[_Key, list[tuple[int, int]]] = {}
    pinned: dict[_Key, int] = {}  # off-device pinned storages: their allocation's bytes
    groups = (params_sharded, params_unsharded, grads, optimizer_states, comm_buffers)
    for name, tensors in zip(CATEGORIES, groups):
        mine: dict[_Key, list[tuple[int, int]]] = {}
        for obj in tensors:
            if type(obj) in plain:
                inner: Iterable[torch.Tensor] = (obj,)
            elif isinstance(obj, torch.Tensor):
                inner = iter_storage_tensors(obj)
            else:
                continue
            for t in inner:
                dev = t.device
                w = where.get(dev)
                if w is None:
                    if dev.type == "meta":
                        w = -1
                    else:
                        w = int(dev.type == device.type and (
                            device.index is None or dev.index is None or dev.index == device.index))
                    where[dev] = w
                if w < 0:
                    continue
                span = _span(t)
                if span is None:
                    continue
                base, s, e = span
                key = (base, dev)
                target = mine if w else off_device
                ivs = target.get(key)
                if ivs is None:
                    target[key] = [(s, e)]
                    if not w and _is_pinned(t):  # pinned host memory: its allocation's bytes
                        pinned[key] = pinned_host_bytes(t.untyped_storage().nbytes())
                else:
                    ivs.append((s, e))
        total = 0
        for key, ivs in mine.items():
            prev = claimed.get(key)
            if len(ivs) == 1 and prev is None:  # the common case: a storage seen once
                claimed[key] = ivs
                (start, end), = ivs
                total += end - start
                continue
            merged = _merge(ivs)
            size = 0
            for s, e in merged:
                size += e - s
            if prev:
                size -= _overlap(merged, prev)
                claimed[key] = _merge(prev + merged)
            else:
                claimed[key] = merged
            total += size
        counts[name] = total
    counts["comm_buffers"] += int(extra_comm_bytes)
    off = sum(sum(e - s for s, e in _merge(ivs)) for ivs in off_device.values())
    return MemoryBreakdown(**counts, off_device=off, off_device_pinned_host=sum(pinned.values()))


def _is_pinned(t: torch.Tensor) -> bool:
    """``t`` is in page-locked host memory (``False`` on a CPU-only build, which cannot pin)."""
    return t.device.type == "cpu" and t.is_pinned()


# --------------------------------------------------------------------------------------------
# Finding the tensors of a training run
# --------------------------------------------------------------------------------------------
def is_sharded_param(p: torch.Tensor) -> bool:
    """True for a parameter that holds only this rank's part of the full tensor.

    A ``DTensor`` is sharded if any placement is not ``Replicate`` (``Shard``, ``RaggedShard``, a
    pending ``Partial``); FSDP1's flat parameters are sharded. A plain tensor is not.
    """
    placements = getattr(p, "placements", None)
    if placements is not None:
        for pl in placements:
            is_rep = getattr(pl, "is_replicate", None)
            if not (callable(is_rep) and is_rep()):
                return True
        return False
    return bool(getattr(p, "_is_flat_param", False))


def _walk_state(obj: Any, out: list[torch.Tensor], _depth: int = 0) -> None:
    if _depth > 6:
        return
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _walk_state(v, out, _depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk_state(v, out, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk_state(getattr(obj, f.name, None), out, _depth + 1)


def collect_training_tensors(
    modules: Iterable[torch.nn.Module],
    optimizers: Iterable[Any],
) -> dict[str, list[torch.Tensor]]:
    """Tensors of each category (except ``comm_buffers``) reachable from modules and optimizers.

    Parameters come from the modules (what forward sees: unsharded plain tensors while an FSDP
    group is gathered) *and* from the optimizers' parameter groups (the sharded ``DTensor``s the
    optimizer steps). Gradients are those parameters' ``.grad``; optimizer states are all tensors
    in ``optimizer.state`` (nested dicts/lists/dataclasses included). Returns lists keyed like the
    keyword arguments of :func:`account`.
    """
    params: dict[int, torch.Tensor] = {}
    for m in modules:
        for p in m.parameters():
            params.setdefault(id(p), p)
    opts = [getattr(o, "_optimizer", o) for o in optimizers]  # unwrap LightningOptimizer
    for opt in opts:
        for group in getattr(opt, "param_groups", ()):
            for p in group.get("params", ()):
                if isinstance(p, torch.Tensor):
                    params.setdefault(id(p), p)
    sharded: list[torch.Tensor] = []
    unsharded: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for p in params.values():
        (sharded if is_sharded_param(p) else unsharded).append(p)
        if p.grad is not None:
            grads.append(p.grad)
    states: list[torch.Tensor] = []
    for opt in opts:
        state = getattr(opt, "state", None)
        if isinstance(state, Mapping):
            for v in state.values():
                _walk_state(v, states)
    return {
        "params_sharded": sharded,
        "params_unsharded": unsharded,
        "grads": grads,
        "optimizer_states": states,
    }
