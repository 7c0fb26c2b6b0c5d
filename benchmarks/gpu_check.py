"""One-command GPU check of ``fully_shard``: ``python -m benchmarks.gpu_check``.

Without CUDA it prints why it is skipped and exits 0 (``--device cpu`` runs phase 0 on CPU
tensors at toy size instead). With CUDA:

0. **what one GPU can run** (issue 35, ``benchmarks/_gpu_one.py``): NCCL's refusal of two ranks
   on one GPU, shown once; two processes sharing GPU 0 over gloo with CUDA tensors (which
   collectives gloo takes on them, then parity, prefetch on/off bitwise, HSDP, int8 all-gather
   bytes, Muon/SOAP owner exchange: the asynchronous engine path with real data); torch's fake
   process group at world 8, one fresh process per engine (ours, FSDP2), a ~1.3B GPT with a
   32k vocabulary: per-rank peak memory, growth over steps, host syncs per step, whether
   ``backward()`` blocks the host. About 65% of ``--time-limit``; then

for world size 1 (one GPU, NCCL) and, when there are several GPUs, all of them (one process
per GPU, spawned), rows 1-7 (at world 1 the parity, async and quantized rows say SKIP: one rank
takes the local-copy shortcut for every collective, phase 0 runs them for real):

1. **fp32 parity**: ``fully_shard`` training (a small GPT, one group per block) against
   single-device training on the global batch, TF32 off: max relative loss difference.
2. **bf16-mixed**: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` against
   PyTorch FSDP2 with the same policy and against the fp32 single-device reference.
3. **async path**: on accelerators the engine all-gathers the next group while the current one
   computes (prefetch, asynchronous collectives) and reduce-scatters asynchronously; the same
   run with prefetch off must give the same losses and parameters bitwise.
4. **CPU offload**: the same parity with ``offload_policy=CPUOffloadPolicy()`` if this branch's
   ``fully_shard`` takes it (else the row says it was skipped and why).
5. **the CUDA path** (issue 28, ``benchmarks/_gpu_cuda_path.py``): offload with gradient
   accumulation, a CPU-built model sharded without a mesh (mesh and tensors on the GPU),
   ``set_post_optim_event`` with the optimizer on a side stream behind a sleep kernel (losses
   bitwise equal), fp16 with ``ShardedGradScaler``, ``clip_grad_norm_`` and offload; with 2+
   GPUs, reduce-scatter kernels overlapping backward GEMMs in a profiler trace and HSDP on a
   ``(1, N)`` and an ``(N/2, 2)`` mesh (``(2, 1)`` at N=2) against single-device training.
   At world 1 every collective takes the local shortcut: the NCCL rows need 2+ GPUs.
5b. **CPU offload in collectives** (``benchmarks/_gpu_offload_optim.py``): the
   ``mesh.*_anywhere`` helpers on CPU tensors over NCCL against their expected values (a real
   collective at world 1 too), Muon / SOAP / AdamW8bit with offload against the same runs
   without (states stay on the CPU; owner all-to-alls with 2+ GPUs), and with 2+ GPUs their
   state dicts resharded and loaded back bitwise.
6. **MemoryProfiler snapshot**: a Lightning ``Trainer`` with ``VeScaleFSDPStrategy`` and
   ``MemoryProfiler(snapshot_dir=..., snapshot_at_step=1)`` on one GPU must write a loadable
   allocator snapshot.
7. **throughput** (with 2+ GPUs, or ``--throughput``): a ~1.2B-parameter GPT (24 layers,
   width 2048, sequence 1024, bf16 compute,
   fused AdamW) per engine (vescale, vescale with its AdamW wrapped in ``FlatParamOptimizer``
   as the Lightning strategies do by default, FSDP2): tokens/s, step time, the optimizer step
   alone, MFU (model FLOPs: 6 N + 12 L d T per token, over the GPU's dense bf16 peak) and peak
   allocated/reserved memory.

Everything is written to ``benchmarks/RESULTS_gpu.md`` (with the command, versions and GPU).
Each row's verdict is printed the moment it is known, and ``--time-limit`` (default 280 s)
bounds the whole run: a world past its share is killed and reported with the rows it finished,
and a hung collective fails its row after 90 s (``benchmarks/_gpu_launch.py``).
``--quick`` shrinks the throughput model for a smoke run. The rank-side functions take a
device and a backend, so ``tests/unit/test_gpu_check.py`` runs them on CPU/gloo too.
"""

