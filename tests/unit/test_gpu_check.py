"""``benchmarks/gpu_check.py`` runs unchanged where there is no GPU.

Without CUDA, ``main`` must skip with a message and return 0 (writing nothing). Its rank-side
checks are device-agnostic, so they run here on CPU/gloo (world 1 and 2) on tiny models: the
code path a GPU run takes, minus NCCL and the CUDA memory counters. The report renders.
"""

from __future__ import annotations

import pytest
import torch

from lightning_vescale._gloo_exchange import unfused
from benchmarks import gpu_check
from tests.harness import run_distributed

TINY = gpu_check.ThroughputConfig(n_layer=1, n_embd=32, n_head=2, seq=16, batch=2, steps=2,
                                  warmup=1)


def test_main_skips_cleanly_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "RESULTS_gpu.md"
    assert gpu_check.main(["--output", str(out)]) == 0
    assert "skipped: no CUDA device" in capsys.readouterr().out
    assert not out.exists()


def test_mfu_arithmetic():
    f = gpu_check.flops_per_token(1_000_000, 2, 64, 128)
    assert f == 6e6 + 12 * 2 * 64 * 128
    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_check.peak_tflops("Some Unknown GPU") is None
    assert gpu_check.mfu(1000.0, 1e9, 100.0, 2) == pytest.approx(1000 * 1e9 / 200e12)
    assert gpu_check.mfu(1000.0, 1e9, None, 1) is None


def test_world_1_rows_that_would_take_the_local_shortcut_say_skip():
    gpu = torch.device("cuda", 0)
    for fn in (gpu_check.check_parity, gpu_check.check_async, gpu_check.check_quantized_comm):
        row = gpu_check.shortcut_skip(fn, gpu, 1)
        assert row["status"] == "SKIP" and "local-copy shortcut" in row["detail"]
        assert "2 on 1 device (gloo)" in row["detail"]
        assert gpu_check.shortcut_skip(fn, gpu, 2) is None  # real collectives
        assert gpu_check.shortcut_skip(fn, torch.device("cpu"), 1) is None  # gloo: runs
    assert gpu_check.shortcut_skip(gpu_check.check_bf16, gpu, 1) is None  # numerics: runs


@unfused()  # the GPU script's checks count bytes by collective kind, as on NCCL (design note [gloo-fused-exchange])
def _checks_body(out_dir: str):
    import torch.distributed as dist

    from benchmarks._gpu_launch import row_reporter

    report = row_reporter(out_dir, dist.get_rank(), dist.get_world_size())
    return gpu_check.run_checks(torch.device("cpu"), TINY, report=report)


@pytest.mark.parametrize("world_size", [1, 2])
def test_checks_run_on_cpu(world_size, tmp_path):
    from benchmarks._gpu_launch import read_rows

    results = run_distributed(_checks_body, world_size, str(tmp_path), timeout=600)
    res = results[0]
    reported = [(r["check"], r["status"]) for r in read_rows(tmp_path)["rows"]]
    assert reported == [(r["check"], r["status"]) for r in res["rows"]]  # each as it finished
    status = {r["check"]: r["status"] for r in res["rows"]}
    assert status["fp32 parity vs single device"] == "PASS", res["rows"]
    assert status["bf16-mixed"] == "PASS", res["rows"]
    assert status["async path (prefetch on vs off)"] == "PASS", res["rows"]
    assert status["CPU offload"] == "SKIP", res["rows"]
    assert status["int8 all-gather + bf16 gradients (CommPolicy)"] == "PASS", res["rows"]
    # the CUDA-path rows (issue 28): what the CPU has runs, streams and overlap need CUDA
    assert status["CPU offload + gradient accumulation + full state dict"] == "PASS", res["rows"]
    assert status["CPU-built model + fully_shard"] == "PASS", res["rows"]
    assert status["fp16 + ShardedGradScaler + offload"] == "PASS", res["rows"]
    assert status["set_post_optim_event (side-stream optimizer)"] == "SKIP", res["rows"]
    assert status["reduce-scatter overlaps backward GEMMs"] == "SKIP", res["rows"]
    assert status["HSDP meshes vs single device"] == ("PASS" if world_size > 1 else "SKIP"), \
        res["rows"]
    # CPU offload in collectives: gloo takes CPU tensors (the copy-free path), same values
    assert status["offloaded (CPU) tensors in collectives (mesh.*_anywhere)"] == "PASS", \
        res["rows"]
    assert status["Muon / SOAP / AdamW8bit + CPU offload"] == "PASS", res["rows"]
    assert status["optimizer-state reshard + load with offload"] == (
        "PASS" if world_size > 1 else "SKIP"), res["rows"]
    engines = [p["engine"] for p in res["perf"]]
    assert engines == ["vescale", "vescale-flat", "fsdp2"], res["perf"]
    assert all("error" not in p and p["tokens_per_s"] > 0 for p in res["perf"]), res["perf"]
    text = gpu_check.render({world_size: res}, gpu_check.check_snapshot("/nonexistent"), TINY,
                            "python -m benchmarks.gpu_check")
    assert "| vescale / fsdp2 |" in text and "| vescale-flat / fsdp2 |" in text
    assert "MemoryProfiler allocator snapshot | SKIP" in text
