"""Layer 2: which DBuffers are alive, and which one a tensor's memory belongs to.

Split out of ``dbuffer`` (one responsibility): :func:`dbuffer_of` finds a shard's buffer from a
tensor viewing it, :func:`live_dbuffers` lists every live buffer (memory accounting).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_vescale.dbuffer import DBuffer

__all__ = ["dbuffer_of", "live_dbuffers", "register"]

_LIVE: "weakref.WeakSet[DBuffer]" = weakref.WeakSet()
#: the attribute of a shard's storage object holding a weak reference to its DBuffer
_OWNER = "_lightning_vescale_dbuffer"


def live_dbuffers() -> list["DBuffer"]:
    """Every ``DBuffer`` that is still alive in this process (for memory accounting: the
    ``MemoryProfiler``'s ``engine_tensors(module=None)``; the engine itself never reads it)."""
    return list(_LIVE)


def dbuffer_of(t: torch.Tensor) -> "DBuffer | None":
    """The live ``DBuffer`` whose owned ``shard`` storage ``t`` views (a ``fully_shard``
    parameter's local tensor, its run of neighbours), else ``None``.

    The link lives on the shard's storage object (torch keeps one Python object per storage
    while the storage lives) as a weak reference: a tensor finds its own buffer without any
    process-wide lookup, and the link never keeps the buffer alive.
    """
    ref = getattr(t.untyped_storage(), _OWNER, None)
    return ref() if ref is not None else None


def register(buf: "DBuffer") -> None:
    """Record a new buffer: linked from its shard's storage (:func:`dbuffer_of`) and listed by
    :func:`live_dbuffers`, both weakly."""
    setattr(buf.shard.untyped_storage(), _OWNER, weakref.ref(buf))
    _LIVE.add(buf)