from __future__ import annotations

import argparse
import datetime
import math
import inspect
import json
import os
import pickle
import platform
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from benchmarks._gpu_cuda_path import CHECKS as CUDA_PATH_CHECKS
from benchmarks._gpu_launch import COLLECTIVE_TIMEOUT, read_rows, row_reporter, spawn_within
from benchmarks._gpu_offload_optim import CHECKS as OFFLOAD_OPTIM_CHECKS
from benchmarks._gpu_one import FAKE_TOY, SHARED_LABEL, FakeConfig, run_phases
from examples.gpt import GPT, GPTConfig

RESULTS = Path(__file__).with_name("RESULTS_gpu.md")

#: Dense bf16 peak TFLOP/s by GPU name fragment (vendor data sheets, SXM parts).
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L40": 181.0,
                    "L4": 121.0, "A10G": 70.0, "A10": 125.0, "B200": 2250.0, "V100": 125.0}

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: Throughput engines: ``fully_shard`` with torch's AdamW, the same wrapped in
#: ``FlatParamOptimizer`` (the strategies' default), and PyTorch FSDP2.
ENGINES = ("vescale", "vescale-flat", "fsdp2")
ENGINES_OURS = ("vescale", "vescale-flat")


@dataclass(frozen=True, kw_only=True)
class ThroughputConfig:
    """The throughput model and run (defaults: ~1.2B parameters)."""

    n_layer: int = 24
    n_embd: int = 2048
    n_head: int = 16
    seq: int = 1024
    batch: int = 4  # per rank
    steps: int = 10
    warmup: int = 3


QUICK = ThroughputConfig(n_layer=4, n_embd=512, n_head=8, seq=256, batch=4, steps=5, warmup=2)
SMALL = dict(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)  # parity model


# ------------------------------------------------------------------------------------------------
# pure helpers
# ------------------------------------------------------------------------------------------------
def flops_per_token(n_params: int, n_layer: int, n_embd: int, seq: int) -> float:
    """Training FLOPs per token: ``6 N`` (matmuls, forward + backward) plus attention's
    ``12 L d T`` (PaLM, appendix B; ``N`` without the embeddings)."""
    return 6.0 * n_params + 12.0 * n_layer * n_embd * seq


def peak_tflops(device_name: str) -> float | None:
    """The GPU's dense bf16 peak, or ``None`` when its name is not in the table."""
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in device_name:
            return value
    return None


def mfu(tokens_per_s: float, flops_tok: float, peak: float | None, world: int) -> float | None:
    """Model FLOPs utilisation of ``world`` GPUs (``None`` without a known peak)."""
    if not peak:
        return None
    return tokens_per_s * flops_tok / (peak * 1e12 * world)


def _row(name: str, status: str, detail: str, **values: Any) -> dict[str, Any]:
    return {"check": name, "status": status, "detail": detail, **values}


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------
# rank-side checks (device-agnostic: CUDA + NCCL here, CPU + gloo in the unit test)
# ------------------------------------------------------------------------------------------------
def _batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _micro(t: torch.Tensor) -> torch.Tensor:
    rank, world = dist.get_rank(), dist.get_world_size()
    b = t.shape[0] // world
    return t[rank * b:(rank + 1) * b]


