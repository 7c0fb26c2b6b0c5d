"""``distribute_tensor`` bound by name before ``lightning_vescale`` was imported still answers
RaggedShard placements (design note [ragged-compat]); the world runs in a fresh interpreter, see
``scripts/distribute_tensor_import_order.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "distribute_tensor_import_order.py"


def test_distribute_tensor_imported_before_lightning_vescale():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-3000:] + proc.stderr[-6000:])
