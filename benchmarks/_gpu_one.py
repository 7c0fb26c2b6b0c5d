"""The rows of ``python -m benchmarks.gpu_check`` that one GPU can run (issue 35).

A world of one NCCL rank takes the local-copy shortcut for every all-gather and reduce-scatter,
so its collective rows check nothing, and NCCL refuses two ranks on one device. What one GPU
can still run, each phase in fresh processes (CUDA cannot be forked; every engine's model dies
with its process, and is also freed with ``gc.collect()`` / ``empty_cache`` before the next
one is measured):

1. **NCCL's refusal** (:func:`check_nccl_duplicate`): two NCCL ranks on GPU 0, once, to show
   why the phases below use gloo and the fake group (skipped on the CPU).
2. **two processes sharing the device over gloo** (:func:`shared_entry`): first which
   collectives gloo takes on the device's tensors (:func:`check_gloo_collectives`), then the
   engine's asynchronous path (device tensors: side streams, prefetch) with real data: parity
   with one device, prefetch on/off bitwise, HSDP ``(1, 2)`` and ``(2, 1)``, int8 all-gather
   bytes, and Muon / SOAP's owner exchange against one process (:func:`check_owner_exchange`).
3. **torch's fake process group at world 8** (:func:`fake_entry`), one fresh process per engine
   (ours, FSDP2), a >= 1B GPT with a 32k vocabulary on the GPU: per-rank peak memory, memory
   growth over steps, host syncs per step (counted: :class:`SyncCounter`) and whether
   ``backward()`` returns before the device is done (:func:`backward_blocks`). The fake group
   moves no data (the values are not meaningful); shapes, memory and the host's schedule are.

``--device cpu`` runs the same phases on CPU tensors at toy size (``tests/unit``), so their
logic is tested without a GPU; what only a GPU can show is then ``SKIP`` with the reason.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

#: ops that copy a device value to the host (a host sync on an accelerator)
SYNC_OPS = ("aten::_local_scalar_dense", "aten::item", "aten::tolist")

#: the fake world's size (one process plays rank 0 of it)
FAKE_WORLD = 8


@dataclass(frozen=True, kw_only=True)
class FakeConfig:
    """The fake-group model and run (defaults: ~1.3B parameters, 32k vocabulary)."""

    vocab: int = 32000
    n_layer: int = 24
    n_embd: int = 2048
    n_head: int = 16
    seq: int = 1024
    batch: int = 1  # per rank
    steps: int = 4


#: the CPU test's toy size
FAKE_TOY = FakeConfig(vocab=512, n_layer=2, n_embd=64, n_head=2, seq=32, batch=2, steps=3)


def _g() -> Any:
    from benchmarks import gpu_check  # imported here: gpu_check imports this module

    return gpu_check


def free_device_memory(device: torch.device) -> None:
    """Drop what the last engine left: Python garbage, then the caching allocator's blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# 1. NCCL refuses two ranks on one GPU
# ------------------------------------------------------------------------------------------------
def _nccl_pair_entry(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    msg = "accepted"
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world,
                                device_id=torch.device("cuda", 0),
                                timeout=_g().COLLECTIVE_TIMEOUT)
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the refusal is the result
        msg = f"{type(e).__name__}: {e}"
    Path(out_dir, f"nccl{rank}.txt").write_text(msg)
    os._exit(0)  # a refused communicator may hang in its destructor


def check_nccl_duplicate(out_dir: str, device: torch.device,
                         seconds: float = 60.0) -> dict[str, Any]:
    """Two NCCL ranks on GPU 0: NCCL should refuse ("Duplicate GPU detected")."""
    from benchmarks._gpu_launch import spawn_within

    name = "NCCL with 2 ranks on one GPU"
    if device.type != "cuda":
        return _g()._row(name, SKIP, "needs a GPU (this is why the checks below use gloo "
                         "and torch's fake process group)")
    try:
        spawn_within(2, _nccl_pair_entry, (2, _g()._free_port(), out_dir), seconds)
    except Exception:  # noqa: BLE001
        pass  # the files say what each rank saw; a timeout is a hang
    seen = [Path(out_dir, f"nccl{r}.txt") for r in range(2)]
    msgs = [p.read_text() for p in seen if p.is_file()]
    refused = [m for m in msgs if m != "accepted"]
    if refused:
        first = " ".join(refused[0].split())
        dup = "Duplicate GPU" in first or "duplicate" in first.lower()
        return _g()._row(name, PASS, ("refused as expected: " if dup else "failed: ")
                         + first[:300], refused=True)
    if len(msgs) == 2:
        return _g()._row(name, PASS, "accepted by this NCCL (an all-reduce completed); the "
                         "checks below still use gloo and the fake group", refused=False)
    return _g()._row(name, PASS, f"hung for {seconds:.0f} s (no rank returned): NCCL cannot "
                     "run 2 ranks on one GPU here", refused=True)


