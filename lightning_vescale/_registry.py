"""Layer 5 (private): make ``strategy="vescale_fsdp"`` resolve in the Trainer and in Fabric.

Lightning has no entry point for third-party strategies: names resolve only after they are
registered, so ``lightning_vescale/__init__.py`` calls :func:`register_strategies` on import.
Registering is idempotent (a second call, e.g. after a reload, changes nothing).

Trainer names: ``"vescale_fsdp"`` (subprocess launcher, like ``"ddp"``), ``"vescale_fsdp_spawn"``
and ``"vescale_fsdp_fork"`` (started from the current process, like ``"ddp_spawn"``/``"ddp_fork"``).
Fabric name: ``"vescale_fsdp"``.
"""

from __future__ import annotations

__all__ = ["register_strategies"]


def register_strategies() -> None:
    """Register the strategies in Lightning's ``StrategyRegistry`` and Fabric's registry."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_vescale.fabric import VeScaleFabricStrategy
    from lightning_vescale.strategy import VeScaleFSDPStrategy

    VeScaleFSDPStrategy.register_strategies(StrategyRegistry)
    VeScaleFabricStrategy.register_strategies(FABRIC_REGISTRY)
