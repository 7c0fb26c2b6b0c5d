"""Smoke tests of ``benchmarks/trainer_vs_ddp.py`` (structure and thread counts, never timings).

The script runs each side as a fresh command with Lightning's default launcher and
``OMP_NUM_THREADS`` unset, so its rows also show every rank's thread count: ours must equal
DDP's (issue 33: ours gave all cores to every rank but 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import pytest
import torch

from benchmarks import trainer_vs_ddp
from tests.examples.test_examples import run


@pytest.mark.parametrize("model", ["llama", "gpt2", "mixtral"])
def test_every_hf_model_builds_and_trains_a_step(model):
    pytest.importorskip("transformers")
    sizes = argparse.Namespace(vocab=64, layers=1, hidden=16, seq=8)
    net = trainer_vs_ddp._hf_model(model, sizes)
    x = torch.randint(0, 64, (2, 8))
    net(input_ids=x, labels=x).loss.backward()


@pytest.mark.slow  # four fresh 2-rank commands: the second CI step
def test_benchmark_runs_tiny():
    models = "llama,litgpt" if importlib.util.find_spec("litgpt") else "llama"
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    out = run([sys.executable, "-m", "benchmarks.trainer_vs_ddp", "--models", models,
               "--runs", "1", "--steps", "2", "--warmup", "1", "--hidden", "16", "--layers",
               "1", "--vocab", "64", "--seq", "8", "--batch", "2"], timeout=600)
    assert "load average before" in out and "load average after" in out
    assert "OMP_NUM_THREADS: unset" in out
    rows = [line.split("|")[1:-1] for line in out.splitlines()
            if line.startswith("| llama") or line.startswith("| litgpt")]
    assert len(rows) == len(models.split(",")), out
    assert rows[0][0].strip() == "llama, ours in 2 groups", rows  # one block, then the root
    for name, ddp_ms, ours_ms, ratio, losses, threads in rows:
        assert float(ddp_ms) > 0 and float(ours_ms) > 0 and ratio.strip().endswith("x")
        ddp_threads, ours_threads = threads.split(" / ")
        assert ddp_threads.strip() == ours_threads.strip(), (name, threads)  # per rank
        ddp_loss, ours_loss = (float(v) for v in losses.split(" / "))
        assert abs(ddp_loss - ours_loss) <= 1e-4 * abs(ddp_loss), (name, losses)


@pytest.mark.slow  # two fresh 2-rank commands
def test_one_group_runs_tiny():
    """``--one-group``: ours with ``sharding_units=[]`` (the whole model one group) trains the
    same losses as DDP; the header says which grouping ours used."""
    pytest.importorskip("transformers")
    out = run([sys.executable, "-m", "benchmarks.trainer_vs_ddp", "--models", "llama",
               "--runs", "1", "--steps", "2", "--warmup", "1", "--hidden", "16", "--layers",
               "1", "--vocab", "64", "--seq", "8", "--batch", "2", "--one-group"], timeout=600)
    assert "ours: one sharding group" in out, out
    (row,) = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| llama")]
    assert row[0].strip() == "llama, ours in 1 group", row  # counted by the worker
    ddp_loss, ours_loss = (float(v) for v in row[4].split(" / "))
    assert abs(ddp_loss - ours_loss) <= 1e-4 * abs(ddp_loss), row


def test_profile_categories():
    """``--profile``'s breakdown: each profiled function lands in its category, the collectives
    (C functions of c10d) and the engine included; the totals are per step."""
    import cProfile
    import pstats

    cat = trainer_vs_ddp._category
    assert cat("~", "<built-in method torch._C._distributed_c10d.wait>").startswith("collectives")
    assert cat("/x/lightning_vescale/fsdp/_state.py", "_pre_forward").startswith("engine")
    assert cat("/x/lightning_vescale/strategy.py", "f").startswith("strategy")
    assert cat("/x/site-packages/lightning/pytorch/loops/x.py", "f").startswith("Lightning")
    assert cat("/x/site-packages/torch/optim/adamw.py", "step").startswith("optimizer")
    assert cat("~", "<built-in method torch.mm>").startswith("operators")
    prof = cProfile.Profile()
    prof.enable()
    torch.ones(3).sum()
    prof.disable()
    out = trainer_vs_ddp._profile_breakdown(pstats.Stats(prof), steps=2)
    assert out and all(v >= 0 for v in out.values())
