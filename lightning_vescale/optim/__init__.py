"""Layer 4: optimizers that work on RaggedShard-sharded parameters without extra communication.

Each optimizer lives in its own submodule; add one import line per optimizer below.
"""

from lightning_vescale.optim.adamw8bit import AdamW8bit
from lightning_vescale.optim.muon import Muon

__all__ = ["AdamW8bit", "Muon"]
