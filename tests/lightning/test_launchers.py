"""The user-facing launch paths, as subprocesses: the README example (Lightning's subprocess
launcher re-runs the script per rank) and torchrun (processes created externally).

These cannot run in-process: the subprocess launcher re-executes ``sys.argv`` (under pytest it
would re-launch pytest), so each test starts a fresh interpreter (~5-10 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lightning._lit import assert_close_losses, losses

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_readme_example_runs_with_the_default_launcher():
    out = subprocess.run(
        [sys.executable, "examples/train_gpt.py", "--max-steps", "4", "--no-ddp"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "vescale_fsdp x2: loss" in out.stdout and "in 4 steps" in out.stdout


@pytest.mark.slow
def test_torchrun_matches_fork_launcher(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "tests/lightning/scripts/torchrun_fit.py", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK 2" in out.stdout
    # same run with the fork launcher in-process
    import lightning.pytorch as pl

    from tests.lightning._lit import TinyGPT, dataloader, trainer

    pl.seed_everything(0, verbose=False)
    trainer("vescale_fsdp_fork", max_steps=2).fit(TinyGPT(out_dir=str(tmp_path), tag="fork"),
                                                  dataloader())
    assert_close_losses(losses(tmp_path, "torchrun"), losses(tmp_path, "fork"), rtol=1e-6)
