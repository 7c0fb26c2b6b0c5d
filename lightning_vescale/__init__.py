"""lightning_vescale: veScale-FSDP for PyTorch Lightning.

RaggedShard (a block-aware DTensor placement), a structure-aware layout planner, zero-copy
DBuffers and ``fully_shard``, block-wise 8-bit AdamW and distributed Muon, a Lightning/Fabric
strategy (``strategy="vescale_fsdp"``, registered on import) and a memory-profiling callback.
See ``../shared/ARCHITECTURE.md`` (in the project) for the layering: each layer imports only the
ones below it; this file only re-exports.
"""

__version__ = "0.1.0.dev0"

# Layer 0-1: placement and planner (pure; importing placement installs the DTensor extensions).
from lightning_vescale.placement import RaggedShard, ragged_from_local
from lightning_vescale.planner import LayoutPlan, TensorSpec, plan_layout

# Layer 2-3: the engine.
from lightning_vescale.dbuffer import DBuffer
from lightning_vescale.fsdp import MixedPrecisionPolicy, fully_shard

# Layer 5: Lightning and Fabric.
from lightning_vescale._registry import register_strategies as _register_strategies
from lightning_vescale.callbacks import MemoryProfiler
from lightning_vescale.fabric import VeScaleFabricStrategy
from lightning_vescale.precision import VeScaleFabricPrecision, VeScalePrecision
from lightning_vescale.strategy import VeScaleFSDPStrategy

_register_strategies()

__all__ = [
    "DBuffer",
    "LayoutPlan",
    "MemoryProfiler",
    "MixedPrecisionPolicy",
    "RaggedShard",
    "TensorSpec",
    "VeScaleFSDPStrategy",
    "VeScaleFabricPrecision",
    "VeScaleFabricStrategy",
    "VeScalePrecision",
    "fully_shard",
    "plan_layout",
    "ragged_from_local",
]
