"""Lightning callbacks of lightning_vescale (layer 5).

``MemoryProfiler`` works with any strategy; it imports nothing from the sharding engine except the
optional ``DBuffer`` registry (layer 2), lazily.
"""

from lightning_vescale.callbacks.memory import MemoryProfiler, MemorySample

__all__ = ["MemoryProfiler", "MemorySample"]
