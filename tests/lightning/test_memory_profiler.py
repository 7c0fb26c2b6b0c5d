"""MemoryProfiler: the breakdown adds up, metrics reach the loggers, the plot marks the phases.

References are independent of the code under test: byte sizes come from ``numel *
element_size`` of the parameters / gradients / Adam states (or the allocated sizes of the engine's
storages), never from the accounting functions.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_vescale.callbacks._memory_accounting import (
    account,
    collect_training_tensors,
)
from lightning_vescale.callbacks._memory_device import DeviceMemory
from lightning_vescale.callbacks.memory import PHASES, MemoryProfiler
from tests.lightning._memory_profiler_run import Blocks, Expect, fit_and_dump


# ------------------------------------------------------------------------------------------------
# pure accounting
# ------------------------------------------------------------------------------------------------
def test_account_counts_each_storage_byte_once_in_priority_order():
    flat = torch.zeros(100)  # a "DBuffer": params are views into it
    p1, p2 = flat[0:10], flat[5:30]  # overlapping views: 30 distinct elements
    grad = torch.zeros(7, dtype=torch.float64)
    state = [grad, torch.zeros(3, 4)]  # a state aliasing a gradient is counted once (as grad)
    out = account(device="cpu", params_sharded=[p1, p2, p1.view(2, 5)], grads=[grad],
                  optimizer_states=state, comm_buffers=[flat, None, "not a tensor"])
    assert out.params_sharded == 30 * 4
    assert out.grads == 7 * 8
    assert out.optimizer_states == 12 * 4
    assert out.comm_buffers == (100 - 30) * 4  # only the part no parameter views
    assert out.total == flat.nbytes + grad.nbytes + 12 * 4


def test_account_strided_meta_and_off_device_tensors():
    base = torch.zeros(4, 6)
    col = base[:, 1]  # strided view spans rows 0..3 of the storage
    meta = torch.empty(1000, device="meta")
    out = account(device="meta", params_unsharded=[meta])
    assert out.total == 0 and out.off_device == 0  # meta tensors hold no memory
    out = account(device="cpu", params_unsharded=[col], grads=[base])
    assert out.params_unsharded == (1 + 3 * 6) * 4  # the span the view can touch
    assert out.params_unsharded + out.grads == base.nbytes
    out = account(device="meta", grads=[base])  # measuring another device: reported apart
    assert out.grads == 0 and out.off_device == base.nbytes


def test_collect_training_tensors_matches_module_and_adam_sizes():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(20, 5))
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(3, 10)).sum().backward()
    opt.step()
    b = account(device="cpu", **collect_training_tensors([m], [opt]))
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    n_tensors = len(list(m.parameters()))
    assert b.params_unsharded == nbytes and b.params_sharded == 0
    assert b.grads == nbytes
    assert b.optimizer_states == 2 * nbytes + 4 * n_tensors  # exp_avg, exp_avg_sq, fp32 step


def test_collect_counts_8bit_optimizer_states():
    from lightning_vescale.optim import AdamW8bit

    m = torch.nn.Linear(256, 64)  # weight: 16384 elements (8-bit states), bias: 64 (fp32 states)
    opt = AdamW8bit(m.parameters(), block_size=256, min_8bit_size=4096)
    m(torch.randn(2, 256)).sum().backward()
    opt.step()
    b = account(device="cpu", **collect_training_tensors([m], [opt]))
    weight = 2 * 16384 * 1 + 2 * (16384 // 256) * 4 + 4  # uint8 codes, fp32 absmax per block, step
    bias = 2 * 64 * 4 + 4
    assert b.optimizer_states == weight + bias


def _dtensor_body():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    local = torch.ones(3 + rank, 4)  # uneven shards: rank r holds 3 + r rows
    sharded = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    replicated = torch.nn.Parameter(DTensor.from_local(torch.ones(5), mesh, [Replicate()]))
    lin = torch.nn.Module()
    lin.a, lin.b = sharded, replicated
    found = collect_training_tensors([lin], [])
    b = account(device="cpu", **found)
    return b.params_sharded, b.params_unsharded, local.nbytes


def test_account_dtensor_counts_local_shards(worlds):
    outs = worlds(2).run(_dtensor_body)
    for sharded, unsharded, local_bytes in outs:
        assert sharded == local_bytes  # the local shard, not the global size
        assert unsharded == 5 * 4  # a replicated DTensor is a full copy
    assert outs[0][0] != outs[1][0]


def test_device_memory_cpu_peak_resets_per_phase():
    mem = DeviceMemory(torch.device("cpu"))
    if not mem.can_reset_peak:
        pytest.skip("this kernel does not let /proc/self/clear_refs reset VmHWM")
    assert mem.reset_peak()
    before = mem.peak()
    x = torch.ones(40 << 20, dtype=torch.uint8)  # 40 MiB, touched
    x.add_(1)
    del x
    assert mem.peak() - before >= 35 << 20
    mem.reset_peak()
    assert mem.peak() - before < 35 << 20  # the old high-water mark is gone


def test_without_proc_peaks_are_unknown_not_wrong(tmp_path, monkeypatch):
    """Non-Linux (no /proc): no per-phase peaks (None / n/a), the rest still works."""
    from lightning_vescale.callbacks import _memory_device

    monkeypatch.setattr(_memory_device, "_STATUS", str(tmp_path / "no-such-status"))
    mem = DeviceMemory("cpu")
    assert not mem.can_reset_peak and mem.reset_peak() is False
    assert mem.current() is None and mem.current_and_peak() == (None, mem.peak())
    assert mem.peak() > 0  # getrusage's lifetime high-water mark, for the record
    prof = MemoryProfiler(every_n_steps=1)
    _fit(tmp_path, prof, logger=False, steps=2)
    assert prof.phase_peaks == {}
    assert all(s.phase_peak is None and s.current is None for s in prof.samples)
    assert all(s.breakdown is not None and s.breakdown.grads >= 0 for s in prof.samples)
    assert "peak: forward" in prof.table and "n/a" in prof.table


# ------------------------------------------------------------------------------------------------
# the callback in a real Trainer
# ------------------------------------------------------------------------------------------------
def _fit(tmp_path, prof, *, logger=True, ckpt=False, steps=4):
    L.seed_everything(0)
    data = TensorDataset(torch.randn(64, 48), torch.randn(64, 1))
    expect = Expect()
    callbacks = [expect, prof]
    if ckpt:
        callbacks.append(ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=1,
        logger=CSVLogger(str(tmp_path / "logs"), name="run") if logger else False,
        callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=ckpt, default_root_dir=str(tmp_path),
    )
    trainer.fit(Blocks(), DataLoader(data, batch_size=8))
    return trainer, expect


def test_single_device_breakdown_metrics_plot(tmp_path):
    prof = MemoryProfiler(every_n_steps=2, plot_dir=str(tmp_path / "plots"))
    trainer, expect = _fit(tmp_path, prof, ckpt=True)
    rows = {r["batch"]: r for r in expect.rows}

    # breakdown adds up, at the end of every profiled optimizer step
    closing = [s for s in prof.samples if s.phase == "optimizer_step"]
    assert [s.batch for s in closing] == [0, 2]
    for s in closing:
        ref = rows[s.batch]
        assert s.breakdown.params_unsharded == ref["params"] and s.breakdown.params_sharded == 0
        assert s.breakdown.grads == ref["grads"]
        assert s.breakdown.optimizer_states == ref["optimizer_states"]
        assert s.breakdown.comm_buffers == 0
        assert s.activations_other == s.current - s.breakdown.total  # never hidden
    # every phase was observed, with a peak (checkpoint_save via ModelCheckpoint)
    assert set(prof.phase_peaks) == set(PHASES)
    assert all(v > 0 for v in prof.phase_peaks.values())
    # unprofiled batches (1, 3) only ever show up as "other"
    assert {s.batch for s in prof.samples if s.phase in ("forward", "backward")} == {0, 2}

    # metrics reached the CSV logger, max/mean over ranks of MiB figures
    path = os.path.join(trainer.logger.log_dir, "metrics.csv")
    with open(path) as f:
        logged = list(csv.DictReader(f))
    assert len(logged) == 2  # batches 0 and 2
    mib = 1 << 20
    for row in logged:
        assert float(row["memory_mib/params_unsharded_max"]) == pytest.approx(
            rows[0]["params"] / mib)
        assert float(row["memory_mib/optimizer_states_mean"]) == pytest.approx(
            rows[0]["optimizer_states"] / mib)
        for name in ("current", "peak", "peak_forward", "peak_backward", "peak_optimizer_step",
                     "activations_other", "grads", "comm_buffers", "params_sharded"):
            assert row[f"memory_mib/{name}_max"] != ""
    assert any(row["memory_mib/peak_checkpoint_save_max"] for row in logged)

    # summary table on rank zero
    assert prof.table is not None and "peak: checkpoint_save" in prof.table
    # on CPU the rest is process memory minus tensors, mostly the runtime: labelled so
    assert "RSS - tensors (runtime)" in prof.table and "optimizer states" in prof.table
    assert "activations/other" not in prof.table and "mostly the torch runtime" in prof.table

    # PNG written and its phase panel names every phase
    png = tmp_path / "plots" / "memory_timeline_rank0.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert prof.written == [str(png)]
    for phase in PHASES:
        assert f"{phase} (peak)" in prof.plot_labels
    # the checkpoint wrapper is gone after fit
    assert "save_checkpoint" not in vars(trainer)


def test_logger_false_prints_table(tmp_path, caplog):
    prof = MemoryProfiler(every_n_steps=1)
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, prof, logger=False, steps=2)
    assert prof.table is not None
    assert "MemoryProfiler summary: 1 rank(s)" in caplog.text
    assert not (tmp_path / "logs").exists()
    # default every_n_steps follows log_every_n_steps (1 here), breakdown off is allowed
    prof2 = MemoryProfiler(breakdown=False, print_table=False)
    _fit(tmp_path / "b", prof2, logger=False, steps=2)
    assert all(s.breakdown is None for s in prof2.samples)
    assert {s.batch for s in prof2.samples if s.phase == "forward"} == {0, 1}


@pytest.mark.parametrize("kwargs, match", [
    ({"every_n_steps": 0}, "every_n_steps"),
    ({"snapshot_on_oom": True}, "snapshot_dir"),
    ({"snapshot_at_step": -1, "snapshot_dir": "x"}, "snapshot_at_step"),
    ({"max_samples": -5}, "max_samples"),
])
def test_constructor_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryProfiler(**kwargs)


def test_missing_matplotlib_gives_install_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ModuleNotFoundError, match=r"lightning-vescale\[plot\]"):
        _fit(tmp_path, MemoryProfiler(plot_dir=str(tmp_path / "p")), logger=False, steps=1)


def test_lightning_cli_builds_the_callback_from_arguments(monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["prog"])  # only ``args`` below, not pytest's arguments
    cli = LightningCLI(Blocks, run=False, args=[
        "--trainer.callbacks+=lightning_vescale.callbacks.MemoryProfiler",
        "--trainer.callbacks.every_n_steps=3", "--trainer.callbacks.plot_dir=plots",
        "--trainer.callbacks.snapshot_at_step=null", "--trainer.accelerator=cpu",
        "--trainer.logger=false", "--trainer.enable_progress_bar=false",
    ])
    (prof,) = [c for c in cli.trainer.callbacks if isinstance(c, MemoryProfiler)]
    assert (prof.every_n_steps, prof.plot_dir, prof.snapshot_at_step) == (3, "plots", None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="allocator snapshots need CUDA")
def test_cuda_snapshot_at_step(tmp_path):  # pragma: no cover - runs on GPU machines only
    prof = MemoryProfiler(every_n_steps=1, snapshot_dir=str(tmp_path / "snap"), snapshot_at_step=1)
    L.seed_everything(0)
    data = TensorDataset(torch.randn(64, 48), torch.randn(64, 1))
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=3, logger=False,
                        callbacks=[prof], enable_progress_bar=False, enable_checkpointing=False)
    trainer.fit(Blocks(), DataLoader(data, batch_size=8))
    assert (tmp_path / "snap" / "batch1_rank0.pickle").exists()
    assert prof.phase_peaks["forward"] > 0


# ------------------------------------------------------------------------------------------------
# world size 2, with fork launchers (the popen ``ddp`` launcher re-runs sys.argv, i.e. pytest;
# ``python tests/lightning/_memory_profiler_run.py ddp OUT`` runs the same case that way)
# ------------------------------------------------------------------------------------------------
def _run_world2(strategy, tmp_path):
    out = tmp_path / strategy
    fit_and_dump(f"{strategy}_fork", str(out))  # each worker writes rank{r}.json
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    return ranks


def _check_csv_and_plots(ranks):
    log_dir = ranks[0]["metrics_dir"]
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    for row in rows:
        for name in ("current", "peak_forward", "grads", "optimizer_states"):
            assert float(row[f"memory_mib/{name}_max"]) >= float(row[f"memory_mib/{name}_mean"])
    assert "MemoryProfiler summary: 2 rank(s)" in ranks[0]["table"]
    assert ranks[1]["table"] is None  # rank zero only
    for r in ranks:  # one PNG per rank
        assert r["written"] and r["written"][0].endswith(f"rank{r['rank']}.png")
        assert os.path.exists(r["written"][0])
        assert "forward (peak)" in r["plot_labels"]


def test_ddp_world2_breakdown_and_csv(tmp_path):
    ranks = _run_world2("ddp", tmp_path)
    for r in ranks:
        exp = {e["batch"]: e for e in r["expected"]}
        assert [p["batch"] for p in r["profiled"]] == [0, 2]
        for got in r["profiled"]:
            ref = exp[got["batch"]]
            assert got["params_unsharded"] == ref["params"] and got["params_sharded"] == 0
            assert got["grads"] == ref["grads"]
            assert got["optimizer_states"] == ref["optimizer_states"]
    _check_csv_and_plots(ranks)


def test_vescale_fsdp_world2_breakdown(tmp_path):
    ranks = _run_world2("vescale_fsdp", tmp_path)
    global_numel = {e["params_global_numel"] for r in ranks for e in r["expected"]}
    assert len(global_numel) == 1
    for b in (0, 2):  # the two ranks' shards cover the model exactly once
        local = [next(e for e in r["expected"] if e["batch"] == b)["params_local_numel"]
                 for r in ranks]
        assert sum(local) == next(iter(global_numel))
    for r in ranks:
        exp = {e["batch"]: e for e in r["expected"]}
        for got in r["profiled"]:
            ref = exp[got["batch"]]
            assert ref["sharded"] and ref["db_count"] > 0
            # parameters: exactly the allocated shard storages (the local shards + padding)
            assert got["params_sharded"] == ref["db_shard"] >= ref["params"]
            assert got["params_unsharded"] == ref["db_full"]  # gathered buffers still alive
            # gradients: the allocated gradient storages, which hold every local gradient
            assert got["grads"] == ref["db_grad"] >= ref["grads"]
            # Adam states are sized like the local shards
            assert got["optimizer_states"] == ref["optimizer_states"]
    _check_csv_and_plots(ranks)
    assert "comm policy" not in ranks[0]["table"]  # none set: no line


def test_vescale_fsdp_table_names_the_comm_policy(tmp_path):
    """The quantized all-gather's codes and scales are communication buffers: the table says
    which policy put them there (format, block, reduce-scatter dtype)."""
    out = tmp_path / "int8"
    fit_and_dump("vescale_fsdp_fork", str(out), comm_policy={
        "all_gather": "int8", "reduce_scatter_dtype": "bf16", "min_numel": 1024})
    table = json.loads((out / "rank0.json").read_text())["table"]
    lines = table.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("communication buffers"))
    assert lines[row + 1] == ("  (comm policy: all-gather int8 (block 256), reduce-scatter "
                              "bfloat16 on the wire, fp32 sums)"), table


# ------------------------------------------------------------------------------------------------
# the engine's DBuffer (layer 2): roles, and views inside it never counted twice
# ------------------------------------------------------------------------------------------------
def _dbuffer_body():
    import gc

    import torch.distributed as dist

    from lightning_vescale.callbacks.memory import engine_tensors
    from lightning_vescale.dbuffer import DBuffer
    from lightning_vescale.planner import plan_layout

    def measure(extra_params=()):
        found, extra = engine_tensors()
        found["params_sharded"] = list(found["params_sharded"]) + list(extra_params)
        return account(device="cpu", extra_comm_bytes=extra, **found)

    gc.collect()
    before = measure()
    plan = plan_layout([("w", (6, 5)), ("b", (7,))], dist.get_world_size())
    buf = DBuffer(plan, dtype=torch.float32, device="cpu")
    shard_bytes = plan.shard_size * 4
    full_bytes = plan.buffer_size * 4
    at_rest = measure([buf.local_view("w"), buf.local_view("b")])  # views into the shard
    buf.all_gather()
    gathered = measure([buf.local_view("w")])
    buf.materialize_grad()
    with_grad = measure()
    buf.reduce_scatter()
    buf.free_grad()
    buf.free()
    reduced = measure()
    d = lambda a, k: getattr(a, k) - getattr(before, k)  # noqa: E731
    return {
        "at_rest": tuple(d(at_rest, k) for k in ("params_sharded", "params_unsharded", "grads")),
        "gathered": (d(gathered, "params_sharded"), d(gathered, "params_unsharded")),
        "with_grad": d(with_grad, "grads"),
        "reduced": (d(reduced, "params_unsharded"), d(reduced, "grads")),
        "sizes": (shard_bytes, full_bytes),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_dbuffer_storage_by_role_without_double_counting(worlds, world_size):
    for out in worlds(world_size).run(_dbuffer_body):
        shard_bytes, full_bytes = out["sizes"]
        assert out["at_rest"] == (shard_bytes, 0, 0)  # the local views are inside the shard
        assert out["gathered"] == (shard_bytes, full_bytes)
        assert out["with_grad"] == full_bytes
        assert out["reduced"] == (0, shard_bytes)  # freed full buffers; the reduced grad shard
