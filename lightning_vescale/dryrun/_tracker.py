"""Live-storage and collective accounting at the dispatcher level (fake or real tensors).

Design note [dryrun-tracker]
----------------------------
The dry run needs two things the engine does not know about itself: the high-water mark of
*every* live byte through a training step (activations and temporaries included) and every
collective with its bytes. :class:`StepTracker` is a ``TorchDispatchMode`` that

* registers the storage of every tensor an op returns (``DTensor``s unwrapped to their local
  tensors) and of every tensor handed to :meth:`StepTracker.adopt` (the model and optimizer
  state that exists before the step), keyed by the storage object (storages keep their Python
  object while any tensor views them, so a ``weakref.finalize`` on it fires exactly when the
  storage dies);
* follows ``UntypedStorage.resize_`` (how both engines free and re-allocate gathered buffers)
  while it is active, so a freed buffer stops counting and a re-grown one counts again;
* counts every ``c10d``/``_c10d_functional`` op with the bytes of its tensor arguments (the
  input a rank puts on the wire and its output);
* after every op compares the live total with the peak and remembers where it happened (the
  label of the phase the step is in: set by :meth:`phase` or the hooks the dry run installs).

Freed stays freed: on FakeTensors a view op on a tensor whose (meta) storage was resized to 0
grows that storage to fit the view (meta storages hold no data, so torch lets them grow), which
on a device allocates nothing. Both engines take views of freed gathered buffers (ours when it
swaps parameter objects, FSDP2 likewise), so without care the dry run would see every buffer
allocated. The tracker remembers the storages ``resize_`` freed and shrinks them back when an
op returns a view of one; only ``resize_`` allocates them again. It must therefore be active
from the model's construction on (:meth:`reset_peak` then drops the construction's peak).

It works the same on FakeTensors (the storages are meta storages with a size but no data) and on
real tensors, which is what lets a test compare a dry run with a real gloo run. Ops that run
below a tensor subclass's own dispatch with the mode popped (``DTensor``'s local ops) are seen
only through their outputs; short-lived temporaries inside them are not counted.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_vescale.callbacks._memory_accounting import iter_storage_tensors

__all__ = ["Collective", "StepTracker"]

_COMM_NAMESPACES = ("c10d", "_c10d_functional")
#: op name -> the family it belongs to in the report
_FAMILY = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced_":
    "reduce_scatter", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced_":
    "all_reduce", "broadcast_": "broadcast", "broadcast": "broadcast",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective a rank issued: family, op name, phase, and bytes in and out."""

    family: str
    op: str
    phase: str
    input_bytes: int
    output_bytes: int


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            yield from iter_storage_tensors(leaf)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class StepTracker(TorchDispatchMode):
    """Live bytes, their peak and where, and the collectives of the ops run under it.

    Use as a context manager around the step; :meth:`adopt` the tensors that exist before it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.peak_where = "start"
        self.where = "start"
        self.collectives: list[Collective] = []
        self.ops: Counter[str] = Counter()
        self._orig_resize: Any = None
        self._freed: set[int] = set()  # storages resized to 0 bytes (freed buffers)
        self._labels: dict[int, str] = {}  # storage -> the op that created it
        self._snap_at = 0
        #: the live bytes near the peak by the op that created them (largest first)
        self.peak_top: list[tuple[str, int]] = []

    # -- storages ------------------------------------------------------------------------------
    def _register(self, t: torch.Tensor, label: str = "state before the step") -> None:
        if t.device.type == "meta":  # plain meta tensors hold nothing (FakeTensors do count)
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._sizes:
            if key in self._freed and st.nbytes():
                self._orig_resize(st, 0)  # see "freed stays freed" in the module doc
            return
        n = st.nbytes()
        self._sizes[key] = n
        self._labels[key] = label
        self.live += n
        weakref.finalize(st, self._release, key)

    def _release(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._labels.pop(key, None)
        self._freed.discard(key)

    def _resized(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key not in self._sizes:
            self._sizes[key] = 0
            weakref.finalize(st, self._release, key)
        n = st.nbytes()
        if n:
            self._labels[key] = "buffers allocated by resize_ (gathered/gradient)"
        self.live += n - self._sizes[key]
        self._sizes[key] = n
        if n:
            self._freed.discard(key)
        else:
            self._freed.add(key)
        self._check_peak()

    def adopt(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (state that exists before the tracked step)."""
        for t in _tensors(list(tensors)):
            self._register(t)
        self._check_peak()

    def _check_peak(self) -> None:
        if self.live > self.peak:
            self.peak = self.live
            self.peak_where = self.where
            if self.live > self._snap_at * 1.002:  # within 0.2% of the peak: O(live) each time
                self._snap_at = self.live
                top: dict[str, int] = {}
                for key, n in self._sizes.items():
                    if n:
                        label = self._labels.get(key, "?")
                        top[label] = top.get(label, 0) + n
                self.peak_top = sorted(top.items(), key=lambda kv: -kv[1])[:8]

    def reset_peak(self) -> None:
        """Start a new high-water mark from the bytes live now (e.g. after the model is built
        and sharded, so that the full-size construction does not count)."""
        self.peak, self.peak_where, self._snap_at = self.live, self.where, 0
        for key in self._labels:
            self._labels[key] = "state before the step"

    def phase(self, label: str) -> None:
        """Name what runs from now on (reported as where the peak happened)."""
        self.where = label

    # -- the mode ------------------------------------------------------------------------------
    def __enter__(self) -> StepTracker:
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in _COMM_NAMESPACES:
            name = func._schema.name.split("::")[-1]
            ins = list(_tensors((args, kwargs)))
            out = func(*args, **kwargs)
            if ns == "c10d" and name in ("allreduce_", "broadcast_", "allreduce_coalesced_"):
                in_b = out_b = sum(_nbytes(t) for t in ins)  # in place
            elif ns == "c10d":  # (output, input, ...): the output comes first
                out_b = _nbytes(ins[0]) if ins else 0
                in_b = sum(_nbytes(t) for t in ins[1:])
            else:  # functional: inputs in, a new tensor out
                in_b = sum(_nbytes(t) for t in ins)
                out_b = sum(_nbytes(t) for t in _tensors(out))
            self.collectives.append(Collective(
                family=_FAMILY.get(name, name), op=name, phase=self.where,
                input_bytes=in_b, output_bytes=out_b))
        else:
            out = func(*args, **kwargs)
        self.ops[ns] += 1
        label = f"{func._schema.name.split('::')[-1]} in {self.where.split(' ')[0]}"
        for t in _tensors(out):
            self._register(t, label)
        self._check_peak()
        return out

