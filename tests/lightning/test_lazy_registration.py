"""``strategy="vescale_fsdp"`` resolves after ``import lightning_vescale``, whichever of Lightning
and lightning_vescale is imported first (design note [lazy-registration])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

import lightning_vescale
from lightning_vescale import VeScaleFabricStrategy, VeScaleFSDPStrategy
from lightning_vescale._lightning.registry import FABRIC_ENTRIES, TRAINER_ENTRIES

ROOT = Path(__file__).resolve().parents[2]

_RESOLVE = """
import sys
{first}
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI  # noqa: F401 (the CLI's imports too)
for name, launcher in [("vescale_fsdp", "_SubprocessScriptLauncher"),
                       ("vescale_fsdp_spawn", "VeScaleMultiProcessingLauncher"),
                       ("vescale_fsdp_fork", "VeScaleMultiProcessingLauncher")]:
    t = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert type(t.strategy).__name__ == "VeScaleFSDPStrategy", (name, t.strategy)
    assert launcher in [c.__name__ for c in type(t.strategy.launcher).__mro__], (
        name, t.strategy.launcher)
f = Fabric(strategy="vescale_fsdp", accelerator="cpu", devices=2)
assert type(f.strategy).__name__ == "VeScaleFabricStrategy", f.strategy
import lightning_vescale
assert type(f.strategy) is lightning_vescale.VeScaleFabricStrategy
print("ok")
"""


@pytest.mark.parametrize(
    "first", ["import lightning_vescale\nassert 'lightning' not in sys.modules",
              "import lightning\nimport lightning_vescale"],
    ids=["vescale-first", "lightning-first"])
def test_names_resolve_whatever_the_import_order(first):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _RESOLVE.format(first=first)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_lazy_entries_are_the_classes_entries():
    for lazy, cls in ((TRAINER_ENTRIES, VeScaleFSDPStrategy),
                      (FABRIC_ENTRIES, VeScaleFabricStrategy)):
        assert [(e.name, e.description, e.init_kwargs) for e in lazy] == \
            [tuple(e) for e in cls._registry_entries]
        assert all(getattr(lightning_vescale, e.cls) is cls for e in lazy)


def test_registries_hold_the_names():
    assert {e.name for e in TRAINER_ENTRIES} <= set(StrategyRegistry.available_strategies())
    assert "vescale_fsdp" in FABRIC_STRATEGIES.available_strategies()


def test_lazy_layer5_names():
    assert set(lightning_vescale.__all__) <= set(dir(lightning_vescale))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lightning_vescale.nope  # noqa: B018
