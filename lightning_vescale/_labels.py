"""Profiler labels that cost nothing when no profiler runs (design note [fsdp-profiling]).

``torch.profiler.record_function`` dispatches two operators on entry and exit whether or not a
profiler is recording: ~5-17 us per label on this machine's CPU, and the engine enters 8 labels
per group and step (up to ~0.14 ms per group; issue 36).
:func:`label` returns a real ``record_function`` while a profiler records
(``torch._C._autograd._profiler_enabled()``, a flag read: ~0.04 us) and a context manager that
does nothing otherwise, so traces keep every ``vescale::*`` label and untraced steps pay
nothing for them.
Observers of ``RecordFunction`` other than the profiler (a standalone execution-trace observer)
see the labels only while a profiler runs.
"""

from __future__ import annotations

import threading
from typing import ContextManager

from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

__all__ = ["label"]

class _NoLabel(threading.local):
    """Per thread, a lock only that thread ever takes: its ``__enter__``/``__exit__`` are C
    functions (``contextlib.nullcontext``'s are two Python calls per label), it is reentrant
    (labels nest) and never contended (each thread has its own), so it does nothing."""

    def __init__(self) -> None:
        self.lock = threading.RLock()


_NO_LABEL = _NoLabel()


def label(name: str) -> ContextManager[object]:
    """``record_function(name)`` while a profiler records, else a context manager that does
    nothing."""
    if _profiler_enabled():
        return record_function(name)
    return _NO_LABEL.lock
