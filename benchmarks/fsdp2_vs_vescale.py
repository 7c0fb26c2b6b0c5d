"""lightning_vescale ``fully_shard`` vs PyTorch FSDP2 ``fully_shard``, side by side.

Both engines train the same GPT (``examples.gpt``, same init, same per-rank micro-batches, same
``torch.optim.AdamW``) with one group per transformer block plus the root, at the same world
size, on CPU/gloo (or whatever backend ``--backend`` names). Printed per engine, then as ratios
(vescale / fsdp2; below 1 is better for every figure):

* median step time (forward + backward + optimizer step, and the two phases) over ``--runs`` x
  ``--steps`` steps, engines interleaved step by step so machine noise hits both alike;
* peak memory per rank: exact live-tensor bytes during one step (a ``TorchDispatchMode`` that
  re-sums every live storage after every operator, so ``resize_``-freed storage counts as
  freed), plus the process's peak RSS during the step for reference;
* bytes communicated and bytes copied per step (forward + backward), counted per operator by
  :class:`lightning_vescale.testing.CopyCommCounter` (design note [copy-comm-counting]).

Run from the repository root::

    python -m benchmarks.fsdp2_vs_vescale                 # world size 2, ~3.2M-param GPT
    python -m benchmarks.fsdp2_vs_vescale --n-layer 8 --n-embd 512 --steps 5

Results and how they were taken: ``benchmarks/RESULTS_fsdp.md``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from examples.gpt import GPT, GPTConfig, make_batches

ENGINES = ("vescale", "fsdp2")
#: Timed next to the engines (no memory run): vescale with its AdamW wrapped in
#: ``lightning_vescale.optim.FlatParamOptimizer`` (design note [flat-params]).
FLAT_PARAMS = "vescale flat-params"


# ------------------------------------------------------------------------------------------------
# measurement helpers
# ------------------------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class LiveTensorPeak(TorchDispatchMode):
    """Peak bytes of live tensor storage while active (exact at operator granularity).

    Tracks every tensor alive when it starts (found through the garbage collector, so engine
    internals count too) and every operator output; after each operator it sums the *current*
    ``nbytes`` of the distinct storages still alive.
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: list[weakref.ref] = []
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                self._track(obj)
        self.start = self._live()
        self.peak = self.start

    def _track(self, t: torch.Tensor) -> None:
        try:
            self._refs.append(weakref.ref(_local(t)))
        except TypeError:
            pass

    def _live(self) -> int:
        seen: dict[int, int] = {}
        alive = []
        for r in self._refs:
            t = r()
            if t is None:
                continue
            alive.append(r)
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if t.device.type == "meta":
                continue
            seen[s.data_ptr() or id(s)] = s.nbytes()
        self._refs = alive
        return sum(seen.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        self.peak = max(self.peak, self._live())
        return out


def _rss_hwm_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _rss_hwm() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------------------------------------
# one engine
# ------------------------------------------------------------------------------------------------
class Engine(NamedTuple):
    model: torch.nn.Module
    opt: torch.optim.Optimizer


class StepTimes(NamedTuple):
    """Wall times of one training step, in seconds."""

    loss: float
    fwd_bwd_s: float
    optim_s: float


def shard_gpt(engine: str, cfg: GPTConfig, seed: int = 0, compile_blocks: bool = False) -> GPT:
    """``cfg``'s GPT initialised from ``seed`` and sharded by ``engine`` (``"vescale"``: this
    package's ``fully_shard``, ``"fsdp2"``: torch's) as FSDP2 does it: each block, then the root.
    The benchmarks that compare the two engines all build their model here."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    if engine == "vescale":
        from lightning_vescale.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    for block in model.blocks:
        fully_shard(block)
        if compile_blocks:  # FSDP2's pattern: compile each block, engine hooks stay eager
            block.compile()
    fully_shard(model)
    return model


def _build(engine: str, cfg: GPTConfig, seed: int = 0, compile_blocks: bool = False) -> Engine:
    model = shard_gpt(engine, cfg, seed, compile_blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    return Engine(model, opt)


def _step(model, opt, x, y) -> StepTimes:
    t0 = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    return StepTimes(loss=loss.item(), fwd_bwd_s=t1 - t0, optim_s=time.perf_counter() - t1)


def _build_compute(cfg: GPTConfig, like: torch.nn.Module, seed: int = 0,
                   compile_blocks: bool = False) -> Engine:
    """The compute-only limit: the same per-rank work with no engine and no communication.

    An unsharded GPT (forward + backward on the rank's micro-batch) and the same AdamW over
    plain tensors with the rank's local shard shapes of ``like`` (a sharded model).
    """
    torch.manual_seed(seed)
    model = GPT(cfg)
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    shards = []
    for p in like.parameters():
        q = torch.nn.Parameter(_local(p.detach()).clone())
        q.grad = torch.randn_like(q) * 1e-3
        shards.append(q)
    return Engine(model, torch.optim.AdamW(shards, lr=1e-3, weight_decay=0.1, foreach=True))


def _compute_step(model, opt, x, y) -> StepTimes:
    t0 = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    t1 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    opt.step()
    return StepTimes(loss=loss.item(), fwd_bwd_s=t1 - t0, optim_s=time.perf_counter() - t1)


def _micro(batches, rank: int, world: int):
    out = []
    for x, y in batches:
        b = x.shape[0] // world
        out.append((x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]))
    return out


def _timing_body(cfg_kw: dict, batch: int, steps: int, warmup: int, runs: int,
                 compile_blocks: bool = False) -> dict:
    """Both engines in one world, interleaved step by step (alternating which goes first), so
    load from other processes on the machine hits both alike; returns per-engine step times."""
    from lightning_vescale.placement import set_flat_step_enabled

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    data = _micro(make_batches(warmup + steps, batch * world, cfg.block_size), rank, world)
    from lightning_vescale.optim import FlatParamOptimizer

    engines = {e: _build(e, cfg, compile_blocks=compile_blocks) for e in ENGINES}
    flat_model, flat_opt = _build("vescale", cfg, compile_blocks=compile_blocks)
    engines[FLAT_PARAMS] = Engine(flat_model, FlatParamOptimizer(flat_opt))
    engines["compute"] = _build_compute(cfg, engines["vescale"].model,
                                        compile_blocks=compile_blocks)
    timed = (*ENGINES, FLAT_PARAMS, "compute")
    times: dict[str, list[float]] = {e: [] for e in timed}
    fwd_bwd: dict[str, list[float]] = {e: [] for e in timed}
    optim: dict[str, list[float]] = {e: [] for e in timed}
    losses: dict[str, list[float]] = {e: [] for e in timed}
    k = 0
    for run in range(runs):
        for i, (x, y) in enumerate(data):
            k += 1
            for e in (timed if k % 2 else timed[::-1]):
                # FSDP2 and the compute-only limit run without this package's flat-step
                # handlers (switched outside the timed region), so they pay nothing for them.
                set_flat_step_enabled(e == "vescale")  # FlatParamOptimizer needs none
                dist.barrier()
                t0 = time.perf_counter()
                step = (_compute_step if e == "compute" else _step)(
                    engines[e].model, engines[e].opt, x, y)
                dt = time.perf_counter() - t0
                if run == 0:
                    losses[e].append(step.loss)
                if i >= warmup:
                    times[e].append(dt)
                    fwd_bwd[e].append(step.fwd_bwd_s)
                    optim[e].append(step.optim_s)
    set_flat_step_enabled(True)
    nparams = sum(p.numel() for p in engines["fsdp2"].model.parameters())
    return {"times": times, "fwd_bwd": fwd_bwd, "optim": optim, "losses": losses,
            "nparams": nparams}


def _memory_body(engine: str, cfg_kw: dict, batch: int, compile_blocks: bool = False) -> dict:
    """One engine alone in the world: peak memory and copy/communication counts of a step."""
    from lightning_vescale.testing import CopyCommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    data = _micro(make_batches(3, batch * world, cfg.block_size), rank, world)
    model, opt = _build(engine, cfg, compile_blocks=compile_blocks)
    _step(model, opt, *data[0])  # warm-up: lazy init, optimizer states, recorded orders
    gc.collect()
    x, y = data[1]
    with CopyCommCounter() as counter:
        loss = model(x, y)
        loss.backward()
    opt.step()
    opt.zero_grad()
    gc.collect()
    _rss_hwm_reset()
    rss0 = _rss_hwm()
    x, y = data[2]
    with LiveTensorPeak() as mem:
        _step(model, opt, x, y)
    return {"peak_tensor_bytes": mem.peak, "start_tensor_bytes": mem.start,
            "peak_rss_bytes": _rss_hwm(), "rss_before": rss0, **counter.summary()}


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run(world_size: int, cfg_kw: dict, batch: int, steps: int, warmup: int,
        runs: int, compile_blocks: bool = False) -> dict[str, Any]:
    from tests.harness import run_distributed

    timing = run_distributed(_timing_body, world_size, cfg_kw, batch, steps, warmup, runs,
                             compile_blocks, timeout=3600)
    # Memory and copy counts come from eager runs: a TorchDispatchMode and compiled graphs do
    # not mix (and the counters would see the compiler's fake tensors).
    mem = {e: run_distributed(_memory_body, world_size, e, cfg_kw, batch, timeout=3600)
           for e in ENGINES}
    out: dict[str, Any] = {"nparams": timing[0]["nparams"], "world_size": world_size,
                           "compiled": compile_blocks}
    out["compute"] = {
        k: statistics.median(max(ps) for ps in zip(*(r[src]["compute"] for r in timing)))
        for k, src in (("median_step_s", "times"), ("median_fwd_bwd_s", "fwd_bwd"),
                       ("median_optim_s", "optim"))}
    out[FLAT_PARAMS] = {
        k: statistics.median(max(ps) for ps in zip(*(r[src][FLAT_PARAMS] for r in timing)))
        for k, src in (("median_step_s", "times"), ("median_fwd_bwd_s", "fwd_bwd"),
                       ("median_optim_s", "optim"))}
    out[FLAT_PARAMS]["losses"] = timing[0]["losses"][FLAT_PARAMS]
    for e in ENGINES:
        all_times = [t for r in timing for t in r["times"][e]]  # every rank's steps
        per_step = [max(ts) for ts in zip(*(r["times"][e] for r in timing))]  # slowest rank
        out[e] = {
            "median_step_s": statistics.median(per_step),
            "median_fwd_bwd_s": statistics.median(
                max(ps) for ps in zip(*(r["fwd_bwd"][e] for r in timing))),
            "median_optim_s": statistics.median(
                max(ps) for ps in zip(*(r["optim"][e] for r in timing))),
            "min_step_s": min(per_step),
            "steps_timed": len(per_step),
            "_all": len(all_times),
            "losses": timing[0]["losses"][e],
            "peak_tensor_bytes": max(m["peak_tensor_bytes"] for m in mem[e]),
            "peak_rss_bytes": max(m["peak_rss_bytes"] for m in mem[e]),
            "comm_bytes": mem[e][0]["comm_bytes"],
            "comms": mem[e][0]["comms"],
            "copy_bytes": mem[e][0]["copy_bytes"],
            "copies": mem[e][0]["copies"],
            "by_op": mem[e][0]["by_op"],
        }
    return out


def report(res: dict[str, Any]) -> str:
    v, f = res["vescale"], res["fsdp2"]
    rows = [
        ("median step time", f"{v['median_step_s'] * 1e3:.1f} ms",
         f"{f['median_step_s'] * 1e3:.1f} ms", v["median_step_s"] / f["median_step_s"]),
        ("  forward + backward", f"{v['median_fwd_bwd_s'] * 1e3:.1f} ms",
         f"{f['median_fwd_bwd_s'] * 1e3:.1f} ms", v["median_fwd_bwd_s"] / f["median_fwd_bwd_s"]),
        ("  optimizer step", f"{v['median_optim_s'] * 1e3:.1f} ms",
         f"{f['median_optim_s'] * 1e3:.1f} ms", v["median_optim_s"] / f["median_optim_s"]),
        ("peak live tensor memory / rank", _fmt_bytes(v["peak_tensor_bytes"]),
         _fmt_bytes(f["peak_tensor_bytes"]), v["peak_tensor_bytes"] / f["peak_tensor_bytes"]),
        ("peak RSS / rank (incl. ~runtime)", _fmt_bytes(v["peak_rss_bytes"]),
         _fmt_bytes(f["peak_rss_bytes"]), v["peak_rss_bytes"] / f["peak_rss_bytes"]),
        ("bytes communicated / step", _fmt_bytes(v["comm_bytes"]), _fmt_bytes(f["comm_bytes"]),
         v["comm_bytes"] / f["comm_bytes"]),
        ("bytes copied / step (fwd+bwd)", _fmt_bytes(v["copy_bytes"]), _fmt_bytes(f["copy_bytes"]),
         v["copy_bytes"] / f["copy_bytes"] if f["copy_bytes"] else float("nan")),
        ("copy operators / step", str(v["copies"]), str(f["copies"]),
         v["copies"] / f["copies"] if f["copies"] else float("nan")),
        ("collectives / step", str(v["comms"]), str(f["comms"]), v["comms"] / f["comms"]),
    ]
    c = res["compute"]
    rows.insert(3, ("compute-only limit: step", f"{c['median_step_s'] * 1e3:.1f} ms",
                    f"{c['median_step_s'] * 1e3:.1f} ms", 1.0))
    rows.insert(4, ("  engine step / compute-only step", f"{v['median_step_s'] / c['median_step_s']:.3f}",
                    f"{f['median_step_s'] / c['median_step_s']:.3f}",
                    v["median_step_s"] / f["median_step_s"]))
    rows.insert(5, ("  compute-only fwd+bwd / optimizer", f"{c['median_fwd_bwd_s'] * 1e3:.1f} ms",
                    f"{c['median_optim_s'] * 1e3:.1f} ms", float("nan")))
    w = max(len(name) for name, *_ in rows)
    lines = [f"GPT with {res['nparams'] / 1e6:.2f}M parameters, world size {res['world_size']}, "
             f"{v['steps_timed']} timed steps per engine (slowest rank per step)"
             + ("; blocks torch.compile'd (memory and copies: eager runs)"
                if res.get("compiled") else ""),
             f"{'':<{w}}  {'vescale':>14}  {'fsdp2':>14}  {'ratio':>7}"]
    for name, a, b, r in rows:
        lines.append(f"{name:<{w}}  {a:>14}  {b:>14}  {r:>7.3f}")
    lines.append(f"speed-up fsdp2 / vescale (median step): "
                 f"{f['median_step_s'] / v['median_step_s']:.3f}x")
    maxdiff = max(abs(a - b) / abs(b) for a, b in zip(v["losses"], f["losses"]))
    lines.append(f"loss agreement (max relative difference over {len(v['losses'])} steps): "
                 f"{maxdiff:.2e}")
    fp = res.get(FLAT_PARAMS)
    if fp is not None:
        lines.append(f"vescale + FlatParamOptimizer: step {fp['median_step_s'] * 1e3:.1f} ms "
                     f"(fwd+bwd {fp['median_fwd_bwd_s'] * 1e3:.1f}, optimizer "
                     f"{fp['median_optim_s'] * 1e3:.1f} ms); speed-up fsdp2 / it: "
                     f"{f['median_step_s'] / fp['median_step_s']:.3f}x; it / compute-only: "
                     f"{fp['median_step_s'] / c['median_step_s']:.3f}; losses equal to "
                     f"vescale's: {fp['losses'] == v['losses']}")
    lines.append(f"vescale ops: {v['by_op']}")
    lines.append(f"fsdp2 ops:   {f['by_op']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block (inductor) under both engines")
    a = p.parse_args(argv)
    cfg_kw = dict(vocab_size=65, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                  n_embd=a.n_embd, tie_weights=True)
    res = run(a.world_size, cfg_kw, a.batch, a.steps, a.warmup, a.runs, a.compile)
    print(report(res))


if __name__ == "__main__":
    main()
