"""Profiler labels that cost nothing when no profiler runs (design note [fsdp-profiling]).

``torch.profiler.record_function`` dispatches two operators on entry and exit whether or not a
profiler is recording: ~5-17 us per label on this machine's CPU, several labels per group per
step, which was a third of the engine's host time per step with small groups (issue 36).
:func:`label` returns a real ``record_function`` while a profiler records
(``torch._C._autograd._profiler_enabled()``, a flag read: ~0.04 us) and a shared no-op context
otherwise, so traces keep every ``vescale::*`` label and untraced steps pay nothing for them.
Observers of ``RecordFunction`` other than the profiler (a standalone execution-trace observer)
see the labels only while a profiler runs.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

__all__ = ["label"]

_NO_LABEL = contextlib.nullcontext()


def label(name: str) -> ContextManager[object]:
    """``record_function(name)`` while a profiler records, else a no-op context manager."""
    if _profiler_enabled():
        return record_function(name)
    return _NO_LABEL