def _shard(model: torch.nn.Module, engine: str, device: torch.device, **kw) -> torch.nn.Module:
    if engine in ENGINES_OURS:
        from lightning_vescale.fsdp import fully_shard
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]

        kw["mesh"] = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def _train(model, steps, device, *, sharded: bool, seed: int = 0) -> tuple[list[float], Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    losses = []
    world = dist.get_world_size()
    for x, y in _batches(steps, 2 * world, SMALL["block_size"], SMALL["vocab_size"], seed):
        if sharded:
            x, y = _micro(x), _micro(y)
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().float().clone()
        if sharded:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
    return losses, opt


def _small(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL)).to(device)


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        out[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
    return out


def check_parity(device: torch.device, steps: int = 5, tol: float = 1e-5) -> dict[str, Any]:
    """fp32 ``fully_shard`` vs single-device training on the global batch."""
    ref_losses, _ = _train(_small(device), steps, device, sharded=False)
    losses, _ = _train(_shard(_small(device), "vescale", device), steps, device, sharded=True)
    d = _rel(losses, ref_losses)
    return _row("fp32 parity vs single device", PASS if d <= tol else FAIL,
                f"max relative loss difference {d:.2e} over {steps} steps (tolerance {tol:g})",
                max_rel=d)


def check_bf16(device: torch.device, steps: int = 5, tol: float = 2e-2) -> dict[str, Any]:
    """bf16 compute, fp32 reduce: vescale vs FSDP2 (same policy) and vs the fp32 reference."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    from lightning_vescale.fsdp import MixedPrecisionPolicy

    ref_losses, _ = _train(_small(device), steps, device, sharded=False)
    ours, _ = _train(_shard(_small(device), "vescale", device, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), steps, device, sharded=True)
    theirs, _ = _train(_shard(_small(device), "fsdp2", device, mp_policy=FSDP2Policy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), steps, device, sharded=True)
    d_fsdp2, d_ref = _rel(ours, theirs), _rel(ours, ref_losses)
    ok = d_ref <= tol and all(math.isfinite(v) for v in ours)
    return _row("bf16-mixed", PASS if ok else FAIL,
                f"vs FSDP2 (same policy) {d_fsdp2:.2e}, vs fp32 single device {d_ref:.2e} "
                f"(tolerance {tol:g})", vs_fsdp2=d_fsdp2, vs_ref=d_ref)


def check_async(device: torch.device, steps: int = 5) -> dict[str, Any]:
    """Prefetch + asynchronous collectives give the same result as the synchronous schedule."""
    on = _shard(_small(device), "vescale", device)
    off = _shard(_small(device), "vescale", device)
    off.set_prefetch(False)
    l_on, _ = _train(on, steps, device, sharded=True)
    l_off, _ = _train(off, steps, device, sharded=True)
    p_on, p_off = _full_params(on), _full_params(off)
    same = l_on == l_off and all(torch.equal(p_on[n], p_off[n]) for n in p_on)
    return _row("async path (prefetch on vs off)", PASS if same else FAIL,
                "losses and parameters bitwise equal" if same else
                f"differ: max relative loss difference {_rel(l_on, l_off):.2e}")


def check_offload(device: torch.device, steps: int = 5, tol: float = 1e-5) -> dict[str, Any]:
    """CPU offload parity, when this branch's ``fully_shard`` has an ``offload_policy``."""
    import lightning_vescale.fsdp as lvf

    policy_cls = getattr(lvf, "CPUOffloadPolicy", None)
    if policy_cls is None or "offload_policy" not in inspect.signature(lvf.fully_shard).parameters:
        return _row("CPU offload", SKIP, "this branch's fully_shard has no offload_policy "
                    "(CPUOffloadPolicy); nothing to check")
    if device.type == "cpu":
        return _row("CPU offload", SKIP, "needs an accelerator")
    ref_losses, _ = _train(_small(device), steps, device, sharded=False)
    model = _shard(_small(device), "vescale", device, offload_policy=policy_cls())
    losses, _ = _train(model, steps, device, sharded=True)
    d = _rel(losses, ref_losses)
    return _row("CPU offload", PASS if d <= tol else FAIL,
                f"max relative loss difference {d:.2e} vs single device", max_rel=d)


def check_quantized_comm(device: torch.device, steps: int = 5,
                         tol: float = 2e-2) -> dict[str, Any]:
    """``CommPolicy(all_gather="int8", reduce_scatter_dtype=bf16)`` (issue 25) against the
    unquantized run: losses within ``tol``, all-gather and reduce-scatter bytes counted."""
    from lightning_vescale import CommPolicy
    from lightning_vescale._gloo_exchange import unfused
    from lightning_vescale.testing import CopyCommCounter

    policy = CommPolicy(all_gather="int8", reduce_scatter_dtype="bf16")
    plain, _ = _train(_shard(_small(device), "vescale", device), steps, device, sharded=True)
    quant_model = _shard(_small(device), "vescale", device, comm_policy=policy)
    quant, _ = _train(quant_model, steps, device, sharded=True)
    counted = {}
    for label, model in (("plain", _shard(_small(device), "vescale", device)),
                         ("int8", quant_model)):
        x, y = next(iter(_batches(1, 2 * dist.get_world_size(), SMALL["block_size"],
                                  SMALL["vocab_size"])))
        # bytes by collective kind as NCCL issues them: on CPU, gloo's fused exchange of small
        # collectives (design note [gloo-fused-exchange]) would count as all-to-alls
        with unfused(), CopyCommCounter() as c:
            model(_micro(x).to(device), _micro(y).to(device)).backward()
        counted[label] = c.comm_bytes_by_op
    ag = {k: sum(v for op, v in b.items() if "allgather" in op) for k, b in counted.items()}
    ratio = ag["int8"] / ag["plain"] if ag["plain"] else float("nan")
    d = _rel(quant, plain)
    ok = d <= tol and all(math.isfinite(v) for v in quant) and (ratio <= 0.30 or not ag["plain"])
    return _row("int8 all-gather + bf16 gradients (CommPolicy)", PASS if ok else FAIL,
                f"vs unquantized {d:.2e} (tolerance {tol:g}); " + (
                    f"all-gather bytes {ratio:.2f}x" if ag["plain"] else "one rank: no all-gather"),
                max_rel=d, gather_ratio=ratio)


def throughput(engine: str, cfg: ThroughputConfig, device: torch.device) -> dict[str, Any]:
    """Tokens/s, step time, MFU and peak memory of one engine on the throughput model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    from lightning_vescale.fsdp import MixedPrecisionPolicy

    world = dist.get_world_size()
    gcfg = GPTConfig(vocab_size=65, block_size=cfg.seq, n_layer=cfg.n_layer, n_head=cfg.n_head,
                     n_embd=cfg.n_embd)
    with torch.device("meta"):
        model = GPT(gcfg)
    n_params = sum(p.numel() for p in model.parameters())
    n_emb = model.pos_emb.weight.numel() + model.tok_emb.weight.numel()
    torch.manual_seed(0)
    with torch.device(device):  # built on the device: no 5 GB of host init for ~1B
        model = GPT(gcfg)
    policy = (MixedPrecisionPolicy if engine in ENGINES_OURS else FSDP2Policy)(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _shard(model, engine, device, mp_policy=policy)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    if engine == "vescale-flat":
        from lightning_vescale.optim import FlatParamOptimizer

        opt = FlatParamOptimizer(opt)
    data = _batches(cfg.warmup + cfg.steps, cfg.batch, cfg.seq, 65, seed=dist.get_rank())
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    for x, y in data[:cfg.warmup]:
        model(x.to(device), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times, opt_times = [], []
    for x, y in data[cfg.warmup:]:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        model(x, y).backward()
        sync()
        t1 = time.perf_counter()
        opt.step()
        sync()
        opt_times.append(time.perf_counter() - t1)
        opt.zero_grad()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    opt_s = sorted(opt_times)[len(opt_times) // 2]
    tokens_s = cfg.batch * cfg.seq * world / step_s
    flops_tok = flops_per_token(n_params - n_emb, cfg.n_layer, cfg.n_embd, cfg.seq)
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu"
    util = mfu(tokens_s, flops_tok, peak_tflops(name) if cuda else None, world)
    return {"engine": engine, "params": n_params, "median_step_s": step_s,
            "median_optimizer_s": opt_s,
            "tokens_per_s": tokens_s, "mfu": util, "device_name": name,
            "peak_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
            "peak_reserved": torch.cuda.max_memory_reserved(device) if cuda else None}


def shortcut_skip(fn: Callable, device: torch.device, world: int) -> dict[str, Any] | None:
    """The SKIP row for ``fn`` where it would pass without exercising anything, else ``None``:
    one accelerator rank takes the local-copy shortcut for every all-gather/reduce-scatter
    (issue 35); the shared-device world (``_gpu_one``) runs these rows with real collectives.
    (On the CPU world 1 still runs them: gloo there is what the unit test checks.)"""
    if world == 1 and device.type != "cpu" and fn in (check_parity, check_async,
                                                      check_quantized_comm):
        return _row(fn.__name__, SKIP, "world 1 takes the local-copy shortcut for every "
                    f"collective: see the '{SHARED_LABEL}' rows")
    return None


def run_checks(device: torch.device, cfg: ThroughputConfig | None,
               report: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every rank-side check in this world; a failing check is a row, never an abort.
    ``report`` gets each row as soon as it is done (``_gpu_launch.row_reporter``)."""
    rows = []
    for fn in (check_parity, check_bf16, check_async, check_offload, check_quantized_comm,
               *CUDA_PATH_CHECKS, *OFFLOAD_OPTIM_CHECKS):
        try:
            skipped = shortcut_skip(fn, device, dist.get_world_size())
            rows.append(skipped if skipped is not None else fn(device))
        except Exception:  # noqa: BLE001 - report it and go on with the other checks
            rows.append(_row(fn.__name__, FAIL, traceback.format_exc(limit=3)[-800:]))
        if report is not None:
            report(rows[-1])
    perf = []
    if cfg is not None:
        for engine in ENGINES:
            try:
                perf.append(throughput(engine, cfg, device))
            except Exception:  # noqa: BLE001
                perf.append({"engine": engine, "error": traceback.format_exc(limit=3)[-800:]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"rows": rows, "perf": perf}


# ------------------------------------------------------------------------------------------------
# processes
# ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, out_dir: str, cfg: dict | None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device,
                            timeout=COLLECTIVE_TIMEOUT)  # a hung collective fails its row
    try:
        res = run_checks(device, ThroughputConfig(**cfg) if cfg is not None else None,
                         report=row_reporter(out_dir, rank, world))
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def _snapshot_entry(out_dir: str) -> None:
    """A one-GPU Trainer run with MemoryProfiler snapshots (its own process: Lightning sets up
    the process group itself)."""
    import lightning as L

    from lightning_vescale import MemoryProfiler, VeScaleFSDPStrategy

    class LM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = GPT(GPTConfig(**SMALL))

        def training_step(self, batch, batch_idx):  # noqa: ANN001
            return self.model(*batch)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    from torch.utils.data import DataLoader, TensorDataset

    x, y = (torch.cat(t) for t in zip(*_batches(4, 2, SMALL["block_size"],
                                                SMALL["vocab_size"])))
    data = DataLoader(TensorDataset(x, y), batch_size=2)
    snap = Path(out_dir, "snapshots")
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=VeScaleFSDPStrategy(),
                        max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False,
                        callbacks=[MemoryProfiler(snapshot_dir=str(snap), snapshot_at_step=1,
                                                  print_table=False)])
    trainer.fit(LM(), train_dataloaders=data)
    files = sorted(snap.glob("*.pickle"))
    info: dict[str, Any] = {"files": [f.name for f in files]}
    if files:
        with open(files[0], "rb") as fh:  # our own file, just written
            snapshot = pickle.load(fh)  # noqa: S301
        info["segments"] = len(snapshot.get("segments", []))
        info["bytes"] = files[0].stat().st_size
    Path(out_dir, "snapshot.json").write_text(json.dumps(info))