# ------------------------------------------------------------------------------------------------
# 2. two processes sharing the device over gloo
# ------------------------------------------------------------------------------------------------
def _probe(op: str, device: torch.device, rank: int, world: int) -> bool:
    """One collective on ``device`` tensors; True when it runs and gives the right values."""
    x = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    if op == "all_reduce":
        dist.all_reduce(x)
        want = torch.arange(4.0) * world + 10 * sum(range(world))
        return torch.equal(x.cpu(), want)
    if op == "broadcast":
        dist.broadcast(x, 0)
        return torch.equal(x.cpu(), torch.arange(4.0))
    if op == "all_gather_into_tensor":
        out = torch.empty(4 * world, device=device)
        dist.all_gather_into_tensor(out, x)
        want = torch.cat([torch.arange(4.0) + 10 * r for r in range(world)])
        return torch.equal(out.cpu(), want)
    if op == "all_gather (list)":
        outs = [torch.empty(4, device=device) for _ in range(world)]
        dist.all_gather(outs, x)
        return all(torch.equal(o.cpu(), torch.arange(4.0) + 10 * r) for r, o in enumerate(outs))
    if op == "reduce_scatter_tensor":
        big = torch.arange(4.0 * world, device=device)
        out = torch.empty(4, device=device)
        dist.reduce_scatter_tensor(out, big)
        return torch.equal(out.cpu(), (torch.arange(4.0) + 4 * rank) * world)
    if op == "all_to_all_single":
        out = torch.empty(world, device=device)
        inp = torch.arange(float(world), device=device) + 100 * rank  # d goes to rank d
        dist.all_to_all_single(out, inp)
        return torch.equal(out.cpu(), torch.arange(float(world)) * 100 + rank)
    if op == "async all_gather_into_tensor":
        out = torch.empty(4 * world, device=device)
        dist.all_gather_into_tensor(out, x, async_op=True).wait()
        return torch.equal(out.cpu()[4 * rank:4 * rank + 4], x.cpu())
    raise ValueError(op)


PROBES = ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather (list)",
          "reduce_scatter_tensor", "all_to_all_single", "async all_gather_into_tensor")


def check_gloo_collectives(device: torch.device) -> dict[str, Any]:
    """Which collectives gloo takes on ``device`` tensors (each probed, values checked). A
    refused one is a finding, not a failure of the engine; the rows after it say what broke."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ok, bad = [], []
    for op in PROBES:
        try:
            (ok if _probe(op, device, rank, world) else bad).append(op)
        except Exception as e:  # noqa: BLE001 - what gloo refuses is the result
            bad.append(f"{op} ({type(e).__name__}: {' '.join(str(e).split())[:80]})")
    return _g()._row(f"gloo collectives on {device.type} tensors", PASS,
                     f"take: {', '.join(ok) or 'none'}; "
                     f"refuse or wrong: {'; '.join(bad) or 'none'}",
                     taken=ok, refused=bad)


def _owner_losses(model, make_opt, device, steps: int) -> tuple[list, Any]:
    """Every rank trains on the full batch (TESTING.md: the average of equal gradients is bitwise
    the gradient, so only the optimizer's exchange can make the sharded run differ)."""
    g = _g()
    opt = make_opt(model)
    losses = []
    for x, y in g._batches(steps, 2, g.SMALL["block_size"], g.SMALL["vocab_size"]):
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().item())
    return losses, opt


