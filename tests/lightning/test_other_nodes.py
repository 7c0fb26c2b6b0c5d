"""A multi-node start that no other node can join fails at once, naming the commands that work
(design note [other-nodes]); a start that may be right says what it waits for.

Before: ``Trainer(devices=2, num_nodes=2)`` run as ``python script.py`` waited the whole
process-group timeout printing only ``MEMBER: 1/4, 2/4``.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest
from lightning.fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from lightning_vescale._lightning import other_nodes

ROOT = Path(__file__).resolve().parents[2]

#: The process-group timeout of the script: without the check its ranks would wait this long
#: for the 2 missing processes and then fail with a timeout, not with our error.
_PG_TIMEOUT_S = 20

_SCRIPT = textwrap.dedent(f"""
    from datetime import timedelta

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_vescale import VeScaleFSDPStrategy

    strategy = VeScaleFSDPStrategy(timeout=timedelta(seconds={_PG_TIMEOUT_S}))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, num_nodes=2,
                         max_steps=1, logger=False, enable_checkpointing=False)
    trainer.fit(BoringModel())
""")


def _env_without_launcher() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MASTER_", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "RANK",
                                "GROUP_RANK", "TORCHELASTIC", "SLURM_", "STANDALONE_PORT"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_plain_python_with_num_nodes_fails_before_any_rank_waits(tmp_path):
    """What matters is *how* it fails, not how fast (no test asserts a duration): by our error,
    raised before any process started or joined a process group, not by the process-group
    timeout. The ``subprocess`` timeout only keeps a regression from hanging the suite: the
    script's ranks would time out after ``_PG_TIMEOUT_S`` anyway."""
    script = tmp_path / "two_nodes.py"
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=_env_without_launcher())
    err = proc.stderr
    assert proc.returncode != 0
    assert "RuntimeError: " in err and "num_nodes=2 with devices=2 needs 4 processes" in err, \
        err[-2000:]
    assert "torchrun --nnodes 2 --nproc-per-node 2" in err
    assert "srun --nodes 2 --ntasks-per-node 2" in err
    # no rank started, none joined a process group, nothing waited or timed out
    for sign in ("MEMBER", "Initializing distributed", "still waiting", "imed out",
                 "DistStoreError", "DistNetworkError"):
        assert sign not in err, (sign, err[-2000:])


@pytest.mark.parametrize("env_vars", [{"MASTER_PORT": "29512"}, {"STANDALONE_PORT": "29512"}])
def test_a_port_the_others_can_be_told_is_accepted(monkeypatch, env_vars):
    for key in ("MASTER_PORT", "STANDALONE_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env_vars.items():
        monkeypatch.setenv(key, value)
    other_nodes.check_other_nodes_can_join(LightningEnvironment(), num_nodes=2, devices=2)


def test_launchers_and_single_nodes_are_never_refused(monkeypatch):
    for key in ("MASTER_PORT", "STANDALONE_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    other_nodes.check_other_nodes_can_join(LightningEnvironment(), num_nodes=1, devices=8)
    other_nodes.check_other_nodes_can_join(TorchElasticEnvironment(), num_nodes=4, devices=8)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the user launches every process
    other_nodes.check_other_nodes_can_join(LightningEnvironment(), num_nodes=2, devices=2)
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(RuntimeError, match="num_nodes=1"):
        other_nodes.check_other_nodes_can_join(LightningEnvironment(), num_nodes=2, devices=1)


def test_waiting_for_other_nodes_says_what_it_waits_for(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29513")
    err = io.StringIO()
    with redirect_stderr(err):
        with other_nodes.waiting_for_other_nodes(LightningEnvironment(), num_nodes=2, devices=2,
                                                 global_rank=0, every_s=0.05):
            time.sleep(0.3)
    text = err.getvalue()
    assert "rank 0: still waiting" in text and "all 4 processes" in text
    assert "127.0.0.1:29513" in text and "torchrun --nnodes 2" in text
    assert not any(t.name == "lightning_vescale-wait-for-nodes" for t in threading.enumerate())
    quiet = io.StringIO()
    with redirect_stderr(quiet):
        with other_nodes.waiting_for_other_nodes(LightningEnvironment(), num_nodes=1, devices=2,
                                                 global_rank=0, every_s=0.01):
            time.sleep(0.05)
    assert quiet.getvalue() == ""
