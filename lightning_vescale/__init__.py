"""lightning_vescale: veScale-FSDP for PyTorch Lightning.

RaggedShard (a block-aware DTensor placement), a structure-aware layout planner, zero-copy
DBuffers and ``fully_shard``, block-wise 8-bit AdamW and distributed Muon, a Lightning/Fabric
strategy (``strategy="vescale_fsdp"``, registered on import) and a memory-profiling callback.
Each layer imports only the ones below it (0 placement, 1 planner, 2 dbuffer, 3 fsdp, 4 optim,
5 the Lightning and Fabric face); this file re-exports the public names and registers the
strategy names.
"""

__version__ = "0.1.0.dev0"

from lightning.fabric.strategies import STRATEGY_REGISTRY as _FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry as _TRAINER_STRATEGIES

# Layer 0-1: placement and planner (pure; importing placement installs the DTensor extensions).
from lightning_vescale.placement import RaggedShard, ragged_from_local
from lightning_vescale.planner import LayoutPlan, TensorSpec, plan_layout

# Layer 2-3: the engine.
from lightning_vescale.dbuffer import DBuffer
from lightning_vescale.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

# Layer 5: Lightning and Fabric.
from lightning_vescale.callbacks import MemoryProfiler
from lightning_vescale.fabric import VeScaleFabricStrategy
from lightning_vescale.precision import VeScaleFabricPrecision, VeScalePrecision
from lightning_vescale.strategy import VeScaleFSDPStrategy

# Lightning has no entry point for third-party strategies: the names resolve only once registered
# (Trainer: "vescale_fsdp", "vescale_fsdp_spawn", "vescale_fsdp_fork"; Fabric: "vescale_fsdp").
# Registering again (e.g. after a reload) changes nothing.
VeScaleFSDPStrategy.register_strategies(_TRAINER_STRATEGIES)
VeScaleFabricStrategy.register_strategies(_FABRIC_STRATEGIES)

__all__ = [
    "CPUOffloadPolicy",
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
    "register_fsdp_forward_method",
]