def check_owner_exchange(device: torch.device, steps: int = 3,
                         tol: float = 1e-4) -> dict[str, Any]:
    """Muon's and SOAP's owner exchange (all-to-alls of whole matrices between the ranks) against
    the same optimizer on the unsharded model in one process; the bytes moved are counted.
    Tolerance: the full batch on every rank leaves only reduction order in the sharded run."""
    from lightning_vescale.optim import SOAP, Muon

    g = _g()
    makers = {"Muon": lambda m: Muon(list(m.named_parameters()), lr=0.02, adamw_lr=1e-3),
              "SOAP": lambda m: SOAP(m.parameters(), lr=3e-3, precondition_frequency=2)}
    parts, bad = [], []
    for name, make in makers.items():
        ref, _ = _owner_losses(g._small(device), make, device, steps)
        got, opt = _owner_losses(g._shard(g._small(device), "vescale", device), make, device,
                                 steps)
        d = g._rel(got, ref)
        moved = getattr(opt, "comm_bytes", None)
        parts.append(f"{name} {d:.1e}" + ("" if moved is None else f" ({moved} bytes moved)"))
        if not d <= tol or (moved is not None and dist.get_world_size() > 1 and moved <= 0):
            bad.append(name)
        free_device_memory(device)
    return g._row("Muon / SOAP owner exchange vs one process", FAIL if bad else PASS,
                  f"max relative loss difference: {'; '.join(parts)} (tolerance {tol:g})")


def shared_checks(device: torch.device) -> tuple:
    """The rows of phase 2, in order (each frees its models before the next)."""
    g = _g()
    from benchmarks._gpu_cuda_path import check_hsdp

    return (check_gloo_collectives, g.check_parity, g.check_async, check_hsdp,
            g.check_quantized_comm, check_owner_exchange)


def shared_entry(rank: int, world: int, port: int, out_dir: str, device_type: str) -> None:
    """A rank of the shared-device world: gloo, every rank on device 0 of ``device_type``."""
    from benchmarks._gpu_launch import row_reporter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=_g().COLLECTIVE_TIMEOUT)
    report = row_reporter(out_dir, rank, world)
    rows = []
    try:
        for fn in shared_checks(device):
            try:
                rows.append(fn(device))
            except Exception:  # noqa: BLE001 - a row, never an abort
                rows.append(_g()._row(fn.__name__, FAIL, traceback.format_exc(limit=3)[-800:]))
            free_device_memory(device)
            report(rows[-1])
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "perf": []}))


# ------------------------------------------------------------------------------------------------
# 3. the fake process group at world 8
# ------------------------------------------------------------------------------------------------
class SyncCounter(TorchDispatchMode):
    """Counts, by phase (``self.phase``), what makes the host wait for ``device``: ops that read
    a value on the host (``.item()``, ``bool(t)``: ``aten::_local_scalar_dense``), blocking
    device -> host copies (``.cpu()``, ``.tolist()`` of a CUDA tensor) and, on CUDA, explicit
    ``torch.cuda.synchronize`` / event / stream synchronizations. On the CPU only the first
    kind is counted (there a copy is no sync; ``.tolist()`` of a CPU tensor dispatches nothing)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.phase: str | None = "step"
        self.counts: dict[str, int] = {}
        self._patched: list[tuple[Any, str, Any]] = []
        self._warnings: Any = None

    def _count(self, what: str = "") -> None:
        if self.phase is None:  # the harness's own syncs (backward_blocks)
            return
        key = self.phase + (f" {what}" if what else "")
        self.counts[key] = self.counts.get(key, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SYNC_OPS:
            if any(isinstance(a, torch.Tensor) and a.device.type == self.device.type
                   for a in args):
                self._count()
        elif name in ("aten::_to_copy", "aten::copy_") and self.device.type != "cpu":
            # a blocking device -> host copy (``.cpu()``, ``.tolist()`` on CUDA, ``.to("cpu")``)
            src = args[1] if name == "aten::copy_" else args[0]
            dst_cpu = (args[0].device.type == "cpu" if name == "aten::copy_" else
                       torch.device(kwargs.get("device") or src.device).type == "cpu")
            blocking = not (kwargs.get("non_blocking") or
                            (name == "aten::copy_" and len(args) > 2 and args[2]))
            if isinstance(src, torch.Tensor) and src.device.type == self.device.type \
                    and dst_cpu and blocking:
                self._count()
        return func(*args, **kwargs)

    def __enter__(self):  # noqa: ANN204
        if self.device.type == "cuda":
            for owner, attr in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                                (torch.cuda.Stream, "synchronize")):
                orig = getattr(owner, attr)
                self._patched.append((owner, attr, orig))

                def wrapped(*a, _orig=orig, **k):  # noqa: ANN002, ANN003, ANN202
                    self._count()
                    return _orig(*a, **k)
                setattr(owner, attr, wrapped)
            if hasattr(torch.cuda, "set_sync_debug_mode"):  # CUDA's own count, a cross-check
                self._warnings = warnings.catch_warnings()
                self._warnings.__enter__()
                warnings.simplefilter("always")

                def show(message, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                    if "synchroniz" in str(message):
                        self._count("(sync debug mode)")
                warnings.showwarning = show
                torch.cuda.set_sync_debug_mode("warn")
        return super().__enter__()

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        for owner, attr, orig in self._patched:
            setattr(owner, attr, orig)
        self._patched.clear()
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(None, None, None)
            self._warnings = None
        return super().__exit__(*exc)


def _memory(device: torch.device) -> tuple[int, int]:
    """(allocated now, peak) in bytes: the caching allocator on CUDA, RSS / its high-water mark
    (``/proc/self/status``) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
    vals = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = int(line.split()[1]) * 1024
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


