"""``benchmarks/_gpu_one.py``: the GPU check's phases that one GPU can run, checked on CPU.

``python -m benchmarks.gpu_check --device cpu`` runs them end to end at toy size (two gloo ranks
on CPU tensors, torch's fake group at world 8 with a tiny GPT, one fresh process per engine);
the pieces that judge a GPU run (host-sync counting, the fake-world verdict) are checked here
directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import _gpu_one as one

ROOT = Path(__file__).resolve().parents[2]


def test_sync_counter_counts_host_copies_by_phase():
    cpu = torch.device("cpu")
    counter = one.SyncCounter(cpu)
    t = torch.arange(3.0)
    with counter:
        counter.phase = "forward"
        t.sum().item()
        t.max().item()
        t.cpu()  # a copy, but no sync on the CPU
        counter.phase = "optimizer"
        bool(t[0] == 0)
        _ = t + 1  # not a host copy
    assert counter.counts == {"forward": 2, "optimizer": 1}
    other = one.SyncCounter(torch.device("meta"))  # only the given device's copies count
    with other:
        t.sum().item()
    assert other.counts == {}


def test_backward_blocks_is_not_judged_on_the_cpu():
    w = torch.ones(3, requires_grad=True)
    assert one.backward_blocks((w * 2).sum(), torch.device("cpu")) == {"blocks": None}
    assert torch.equal(w.grad, torch.full((3,), 2.0))  # backward ran
    counter = one.SyncCounter(torch.device("cpu"))
    with counter:
        counter.phase = "backward"
        loss = (w * w[0].item()).sum()  # a host read outside backward()
        one.backward_blocks(loss, torch.device("cpu"), counter)
        assert counter.phase == "backward"  # restored for the caller
    assert counter.counts == {"backward": 1}


def _res(engine: str, growth: int, blocks: bool | None) -> dict:
    bwd = {"blocks": blocks} if blocks is None else {"blocks": blocks, "returned_ms": 5.0,
                                                     "done_ms": 900.0}
    return {"engine": engine, "params": 1_300_000_000, "after_shard": 2**30, "peak": 4 * 2**30,
            "allocated": [2**30, 2**30], "growth": growth, "syncs_per_step": {"optimizer": 1},
            "backward": bwd}


def test_fake_world_verdict():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    row = one.fake_row(_res("vescale", 0, False), gpu)
    assert row["status"] == "PASS" and "1.30B params" in row["detail"]
    assert "returns early (5 ms of 900 ms queued)" in row["detail"]
    assert "host syncs per step: optimizer 1" in row["detail"]
    assert one.fake_row(_res("vescale", 2**30, False), gpu)["status"] == "FAIL"  # grows
    assert one.fake_row(_res("vescale", 0, True), gpu)["status"] == "FAIL"  # blocks the host
    assert one.fake_row(_res("fsdp2", 0, True), gpu)["status"] == "PASS"  # the reference
    assert one.fake_row(_res("vescale", 2**30, None), cpu)["status"] == "PASS"  # RSS: not judged
    err = one.fake_row({"engine": "fsdp2", "error": "Traceback: boom"}, gpu)
    assert err["status"] == "FAIL" and "boom" in err["detail"]


def test_nccl_refusal_row_is_skipped_with_its_reason_on_the_cpu(tmp_path):
    row = one.check_nccl_duplicate(str(tmp_path), torch.device("cpu"))
    assert row["status"] == "SKIP" and "fake process group" in row["detail"]


@pytest.mark.slow  # three fresh interpreters: two gloo ranks, then one per fake-world engine
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "RESULTS_cpu.md"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu",
                           "--output", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # each row printed as it finished, before the table
    printed = proc.stdout.split("# GPU check")[0]
    for check in ("NCCL with 2 ranks on one GPU", "gloo collectives on cpu tensors",
                  "fp32 parity vs single device", "async path (prefetch on vs off)",
                  "HSDP meshes vs single device", "int8 all-gather + bf16 gradients",
                  "Muon / SOAP owner exchange vs one process", "fake world 8: vescale",
                  "fake world 8: fsdp2"):
        assert check in printed, printed
    rows = {line.split(" | ")[1]: line.split(" | ")[2]
            for line in out.read_text().splitlines() if line.startswith("| 2 on") or
            line.startswith("| fake")}
    assert rows.pop("NCCL with 2 ranks on one GPU") == "SKIP"
    assert set(rows.values()) == {"PASS"}, rows
    assert len(rows) == 8, rows
    text = out.read_text()
    assert "refuse or wrong: none" in text  # gloo takes every probed collective on CPU
    assert "Muon 0.0e+00" in text or "Muon " in text
    assert "host syncs per step" in text and "backward(): n/a on the CPU" in text
