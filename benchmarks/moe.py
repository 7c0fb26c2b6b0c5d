"""The MoE example (``examples/moe.py``) under lightning_vescale and FSDP2, and MoE layouts at scale.

Engines (same model, init, per-rank micro-batches, ``torch.optim.AdamW``; one group per block
plus the root):

* ``vescale-matrix``: lightning_vescale ``fully_shard`` with ``examples.moe.expert_granularity``
  (each expert of a stacked ``(E, out, in)`` weight whole on one rank);
* ``vescale-default``: lightning_vescale with the default granularity (experts may be split);
* ``fsdp2-shard0``: torch FSDP2, ``Shard(0)`` on every tensor (the stack split by experts);
* ``fsdp2-shard1``: torch FSDP2 with ``shard_placement_fn`` giving the stacks ``Shard(1)``
  (every expert's rows split over all ranks).

Per engine: median step time (slowest rank per step; ``--runs`` x ``--steps`` steps), bytes
communicated and copied in forward + backward (``CopyCommCounter``), padding (elements stored
beyond the model's, over all ranks), peak live-tensor bytes per rank during a step. Then Muon:
``lightning_vescale.optim.Muon`` step time, bytes sent and Newton–Schulz balance (max/mean FLOPs
over ranks) on both vescale layouts; ``torch.optim.Muon`` on FSDP2's sharded parameters is tried
and its error reported. Last, the planner's padding for the GPT-OSS-120B and DeepSeek-V3-style
(stacked) presets with ``"matrix"`` experts against FSDP2's ``torch.chunk`` layout (pure
arithmetic).

    python -m benchmarks.moe                   # world 2 and 4; results: benchmarks/RESULTS_moe.md
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.fsdp2_vs_vescale import LiveTensorPeak
from examples.gpt import make_batches
from examples.moe import MoEConfig, MoEGPT, expert_granularity

ENGINES = ("vescale-matrix", "vescale-default", "fsdp2-shard0", "fsdp2-shard1")
MUON_ENGINES = ("vescale-matrix", "vescale-default", "fsdp2-shard0")


def _build(engine: str, cfg: MoEConfig):
    torch.manual_seed(0)
    model = MoEGPT(cfg)
    if engine.startswith("vescale"):
        from lightning_vescale.fsdp import fully_shard

        kw = {"granularity": expert_granularity} if engine == "vescale-matrix" else {}
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
        from torch.distributed.tensor import Shard

        kw = ({"shard_placement_fn": lambda p: Shard(1) if p.ndim == 3 else None}
              if engine == "fsdp2-shard1" else {})
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def _padding(engine: str, model, world: int) -> int:
    """Elements stored beyond the model's, summed over ranks."""
    if engine.startswith("vescale"):
        from lightning_vescale.sharding_summary import sharding_summary

        summary = sharding_summary(model)
        return sum(g.buffer_elements for g in summary.groups) - summary.elements
    pad = 0
    for p in model.parameters():
        dim = p.placements[0].dim if hasattr(p.placements[0], "dim") else 0
        size = p.shape[dim]
        pad += (-(-size // world) * world - size) * p.numel() // max(size, 1)
    return pad


def _micro(cfg: MoEConfig, n: int, batch: int, rank: int, world: int):
    out = []
    for x, y in make_batches(n, batch * world, cfg.block_size):
        out.append((x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]))
    return out


def _engine_body(engine: str, cfg_kw: dict, batch: int, steps: int, runs: int) -> dict:
    from lightning_vescale.testing import CopyCommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MoEConfig(**cfg_kw)
    model = _build(engine, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    data = _micro(cfg, steps * runs + 3, batch, rank, world)
    times = []
    for i, (x, y) in enumerate(data[:-2]):
        dist.barrier()
        t0 = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if i >= 1:  # the first step is lazy init
            times.append(time.perf_counter() - t0)
    x, y = data[-2]
    with CopyCommCounter() as counter:
        model(x, y).backward()
    opt.zero_grad()
    gc.collect()
    x, y = data[-1]
    with LiveTensorPeak() as mem:
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {"times": times, "peak": mem.peak, "padding": _padding(engine, model, world),
            **counter.summary()}


def _muon_body(engine: str, cfg_kw: dict, batch: int, steps: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = MoEConfig(**cfg_kw)
    model = _build(engine, cfg)
    try:
        if engine.startswith("vescale"):
            from lightning_vescale.optim import Muon

            opt = Muon(model.named_parameters(), lr=0.02, adamw_lr=1e-3)
        else:
            hidden = [p for n, p in model.named_parameters()
                      if p.ndim >= 2 and "emb" not in n and "head" not in n]
            opt = torch.optim.Muon(hidden, lr=0.02)
        times = []
        for x, y in _micro(cfg, steps + 1, batch, rank, world):
            model(x, y).backward()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
    return {"times": times[1:], "ns_flops": getattr(opt, "ns_flops", 0),
            "comm_bytes": getattr(opt, "comm_bytes", 0)}


def run(world: int, cfg_kw: dict, batch: int, steps: int, runs: int) -> dict[str, Any]:
    from tests.harness import run_distributed

    out: dict[str, Any] = {}
    for e in ENGINES:
        try:
            res = run_distributed(_engine_body, world, e, cfg_kw, batch, steps, runs, timeout=1800)
        except Exception as exc:  # noqa: BLE001
            out[e] = {"error": str(exc).splitlines()[-1][:200]}
            continue
        per_step = [max(ts) for ts in zip(*(r["times"] for r in res))]
        out[e] = {"step_s": statistics.median(per_step), "comm_bytes": res[0]["comm_bytes"],
                  "copy_bytes": res[0]["copy_bytes"], "padding": res[0]["padding"],
                  "peak": max(r["peak"] for r in res)}
    for e in MUON_ENGINES:
        res = run_distributed(_muon_body, world, e, cfg_kw, batch, steps, timeout=1800)
        if "error" in res[0]:
            out[f"muon {e}"] = {"error": res[0]["error"]}
            continue
        flops = [r["ns_flops"] for r in res]
        out[f"muon {e}"] = {
            "step_s": statistics.median(max(ts) for ts in zip(*(r["times"] for r in res))),
            "comm_bytes": sum(r["comm_bytes"] for r in res) / steps,
            "balance": max(flops) / (sum(flops) / world) if sum(flops) else float("nan")}
    return out


def planner_table(world_sizes=(64, 256, 1024, 4096, 10240)) -> str:
    from lightning_vescale.planner import fsdp2_even_rowwise, plan_buckets, transformer_groups
    from lightning_vescale.planner.cli import with_expert_granularity
    from lightning_vescale.planner.presets import PRESETS

    lines = ["| preset | ranks | ours, matrix experts: padding | (one buffer per bucket) | "
             "FSDP2 torch.chunk: padding | buffers per block (max) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in ("gpt-oss-120b", "deepseek-v3-stacked"):
        groups = with_expert_granularity(transformer_groups(PRESETS[name]), "matrix", None)
        total = sum(math.prod(s) for _, g in groups for _, s, _ in g)
        for m in world_sizes:
            buckets = [plan_buckets(g, m) for _, g in groups]  # what fully_shard builds
            ours = sum(b.buffer_size for b in buckets)
            one = total + sum(b.one_buffer_padding for b in buckets)
            fs = sum(fsdp2_even_rowwise(g, m).buffer_size for _, g in groups)
            most = max(len(b.plans) for b in buckets)
            lines.append(f"| {name} | {m:,} | {100 * (ours - total) / ours:.2f}% | "
                         f"{100 * (one - total) / one:.2f}% | {100 * (fs - total) / fs:.2f}% | "
                         f"{most} |")
    return "\n".join(lines)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def report(world: int, res: dict[str, Any]) -> str:
    lines = [f"### world {world}", "", "| engine | step (median) | comm bytes fwd+bwd | copied "
             "bytes | padding (elements) | peak tensor bytes/rank |", "|---|---:|---:|---:|---:|---:|"]
    base = res.get("fsdp2-shard0", {})
    for e in ENGINES:
        r = res[e]
        if "error" in r:
            lines.append(f"| {e} | cannot run: {r['error']} | | | | |")
            continue
        ratio = f" ({r['step_s'] / base['step_s']:.2f}x)" if "step_s" in base else ""
        lines.append(f"| {e} | {1e3 * r['step_s']:.1f} ms{ratio} | {_fmt(r['comm_bytes'])} | "
                     f"{_fmt(r['copy_bytes'])} | {r['padding']:,} | {_fmt(r['peak'])} |")
    lines += ["", "| Muon on | step (median) | bytes sent/step (all ranks) | NS balance max/mean |",
              "|---|---:|---:|---:|"]
    for e in MUON_ENGINES:
        r = res[f"muon {e}"]
        if "error" in r:
            lines.append(f"| {e} | cannot run: {r['error']} | | |")
        else:
            lines.append(f"| {e} | {1e3 * r['step_s']:.1f} ms | {_fmt(r['comm_bytes'])} | "
                         f"{r['balance']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-expert", type=int, default=6)
    p.add_argument("--expert-ffn", type=int, default=96)
    args = p.parse_args(argv)
    cfg_kw = dict(n_layer=2, n_head=4, n_embd=args.n_embd, n_expert=args.n_expert, top_k=2,
                  expert_ffn=args.expert_ffn, block_size=64)
    print(f"MoE example {cfg_kw}, batch {args.batch}/rank, {args.runs}x{args.steps} steps\n")
    for m in args.world_size:
        print(report(m, run(m, cfg_kw, args.batch, args.steps, args.runs)), "\n", flush=True)
    print(planner_table())


if __name__ == "__main__":
    main()
