"""Public test utilities: an operator-level copy/collective counter.

Nothing in the package imports this module: it is for tests and benchmarks (and users who want
to count what a step copies and communicates).

* :class:`CopyCommCounter`: copies and collectives of a step, counted per operator.

Design note [copy-comm-counting]
--------------------------------
:class:`CopyCommCounter` is a ``TorchDispatchMode``: every ATen/c10d/fsdp operator that runs on
this thread passes through it. It classifies

* *collectives*: ops of the ``c10d`` namespace (``_allgather_base_``, ``_reduce_scatter_base_``,
  ``allreduce_``, ...). "Bytes communicated" is the larger side (all-gather output,
  reduce-scatter input), i.e. the per-rank size of the full message, comparable across engines.
* *copies*: ops whose name contains ``copy`` (``copy_``, ``_to_copy``, ``split_with_sizes_copy``,
  FSDP2's ``fsdp.all_gather_copy_in``/``fsdp.split_with_sizes_copy``) or that concatenate
  (``cat``, ``_chunk_cat``, ``stack``, ``clone``). "Bytes copied" is the size of their outputs.

Ops that a collective runs internally are attributed to ``backend_*`` counters, not to the
engine: they are the same for every engine calling the same collective. Two kinds: ops nested
inside the c10d op, and ``copy_`` *into a collective's output tensor* issued later on this thread
(gloo's ``reduce_scatter_tensor`` reduces the whole input and copies the rank's chunk into the
output when the work is waited).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CopyCommCounter"]

_CONCAT = {"cat", "_chunk_cat", "chunk_cat", "stack", "clone"}


def _nbytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(obj)[0]
               if isinstance(t, torch.Tensor))


class CopyCommCounter(TorchDispatchMode):
    """Counts copies (number, bytes, by op) and collectives (number, bytes, by op).

    Use as a context manager around a step; read :attr:`copies`, :attr:`copy_bytes`,
    :attr:`comms`, :attr:`comm_bytes`, :attr:`by_op`. See design note [copy-comm-counting].
    """

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0
        self.copy_bytes = 0
        self.comms = 0
        self.comm_bytes = 0
        self.backend_copies = 0
        self.backend_copy_bytes = 0
        self.by_op: Counter[str] = Counter()
        #: collective bytes (as :attr:`comm_bytes` counts them) per ``c10d`` op
        self.comm_bytes_by_op: Counter[str] = Counter()
        self._depth = 0
        self._coll_outputs: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        ns = func.namespace
        name = func.overloadpacket.__name__
        if ns == "c10d":
            big = max((_nbytes(a) for a in args), default=0)
            if args:
                self._coll_outputs.update(t.data_ptr() for t in tree_flatten(args[0])[0]
                                          if isinstance(t, torch.Tensor))
            if self._depth == 0:
                self.comms += 1
                self.comm_bytes += big
                self.by_op[f"{ns}.{name}"] += 1
                self.comm_bytes_by_op[f"{ns}.{name}"] += big
            self._depth += 1
            try:
                return func(*args, **kwargs)
            finally:
                self._depth -= 1
        out = func(*args, **kwargs)
        if "copy" in name or name in _CONCAT:
            nb = _nbytes(out) if name != "copy_" else _nbytes(args[0])
            into_coll = name == "copy_" and args[0].data_ptr() in self._coll_outputs
            if self._depth == 0 and not into_coll:
                self.copies += 1
                self.copy_bytes += nb
                self.by_op[f"{ns}.{name}"] += 1
            else:
                self.backend_copies += 1
                self.backend_copy_bytes += nb
        return out

    def summary(self) -> dict[str, Any]:
        """Plain-dict figures (picklable)."""
        return {
            "copies": self.copies, "copy_bytes": self.copy_bytes,
            "comms": self.comms, "comm_bytes": self.comm_bytes,
            "backend_copies": self.backend_copies,
            "backend_copy_bytes": self.backend_copy_bytes,
            "by_op": dict(self.by_op),
            "comm_bytes_by_op": dict(self.comm_bytes_by_op),
        }
