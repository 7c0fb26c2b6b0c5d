"""lightning_vescale: veScale-FSDP for PyTorch Lightning.

RaggedShard (a block-aware DTensor placement), a structure-aware layout planner, zero-copy
DBuffers and ``fully_shard``, block-wise 8-bit AdamW and distributed Muon, a Lightning/Fabric
strategy (``strategy="vescale_fsdp"``, registered on import) and a memory-profiling callback.
Each layer imports only the ones below it (0 placement, 1 planner, 2 dbuffer, 3 fsdp, 4 optim,
5 the Lightning and Fabric face); this file re-exports the public names and registers the
strategy names.

Importing the package does not import Lightning (it takes seconds): the layer-5 names
(``VeScaleFSDPStrategy``, ``VeScaleFabricStrategy``, the precision plugins, ``MemoryProfiler``)
are imported on first access, and the strategy names are registered with Lightning's registries
without importing them, whichever of ``lightning`` and ``lightning_vescale`` is imported first
(design note [lazy-registration] in ``lightning_vescale/_lightning/registry.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

# Layer 0-1: placement and planner (pure; importing placement installs the DTensor extensions).
from lightning_vescale.placement import RaggedShard, ragged_from_local
from lightning_vescale.planner import LayoutPlan, TensorSpec, plan_layout

# Layer 2-3: the engine.
from lightning_vescale.dbuffer import DBuffer
from lightning_vescale.fsdp import (
    CPUOffloadPolicy,
    CommPolicy,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

# Layer 5: Lightning and Fabric, imported on first access (PEP 562 ``__getattr__`` below).
from lightning_vescale._lightning.registry import register_lazily as _register_lazily

if TYPE_CHECKING:
    from lightning_vescale.callbacks import MemoryProfiler
    from lightning_vescale.fabric import VeScaleFabricStrategy
    from lightning_vescale.precision import VeScaleFabricPrecision, VeScalePrecision
    from lightning_vescale.strategy import VeScaleFSDPStrategy
    from lightning_vescale.dryrun import dry_run

#: layer-5 name -> the module that defines it
_LAZY = {
    "MemoryProfiler": "lightning_vescale.callbacks",
    "VeScaleFabricStrategy": "lightning_vescale.fabric",
    "VeScaleFabricPrecision": "lightning_vescale.precision",
    "VeScalePrecision": "lightning_vescale.precision",
    "VeScaleFSDPStrategy": "lightning_vescale.strategy",
    # the dry run (fake process group, FakeTensors): a tool, imported when asked for
    "dry_run": "lightning_vescale.dryrun",
}

# Trainer: "vescale_fsdp", "vescale_fsdp_spawn", "vescale_fsdp_fork"; Fabric: "vescale_fsdp".
# Registering again (e.g. after a reload) changes nothing.
_register_lazily()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later accesses skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CPUOffloadPolicy",
    "CommPolicy",
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
    "dry_run",
    "fully_shard",
    "plan_layout",
    "ragged_from_local",
    "register_fsdp_forward_method",
]
