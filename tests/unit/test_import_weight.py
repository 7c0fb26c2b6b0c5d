"""Importing the engine does not import Lightning (design note [lazy-registration]).

A fresh interpreter per check: ``sys.modules`` of this process already holds everything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_engine_packages_do_not_import_lightning():
    # each import runs the package __init__ first; one process covers them all (any of them
    # importing lightning leaves it in sys.modules)
    code = ("import sys\n"
            "import lightning_vescale.planner\n"
            "assert 'lightning' not in sys.modules, 'planner'\n"
            "import lightning_vescale.placement, lightning_vescale.fsdp, lightning_vescale.optim\n"
            "import lightning_vescale.checkpoint, lightning_vescale.dbuffer, lightning_vescale\n"
            "from lightning_vescale import fully_shard, RaggedShard, plan_layout\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'lightning')\n"
            "assert not bad, bad[:5]\n")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
