"""CUDA allocator snapshots for ``MemoryProfiler``: recording, the OOM observer, dumps.

Two process-wide resources are shared with the user and with other fits, so both are handled
here with care:

* allocation history (``torch.cuda.memory._record_memory_history``): a recording the user
  already started (``torch._C._cuda_isHistoryEnabled()``) is used as it is and never switched
  off; only a recording this recorder started is stopped at teardown;
* the out-of-memory observer: torch has no way to detach one, so one observer is attached per
  process, once, and it calls whichever recorders are active; a recorder that stops leaves it
  (before: one more observer per ``fit``, each keeping its profiler alive).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable

import torch
from lightning.pytorch.utilities import rank_zero_warn

__all__ = ["SnapshotRecorder", "history_enabled"]

#: recorders that want a snapshot on out-of-memory (weakly: the observer never keeps them)
_OOM_TARGETS: "weakref.WeakSet[SnapshotRecorder]" = weakref.WeakSet()
_OOM_ATTACHED: list[bool] = []  # non-empty once the process-wide observer is attached


def history_enabled() -> bool:
    """Whether the CUDA allocator records its history now (whoever started it)."""
    fn = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    try:
        return bool(fn()) if callable(fn) else False
    except Exception:  # noqa: BLE001 - no CUDA: nothing is recorded
        return False


def _oom_observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
    for recorder in list(_OOM_TARGETS):
        recorder.on_oom()


def _attach_observer_once() -> None:
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if not _OOM_ATTACHED and callable(attach):
        attach(_oom_observer)
        _OOM_ATTACHED.append(True)


class SnapshotRecorder:
    """Allocation history and snapshot files of one ``fit`` (CUDA only).

    Args:
        snapshot_dir: where snapshot files go.
        max_entries: the history's ring-buffer size (when this recorder starts it).
        on_oom: also dump a snapshot when the allocator runs out of memory.
        name_oom: the OOM snapshot's file name.
        written: called with every path written.
    """

    def __init__(self, *, snapshot_dir: str, max_entries: int, on_oom: bool, name_oom: str,
                 written: Callable[[str], None]) -> None:
        self.snapshot_dir = snapshot_dir
        self.max_entries = max_entries
        self.snapshot_on_oom = on_oom
        self.name_oom = name_oom
        self._written = written
        self.recording = False
        self.started_history = False  # this recorder switched history on (and will switch off)
        self.oom_dumped = False

    def start(self) -> None:
        os.makedirs(self.snapshot_dir, exist_ok=True)
        if not history_enabled():  # the user's own recording is kept with its settings
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
            self.started_history = True
        self.recording = True
        if self.snapshot_on_oom:
            _attach_observer_once()
            _OOM_TARGETS.add(self)

    def on_oom(self) -> None:
        if self.recording and not self.oom_dumped:
            self.oom_dumped = True
            self.dump(self.name_oom)

    def dump(self, name: str) -> None:
        if not self.recording:
            return
        path = os.path.join(self.snapshot_dir, name)
        try:
            torch.cuda.memory._dump_snapshot(path)
            self._written(path)
        except Exception as err:  # noqa: BLE001 - a failed dump must not end training
            rank_zero_warn(f"MemoryProfiler: could not write allocator snapshot {path}: {err}")

    def stop(self) -> None:
        """Leave the OOM observer and stop the history if this recorder started it."""
        _OOM_TARGETS.discard(self)
        if not self.recording:
            return
        self.recording = False
        if self.started_history:
            self.started_history = False
            try:
                torch.cuda.memory._record_memory_history(enabled=None)
            except Exception:  # noqa: BLE001
                pass
