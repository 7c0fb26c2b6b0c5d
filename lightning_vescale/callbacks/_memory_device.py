"""Current and peak memory of one device, with a resettable peak (for per-phase peaks).

Two sources, picked from the device the strategy trains on:

* an accelerator (CUDA, XPU, ...): the caching allocator's ``memory_allocated`` /
  ``max_memory_allocated`` / ``reset_peak_memory_stats`` (via ``torch.accelerator`` where it has
  them, else ``torch.cuda``), plus ``memory_reserved`` for what the allocator holds;
* the CPU: the process's resident set size from ``/proc/self/status`` (``VmRSS``) and its
  high-water mark (``VmHWM``), which Linux resets when ``5`` is written to
  ``/proc/self/clear_refs``. Where that is missing (macOS, Windows, locked-down containers) the
  peak falls back to ``getrusage`` and cannot be reset, so per-phase peaks are reported as
  unknown (``None``) instead of as wrong numbers.

All methods are cheap (microseconds) and never raise: a failed read returns ``None``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

__all__ = ["DeviceMemory"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _read_status() -> dict[str, int]:
    out: dict[str, int] = {}
    with open(_STATUS, encoding="ascii", errors="replace") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, val = line.split(":", 1)
                out[key] = int(val.split()[0]) * 1024  # the kernel reports kB
    return out


class DeviceMemory:
    """Memory figures of ``device`` for this process (see module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.is_accelerator = self.device.type != "cpu"
        self._api: Any = None
        self._clear_refs_ok = False
        self._proc_ok = False
        if self.is_accelerator:
            acc = getattr(torch, "accelerator", None)
            cur = acc.current_accelerator() if acc is not None and acc.is_available() else None
            if (cur is not None and cur.type == self.device.type
                    and hasattr(acc, "memory_allocated")):
                self._api = acc
            else:
                self._api = getattr(torch, self.device.type, torch.cuda)
        else:
            self._proc_ok = os.path.exists(_STATUS)
            if self._proc_ok:
                try:
                    with open(_CLEAR_REFS, "w", encoding="ascii") as f:
                        f.write("5")
                    self._clear_refs_ok = True
                except OSError:
                    self._clear_refs_ok = False

    @property
    def source(self) -> str:
        """Human-readable name of what is measured (goes into the summary table)."""
        if self.is_accelerator:
            return f"{self.device.type} caching allocator (memory_allocated)"
        if self._proc_ok:
            return "process RSS (/proc/self/status)"
        return "process max RSS (getrusage; per-phase peaks unavailable)"

    @property
    def can_reset_peak(self) -> bool:
        return self.is_accelerator or self._clear_refs_ok

    def _index(self) -> int | None:
        return self.device.index

    def current(self) -> int | None:
        """Bytes in use now: allocated by tensors (accelerator) or resident (CPU)."""
        try:
            if self.is_accelerator:
                return int(self._api.memory_allocated(self._index()))
            if self._proc_ok:
                return _read_status().get("VmRSS")
        except Exception:  # noqa: BLE001 - figures are best effort, training must go on
            return None
        return None

    def reserved(self) -> int | None:
        """Bytes the accelerator's caching allocator holds (``None`` on CPU)."""
        if not self.is_accelerator:
            return None
        try:
            return int(self._api.memory_reserved(self._index()))
        except Exception:  # noqa: BLE001
            return None

    def peak(self) -> int | None:
        """High-water mark since the last :meth:`reset_peak` (or process start)."""
        try:
            if self.is_accelerator:
                return int(self._api.max_memory_allocated(self._index()))
            if self._proc_ok:
                return _read_status().get("VmHWM")
            import resource  # POSIX only

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return int(rss if sys.platform == "darwin" else rss * 1024)
        except Exception:  # noqa: BLE001
            return None

    def current_and_peak(self) -> tuple[int | None, int | None]:
        """``(current(), peak())`` with one read of ``/proc/self/status`` on CPU."""
        if self.is_accelerator or not self._proc_ok:
            return self.current(), self.peak()
        try:
            status = _read_status()
        except Exception:  # noqa: BLE001
            return None, None
        return status.get("VmRSS"), status.get("VmHWM")

    def reset_peak(self) -> bool:
        """Start a new high-water mark at the current usage; False if this source cannot."""
        try:
            if self.is_accelerator:
                self._api.reset_peak_memory_stats(self._index())
                return True
            if self._clear_refs_ok:
                with open(_CLEAR_REFS, "w", encoding="ascii") as f:
                    f.write("5")
                return True
        except Exception:  # noqa: BLE001
            return False
        return False