def backward_blocks(loss: torch.Tensor, device: torch.device,
                    counter: SyncCounter | None = None) -> dict[str, Any]:
    """Queue ~1 s of device work, then call ``backward()``: on CUDA it must return before the
    device is done (``returned_ms`` well under ``done_ms``); on the CPU every op runs on the
    host, so the answer there is "n/a". ``counter`` counts ``backward()`` alone, not the
    synchronizations this measurement makes."""
    phase = None if counter is None else counter.phase
    if counter is not None:
        counter.phase = None
    if device.type != "cuda":
        if counter is not None:
            counter.phase = phase
        loss.backward()
        return {"blocks": None}
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU clock cycles on current parts
    if counter is not None:
        counter.phase = phase
    loss.backward()
    if counter is not None:
        counter.phase = None
    t1 = time.perf_counter()
    torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    if counter is not None:
        counter.phase = phase
    returned, done = (t1 - t0) * 1e3, (t2 - t0) * 1e3
    return {"blocks": returned > 0.9 * done, "returned_ms": returned, "done_ms": done}


def _shard_fake(model: torch.nn.Module, engine: str, device: torch.device, mp: bool) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (FAKE_WORLD,))
    if engine == "vescale":
        from lightning_vescale.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy  # type: ignore[no-redef]
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    kw: dict[str, Any] = {"mesh": mesh}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def fake_run(engine: str, cfg: FakeConfig, device: torch.device) -> dict[str, Any]:
    """One engine at fake world 8 (this process is rank 0; the group must be initialized)."""
    from examples.gpt import GPT, GPTConfig

    gcfg = GPTConfig(vocab_size=cfg.vocab, block_size=cfg.seq, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd)
    torch.manual_seed(0)
    with torch.device(device):  # a ~1B model built on the GPU: no minutes of host init
        model = GPT(gcfg)
    n_params = sum(p.numel() for p in model.parameters())
    model = _shard_fake(model, engine, device, mp=device.type == "cuda")
    free_device_memory(device)  # the unsharded originals
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=not fused)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    after_shard = _memory(device)[0]
    g = torch.Generator().manual_seed(0)
    counter = SyncCounter(device)
    allocated, syncs, blocking = [], [], []
    for _ in range(cfg.steps):
        x = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g).to(device)
        counter.counts = {}
        with counter:
            counter.phase = "forward"
            loss = model(x, torch.roll(x, -1, dims=1))
            counter.phase = "backward"
            blocking.append(backward_blocks(loss, device, counter))
            counter.phase = "optimizer"
            opt.step()
            opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        syncs.append(dict(counter.counts))
        allocated.append(_memory(device)[0])
    peak = _memory(device)[1]
    per_step = {k: max(s.get(k, 0) for s in syncs[1:] or syncs)
                for k in sorted({k for s in syncs for k in s})}
    out = {"engine": engine, "params": n_params, "after_shard": after_shard, "peak": peak,
           "allocated": allocated, "growth": allocated[-1] - allocated[min(1, len(allocated) - 1)],
           "syncs_per_step": per_step, "backward": blocking[-1]}
    del model, opt, loss
    free_device_memory(device)
    return out


