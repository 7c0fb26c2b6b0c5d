"""Lightning callbacks of lightning_vescale (layer 5).

``MemoryProfiler`` works with any strategy; from the sharding engine it only reads the registry
of live ``DBuffer``s (``lightning_vescale.dbuffer.live_dbuffers``, layer 2), which is empty when
the engine is not in use.
"""

from lightning_vescale.callbacks.memory import MemoryProfiler, MemorySample

__all__ = ["MemoryProfiler", "MemorySample"]
