"""Quantized communication (``CommPolicy``, issue 25): step time, bytes, codec cost, loss parity.

Three measurements, each a sub-command (all by default):

* ``steps``: the example GPT trained by several engines in one gloo world, interleaved step by
  step (so machine noise hits all alike): ours unquantized (fp32), ours with ``int8`` all-gather,
  ours with ``int8`` + bf16 gradients on the wire, ours and FSDP2 with bf16 mixed precision
  (FSDP2's bf16 all-gather, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), and
  ours with bf16 mixed precision plus ``int8``. Median step time (and forward+backward) per
  engine, and the bytes every collective moved in one step, counted per operator by
  :class:`lightning_vescale.testing.CopyCommCounter`.
* ``codec``: quantize and dequantize time per MiB of fp32 parameters (one process), against a
  plain fp32 -> bf16 cast of the same buffer.
* ``parity``: the example GPT at world 2, ``int8`` all-gather vs unquantized, AdamW, several
  seeds; mean final loss and the relative gap; a PNG of the curves.

Run from the repository root::

    python -m benchmarks.quantized_comm steps --world 2 4
    python -m benchmarks.quantized_comm codec
    python -m benchmarks.quantized_comm parity --steps 300 --seeds 0 1 2

Results and how they were taken: ``benchmarks/RESULTS_quantized_comm.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig, make_batches
from lightning_vescale._gloo_exchange import unfused

#: engine -> (engine kind, comm policy fields, bf16 mixed precision)
ENGINES: dict[str, tuple[str, dict, bool]] = {
    "vescale fp32": ("vescale", {}, False),
    "vescale int8": ("vescale", {"all_gather": "int8"}, False),
    "vescale int8 + bf16 wire": ("vescale", {"all_gather": "int8",
                                             "reduce_scatter_dtype": "bf16"}, False),
    "vescale bf16 MP": ("vescale", {}, True),
    "vescale bf16 MP + int8": ("vescale", {"all_gather": "int8"}, True),
    "fsdp2 bf16 MP": ("fsdp2", {}, True),
}


def _build(name: str, cfg: GPTConfig, seed: int = 0):
    kind, policy, bf16 = ENGINES[name]
    torch.manual_seed(seed)
    model = GPT(cfg)
    kw: dict[str, Any] = {}
    if kind == "vescale":
        from lightning_vescale import CommPolicy
        from lightning_vescale.fsdp import MixedPrecisionPolicy, fully_shard
        if policy:
            kw["comm_policy"] = CommPolicy(**policy)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def _micro(data, rank: int, world: int):
    b = data[0][0].shape[0] // world
    return [(x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]) for x, y in data]


def _bytes(model, opt, x, y) -> dict[str, int]:
    from lightning_vescale.testing import CopyCommCounter

    with CopyCommCounter() as c:
        model(x, y).backward()
    opt.zero_grad()
    out = {"all-gather": 0, "reduce-scatter": 0, "other": 0}
    for op, n in c.comm_bytes_by_op.items():
        key = ("all-gather" if "allgather" in op else
               "reduce-scatter" if "alltoall" in op or "reduce_scatter" in op else "other")
        out[key] += n
    return out


@unfused()  # bytes by collective kind, as NCCL issues them (not gloo's fused exchange)
def _steps_body(cfg_kw: dict, batch: int, steps: int, warmup: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    data = _micro(make_batches(warmup + steps + 1, batch * world, cfg.block_size), rank, world)
    engines = {name: _build(name, cfg) for name in ENGINES}
    for model, opt in engines.values():  # lazy init outside the timed and counted steps
        model(*data[-1]).backward()
        opt.zero_grad()
    counted = {name: _bytes(*engines[name], *data[-1]) for name in ENGINES}
    times: dict[str, list[float]] = {n: [] for n in ENGINES}
    fwd_bwd: dict[str, list[float]] = {n: [] for n in ENGINES}
    order = list(ENGINES)
    for i, (x, y) in enumerate(data[:-1]):
        for name in (order if i % 2 else order[::-1]):
            model, opt = engines[name]
            dist.barrier()
            t0 = time.perf_counter()
            model(x, y).backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                fwd_bwd[name].append(t1 - t0)
    nparams = sum(p.numel() for p in engines["fsdp2 bf16 MP"][0].parameters())
    return {"times": times, "fwd_bwd": fwd_bwd, "bytes": counted, "nparams": nparams}


def run_steps(world: int, cfg_kw: dict, batch: int, steps: int, warmup: int) -> str:
    from tests.harness import run_distributed

    res = run_distributed(_steps_body, world, cfg_kw, batch, steps, warmup, timeout=3600)

    def med(key: str, name: str) -> float:  # a step lasts as long as its slowest rank
        return statistics.median(max(v) for v in zip(*(r[key][name] for r in res)))

    base = med("times", "vescale fp32")
    fsdp2 = med("times", "fsdp2 bf16 MP")
    b0 = res[0]["bytes"]["vescale fp32"]
    lines = [f"world {world}, GPT {cfg_kw} ({res[0]['nparams'] / 1e6:.2f}M parameters), "
             f"batch {batch}/rank, {steps} timed steps",
             "| engine | step (ms) | fwd+bwd (ms) | vs ours fp32 | vs FSDP2 bf16 | all-gather "
             "bytes/step | reduce-scatter bytes/step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in ENGINES:
        t, fb, b = med("times", name), med("fwd_bwd", name), res[0]["bytes"][name]
        lines.append(
            f"| {name} | {1e3 * t:.1f} | {1e3 * fb:.1f} | {t / base:.2f}x | {t / fsdp2:.2f}x | "
            f"{b['all-gather']:,} ({b['all-gather'] / b0['all-gather']:.2f}x) | "
            f"{b['reduce-scatter']:,} ({b['reduce-scatter'] / b0['reduce-scatter']:.2f}x) |")
    return "\n".join(lines)


def run_codec(mib: int = 16, repeats: int = 5) -> str:
    """Quantize/dequantize time per MiB of fp32 parameters (one process, one thread)."""
    from lightning_vescale._dbuffer_quant import QuantizedGather
    from lightning_vescale.planner import plan_layout

    n = mib * 2**20 // 4
    plan = plan_layout([("w", (n // 1024, 1024), 256)], 1)
    src = torch.randn(plan.shard_size)
    full = torch.empty(plan.shard_size)
    lines = ["| codec | quantize (ms/MiB) | dequantize (ms/MiB) |", "|---|---:|---:|"]
    for fmt in ("int8", "fp8"):
        q = QuantizedGather(plan, rank=0, fmt=fmt, block_size=256, device=torch.device("cpu"))
        tq, td = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            q.quantize_(src)
            t1 = time.perf_counter()
            q.dequantize_(q.send, full)
            td.append(time.perf_counter() - t1)
            tq.append(t1 - t0)
        lines.append(f"| {fmt} | {1e3 * min(tq) / mib:.3f} | {1e3 * min(td) / mib:.3f} |")
    casts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.to(torch.bfloat16)
        casts.append(time.perf_counter() - t0)
    lines.append(f"| fp32 -> bf16 cast (reference) | {1e3 * min(casts) / mib:.3f} | - |")
    return "\n".join(lines)


def _parity_body(cfg_kw: dict, policy: dict, seed: int, steps: int, batch: int,
                 lr: float) -> dict[str, Any]:
    """``benchmarks._lm``'s recipe (AdamW betas (0.9, 0.95), weight decay 0.1, warm-up then
    linear decay, held-out evaluation) under ``fully_shard`` at this world size."""
    from lightning_vescale import CommPolicy
    from lightning_vescale.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**cfg_kw))
    kw = {"comm_policy": CommPolicy(**policy)} if policy else {}
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 1.0 - 0.9 * max(0, s - warmup) / steps))

    def mean_loss(x, y) -> float:
        g = model(*_micro([(x, y)], rank, world)[0]).detach().clone()
        dist.all_reduce(g)
        return g.item() / world

    losses = []
    for x, y in make_batches(steps, batch * world, cfg_kw["block_size"], seed=seed):
        loss = model(*_micro([(x, y)], rank, world)[0])
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
    with torch.no_grad():
        evals = [mean_loss(x, y) for x, y in make_batches(8, batch * world, cfg_kw["block_size"],
                                                          seed=10_000 + seed)]
    return {"losses": losses, "eval": statistics.mean(evals)}


def run_parity(cfg_kw: dict, seeds: list[int], steps: int, batch: int, lr: float,
               png: str | None) -> str:
    from tests.harness import run_distributed

    runs: dict[str, list[dict]] = {"unquantized": [], "int8": []}
    for seed in seeds:
        for label, policy in (("unquantized", {}), ("int8", {"all_gather": "int8"})):
            runs[label].append(run_distributed(_parity_body, 2, cfg_kw, policy, seed, steps,
                                               batch, lr, timeout=3600)[0])

    def final(r: dict) -> float:  # mean of the last 10 steps, as benchmarks/_lm.py
        return statistics.mean(r["losses"][-10:])

    lines = [f"GPT {cfg_kw}, world 2, AdamW lr {lr} (warm-up, linear decay), {steps} steps, "
             f"batch {batch}/rank; train = mean of the last 10 steps, eval = 8 held-out batches",
             "| seed | train unquantized | train int8 | gap | eval unquantized | eval int8 | gap |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for k, seed in enumerate(seeds):
        a, b = runs["unquantized"][k], runs["int8"][k]
        lines.append(f"| {seed} | {final(a):.4f} | {final(b):.4f} | "
                     f"{100 * (final(b) / final(a) - 1):+.2f} % | {a['eval']:.4f} | "
                     f"{b['eval']:.4f} | {100 * (b['eval'] / a['eval'] - 1):+.2f} % |")
    fa = statistics.mean(final(r) for r in runs["unquantized"])
    fb = statistics.mean(final(r) for r in runs["int8"])
    ea = statistics.mean(r["eval"] for r in runs["unquantized"])
    eb = statistics.mean(r["eval"] for r in runs["int8"])
    lines.append(f"| mean | {fa:.4f} | {fb:.4f} | {100 * (fb / fa - 1):+.2f} % | {ea:.4f} | "
                 f"{eb:.4f} | {100 * (eb / ea - 1):+.2f} % |")
    if png:
        _plot({k: [r["losses"] for r in v] for k, v in runs.items()}, seeds, png)
        lines.append(f"curves: {png}")
    return "\n".join(lines)


def _plot(curves: dict[str, list[list[float]]], seeds: list[int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for label, style in (("unquantized", "-"), ("int8", "--")):
        for k, (seed, c) in enumerate(zip(seeds, curves[label])):
            ax.plot(c, style, lw=0.8, color=colors[k % len(colors)], label=f"{label}, seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (mean over ranks)")
    ax.set_title("example GPT, world 2: int8 all-gather vs unquantized")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="*", default=["steps", "codec", "parity"],
                   choices=["steps", "codec", "parity"])
    p.add_argument("--world", type=int, nargs="+", default=[2])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps (default 10) / parity steps (default 300)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--parity-embd", type=int, default=128,
                   help="n_embd of the parity GPT (benchmarks/_lm.py's: 4 layers, 4 heads)")
    p.add_argument("--png", default="benchmarks/figures/quantized_comm_loss.png")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if "steps" in a.what:
        cfg = dict(n_layer=a.n_layer, n_embd=a.n_embd, n_head=4, block_size=64)
        for w in a.world:
            print(run_steps(w, cfg, a.batch, a.steps or 10, a.warmup), "\n", flush=True)
    if "codec" in a.what:
        print(run_codec(), "\n", flush=True)
    if "parity" in a.what:
        cfg = dict(n_layer=4, n_embd=a.parity_embd, n_head=4, block_size=64)
        print(run_parity(cfg, a.seeds, a.steps or 300, 8, 1e-3, a.png), flush=True)


if __name__ == "__main__":
    main()