def fake_entry(_rank: int, engine: str, device_type: str, cfg: dict, out_dir: str) -> None:
    """A fresh process: the fake group at world 8, one engine, its result in a JSON file."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if device_type == "cpu":
        torch.set_num_threads(1)  # the CPU test's 2 shared cores
    device = torch.device(device_type, 0) if device_type != "cpu" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FAKE_WORLD)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = fake_run(engine, FakeConfig(**cfg), device)
    except Exception:  # noqa: BLE001 - the row says why
        res = {"engine": engine, "error": traceback.format_exc(limit=4)[-800:]}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"fake_{engine}.json").write_text(json.dumps(res))


def fake_row(res: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The printed verdict of one engine's fake-world run."""
    name = f"fake world {FAKE_WORLD}: {res['engine']}"
    if "error" in res:
        return _g()._row(name, FAIL, res["error"])
    mib = 2 ** 20
    bwd = res["backward"]
    how = ("n/a on the CPU" if bwd.get("blocks") is None else
           f"{'BLOCKS' if bwd['blocks'] else 'returns early'} ({bwd['returned_ms']:.0f} ms of "
           f"{bwd['done_ms']:.0f} ms queued)")
    syncs = ", ".join(f"{k} {v}" for k, v in res["syncs_per_step"].items()) or "none"
    size = (f"{res['params'] / 1e9:.2f}B" if res["params"] >= 1e9 else
            f"{res['params'] / 1e6:.1f}M")
    detail = (f"{size} params; per-rank peak {res['peak'] / mib:.0f} MiB "
              f"(after sharding {res['after_shard'] / mib:.0f} MiB); growth steps 2..last "
              f"{res['growth'] / mib:+.1f} MiB; host syncs per step: {syncs}; backward(): {how}")
    # judged for ours on the GPU only (FSDP2 is the reference; on the CPU RSS moves with the
    # allocator and nothing is asynchronous): no growth past 1% of the peak, backward() async
    ok = (device.type != "cuda" or res["engine"] not in _g().ENGINES_OURS
          or (res["growth"] <= 0.01 * max(res["peak"], 1) and not bwd.get("blocks")))
    return _g()._row(name, PASS if ok else FAIL, detail, **{k: v for k, v in res.items()
                                                            if k != "engine"})


# ------------------------------------------------------------------------------------------------
# the phases, in fresh processes, within a deadline
# ------------------------------------------------------------------------------------------------
SHARED_LABEL = "2 on 1 device (gloo)"
FAKE_LABEL = f"fake {FAKE_WORLD}"


def run_phases(device: torch.device, tmp: str, seconds: float,
               fake_cfg: FakeConfig) -> dict[str, dict[str, Any]]:
    """Phases 1-3 of the module docstring within ``seconds``; rows by world label (the rows of
    a phase that overran are those it finished, plus a FAIL row saying so)."""
    from benchmarks._gpu_launch import read_rows, spawn_within

    g = _g()
    end = time.monotonic() + seconds
    out: dict[str, dict[str, Any]] = {}
    nccl = check_nccl_duplicate(tmp, device, seconds=min(30.0, seconds / 6))
    print(f"gpu_check: [1 GPU] {nccl['status']} {nccl['check']}: "
          f"{' '.join(str(nccl['detail']).split())[:200]}", flush=True)
    out["2 on 1 GPU (NCCL)"] = {"rows": [nccl], "perf": []}
    shared = Path(tmp, "shared")
    shared.mkdir()
    print(f"gpu_check: {SHARED_LABEL} on {device.type} ...", flush=True)
    try:
        spawn_within(2, shared_entry, (2, g._free_port(), str(shared), device.type),
                     (end - time.monotonic()) * 0.45)
        out[SHARED_LABEL] = read_rows(shared)
    except Exception:  # noqa: BLE001 - one phase failing must not hide the others
        out[SHARED_LABEL] = read_rows(shared)
        out[SHARED_LABEL]["rows"].append(g._row("world run", FAIL,
                                                traceback.format_exc(limit=3)[-800:]))
    rows = []
    for i, engine in enumerate(("vescale", "fsdp2")):
        print(f"gpu_check: {FAKE_LABEL}, {engine} (a fresh process) ...", flush=True)
        share = (end - time.monotonic()) / (2 - i)
        try:
            spawn_within(1, fake_entry, (engine, device.type, asdict(fake_cfg), tmp), share)
            res = json.loads(Path(tmp, f"fake_{engine}.json").read_text())
        except Exception:  # noqa: BLE001
            res = {"engine": engine, "error": traceback.format_exc(limit=3)[-800:]}
        rows.append(fake_row(res, device))
        print(f"gpu_check: [{FAKE_LABEL}] {rows[-1]['status']} {rows[-1]['check']}: "
              f"{' '.join(str(rows[-1]['detail']).split())[:300]}", flush=True)
    out[FAKE_LABEL] = {"rows": rows, "perf": []}
    return out


__all__ = ["FAKE_LABEL", "FAKE_TOY", "SHARED_LABEL", "FakeConfig", "SyncCounter", "backward_blocks",
           "check_gloo_collectives", "check_nccl_duplicate", "check_owner_exchange", "fake_entry",
           "fake_row", "free_device_memory", "run_phases", "shared_entry"]