def check_snapshot(out_dir: str, seconds: float = 120.0) -> dict[str, Any]:
    """Run :func:`_snapshot_entry` in a fresh process (at most ``seconds``) and judge it."""
    if not torch.cuda.is_available():
        return _row("MemoryProfiler allocator snapshot", SKIP, "CUDA only")
    try:
        spawn_within(1, _snapshot_entry_wrapper, (out_dir,), max(seconds, 30.0))
        info = json.loads(Path(out_dir, "snapshot.json").read_text())
    except Exception:  # noqa: BLE001
        return _row("MemoryProfiler allocator snapshot", FAIL,
                    traceback.format_exc(limit=3)[-800:])
    ok = bool(info.get("files")) and info.get("segments", 0) > 0
    return _row("MemoryProfiler allocator snapshot", PASS if ok else FAIL,
                f"{info.get('files')} ({info.get('bytes', 0)} bytes, "
                f"{info.get('segments', 0)} segments)")


def _snapshot_entry_wrapper(_rank: int, out_dir: str) -> None:
    _snapshot_entry(out_dir)


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def render(results: dict[Any, dict[str, Any]], snapshot_row: dict[str, Any] | None,
           cfg: ThroughputConfig | None, command: str) -> str:
    """The RESULTS_gpu.md text."""
    import lightning_vescale

    lines = ["# GPU check (`benchmarks/gpu_check.py`)", "",
             f"Command: `{command}`; {datetime.datetime.now().isoformat(timespec='seconds')}; "
             f"torch {torch.__version__}, CUDA {torch.version.cuda}, lightning_vescale "
             f"{getattr(lightning_vescale, '__version__', '?')}, Python "
             f"{platform.python_version()}.", ""]
    if torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
        lines.append(f"GPUs: {torch.cuda.device_count()} x {', '.join(sorted(names))}.")
        lines.append("")
    lines += ["| world | check | status | detail |", "| ---: | --- | --- | --- |"]
    for world, res in results.items():
        for row in res["rows"]:
            detail = str(row["detail"]).replace("\n", " ").replace("|", "/")
            lines.append(f"| {world} | {row['check']} | {row['status']} | {detail} |")
    if snapshot_row is not None:
        lines.append(f"| 1 | {snapshot_row['check']} | {snapshot_row['status']} | "
                     f"{snapshot_row['detail']} |")
    if cfg is not None:
        lines += ["", f"Throughput: GPT {cfg.n_layer} layers, width {cfg.n_embd}, sequence "
                  f"{cfg.seq}, {cfg.batch} sequences per GPU, bf16 compute / fp32 reduce, "
                  f"fused AdamW; median of {cfg.steps} steps after {cfg.warmup} warm-up. MFU: "
                  "model FLOPs (6 N + 12 L d T per token) over the dense bf16 peak.", "",
                  "| world | engine | params | step | optimizer step | tokens/s | MFU | "
                  "peak allocated | peak reserved |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for world, res in results.items():
            for p in res["perf"]:
                if "error" in p:
                    lines.append(f"| {world} | {p['engine']} | error: "
                                 f"{p['error'].splitlines()[-1]} | | | | | | |")
                    continue
                util = "n/a" if p["mfu"] is None else f"{100 * p['mfu']:.1f}%"
                lines.append(f"| {world} | {p['engine']} | {p['params'] / 1e9:.2f}B | "
                             f"{p['median_step_s'] * 1e3:.1f} ms | "
                             f"{p['median_optimizer_s'] * 1e3:.2f} ms | {p['tokens_per_s']:,.0f} | "
                             f"{util} | {_gib(p['peak_allocated'])} | "
                             f"{_gib(p['peak_reserved'])} |")
            perf = {p["engine"]: p for p in res["perf"] if "error" not in p}
            for ours in ENGINES_OURS:
                if {ours, "fsdp2"} <= perf.keys():
                    v, f = perf[ours], perf["fsdp2"]
                    lines.append(
                        f"| {world} | {ours} / fsdp2 | | "
                        f"{v['median_step_s'] / f['median_step_s']:.3f} | "
                        f"{v['median_optimizer_s'] / f['median_optimizer_s']:.3f} | "
                        f"{v['tokens_per_s'] / f['tokens_per_s']:.3f} | | "
                        f"{(v['peak_allocated'] or 0) / max(f['peak_allocated'] or 1, 1):.3f} | "
                        f"{(v['peak_reserved'] or 0) / max(f['peak_reserved'] or 1, 1):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the one-device phases (gloo on CPU tensors, the fake group with "
                        "a toy GPT) at toy size, to check the script without a GPU")
    p.add_argument("--quick", action="store_true", help="a small throughput model (smoke run)")
    p.add_argument("--no-throughput", action="store_true", help="checks only")
    p.add_argument("--throughput", action="store_true",
                   help="the NCCL throughput rows on one GPU too (default: only with 2+ GPUs; "
                        "on one GPU the fake world-8 rows measure the ~1B model instead)")
    p.add_argument("--output", default=None,
                   help=f"where to write the results (default: {RESULTS.name} on CUDA, "
                        "nothing with --device cpu)")
    p.add_argument("--time-limit", type=float, default=280.0,
                   help="seconds for the whole run; a phase or world past its share is killed "
                        "and reported with the rows it finished")
    a = p.parse_args(argv)
    command = "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None
                                                           else sys.argv[1:])
    end = time.monotonic() + a.time_limit
    if a.device == "cpu":
        with tempfile.TemporaryDirectory() as tmp:
            results = run_phases(torch.device("cpu"), tmp, a.time_limit, FAKE_TOY)
        return _finish(results, None, None, command, a.output)
    if not torch.cuda.is_available():
        print("gpu_check: skipped: no CUDA device is available (torch "
              f"{torch.__version__}, torch.cuda.is_available() is False). Run it on a machine "
              "with an NVIDIA GPU (`--device cpu` checks the script itself); nothing was "
              "written.")
        return 0
    n = torch.cuda.device_count()
    cfg = None if a.no_throughput or (n == 1 and not a.throughput) else (
        QUICK if a.quick else ThroughputConfig())
    worlds = [1] + ([n] if n > 1 else [])
    with tempfile.TemporaryDirectory() as tmp:
        # what one GPU can run first (issue 35), then the NCCL worlds with the time left
        results: dict[Any, dict[str, Any]] = run_phases(
            torch.device("cuda", 0), tmp, 0.65 * a.time_limit, FakeConfig())
        for i, world in enumerate(worlds):
            out = Path(tmp, f"world{world}")
            out.mkdir()
            # each world gets an equal share of what is left, the snapshot row 60 s of it
            share = (end - 60.0 - time.monotonic()) / (len(worlds) - i)
            print(f"gpu_check: world size {world} (at most {share:.0f} s) ...", flush=True)
            try:
                spawn_within(world, _rank_entry, (world, _free_port(), str(out),
                                                  None if cfg is None else asdict(cfg)), share)
                results[world] = read_rows(out)
            except Exception:  # noqa: BLE001 - one world failing must not hide the others
                results[world] = read_rows(out)  # the rows it finished, then why it stopped
                results[world]["rows"].append(
                    _row("world run", FAIL, traceback.format_exc(limit=3)[-800:]))
        snapshot_row = check_snapshot(tmp, end - time.monotonic())
    return _finish(results, snapshot_row, cfg, command, a.output or str(RESULTS))


def _finish(results: dict[Any, dict[str, Any]], snapshot_row: dict[str, Any] | None,
            cfg: ThroughputConfig | None, command: str, output: str | None) -> int:
    """Render, print, write ``output`` (if any); 1 when a row failed."""
    text = render(results, snapshot_row, cfg, command.strip())
    if output:
        Path(output).write_text(text)
    print(text)
    rows = [r for res in results.values() for r in res["rows"]]
    rows += [snapshot_row] if snapshot_row is not None else []
    return 1 if any(r["status"] == FAIL for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
