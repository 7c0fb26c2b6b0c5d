"""Distributed Muon (owner ranks, bucketed all-to-all) vs the naive distributed variant.

Same model, same world size, same RaggedShard layout (planned by ``plan_layout`` with row
granularity, as ``fully_shard`` lays out a group), same gradients, CPU + gloo:

* ``ours``  — :class:`lightning_vescale.optim.Muon`: each matrix goes whole to one
  load-balanced owner, Newton–Schulz (NS) runs there only, one all-to-all per bucket each way,
  overlapped with NS on the previous bucket. ``ours`` uses the default 32 MB buckets (this
  model fits in one); ``ours-small-buckets`` uses ``--bucket-cap-mb`` (1 MB: several buckets, so
  communication of one bucket overlaps NS of the previous one) to show what pipelining buys.
* ``naive`` — what one gets from ``p.grad.full_tensor()``-style code: for every matrix every rank
  all-gathers the (bfloat16) update, runs NS redundantly, keeps its own slice. One collective per
  matrix, NS work x world size. (``naive-batched`` moves all matrices with ONE all-to-all, to
  separate the batching effect from the owner effect.)

Momentum, the bf16 payload and the update arithmetic are identical, so all variants produce
bitwise-equal parameters (checked). Printed: median optimizer-step time, bytes sent to other
ranks per step, per-rank NS FLOPs (max and max/mean imbalance), and ratios naive / ours.

Run:  python benchmarks/muon_vs_naive.py --world-size 2 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_vescale.optim import Muon, newton_schulz, newton_schulz_flops  # noqa: E402
from lightning_vescale.placement import RaggedShard, chunk_bounds  # noqa: E402
from lightning_vescale.planner import plan_layout  # noqa: E402
from tests.distributed._ragged_helpers import ragged_params, set_ragged_grads  # noqa: E402

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
VARIANTS = ("ours", "ours-small-buckets", "naive", "naive-batched")


def model_shapes(d: int, layers: int) -> dict[str, tuple[int, int]]:
    """The hidden matrices of a GPT-style stack (what Muon sees)."""
    shapes = {}
    for i in range(layers):
        shapes[f"blocks.{i}.attn.qkv.weight"] = (3 * d, d)
        shapes[f"blocks.{i}.attn.proj.weight"] = (d, d)
        shapes[f"blocks.{i}.mlp.fc.weight"] = (4 * d, d)
        shapes[f"blocks.{i}.mlp.proj.weight"] = (d, 4 * d)
    return shapes


def rows_layout(shapes: dict[str, tuple[int, ...]], world: int) -> dict[str, RaggedShard]:
    """FSDP2's per-parameter ``Shard(0)`` as ``RaggedShard``s: every tensor split by rows over
    all ranks (``torch.chunk``'s sizes)."""
    return {n: RaggedShard((0,), [hi - lo for lo, hi in chunk_bounds(s[0], world)])
            for n, s in shapes.items()}


def weights_and_grads(shapes: dict[str, tuple[int, ...]], steps: int
                      ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The full initial weights (seed 0, std 0.02) and ``steps`` full gradients (seed 1)."""
    torch.manual_seed(0)
    full = {n: torch.randn(s) * 0.02 for n, s in shapes.items()}
    gen = torch.Generator().manual_seed(1)
    return full, [{n: torch.randn(s, generator=gen) for n, s in shapes.items()}
                  for _ in range(steps)]


class NaiveDistributedMuon:
    """Momentum on shards; every rank all-gathers every whole update and runs NS redundantly."""

    def __init__(self, params, *, lr, weight_decay=0.1, momentum=0.95, batched=False):
        self.params = list(params)
        self.lr, self.wd, self.mu, self.batched = lr, weight_decay, momentum, batched
        self.bufs = [torch.zeros_like(p.to_local()) for p in self.params]
        self.comm_bytes = 0
        self.ns_flops = 0

    @torch.no_grad()
    def step(self):
        world, rank = dist.get_world_size(), dist.get_rank()
        updates = []
        for p, buf in zip(self.params, self.bufs):
            g = p.grad.to_local()
            buf.lerp_(g, 1 - self.mu)
            updates.append(g.lerp(buf, self.mu).bfloat16())
        ranges = [[p.placements[0].local_range(p.shape, r) for r in range(world)]
                  for p in self.params]
        fulls = []
        if self.batched:  # one all-to-all: my slices of every matrix to every rank
            mine = torch.cat(updates)
            send = mine.repeat(world)
            recv_splits = [sum(e - s for s, e in (rg[r] for rg in ranges)) for r in range(world)]
            recv = torch.empty(sum(recv_splits), dtype=torch.bfloat16)
            dist.all_to_all_single(recv, send, recv_splits, [mine.numel()] * world)
            self.comm_bytes += 2 * mine.numel() * (world - 1)
            chunks = list(recv.split(recv_splits))
            offs = [0] * world
            for rg in ranges:
                pieces = []
                for r in range(world):
                    n = rg[r][1] - rg[r][0]
                    pieces.append(chunks[r][offs[r]:offs[r] + n])
                    offs[r] += n
                fulls.append(torch.cat(pieces))
        else:  # one padded all-gather per matrix (uneven shards)
            for u, rg in zip(updates, ranges):
                size = max(e - s for s, e in rg)
                padded = torch.zeros(size, dtype=torch.bfloat16)
                padded[: u.numel()] = u
                out = torch.empty(world * size, dtype=torch.bfloat16)
                dist.all_gather_into_tensor(out, padded)
                self.comm_bytes += 2 * size * (world - 1)
                fulls.append(torch.cat([out[r * size: r * size + e - s]
                                        for r, (s, e) in enumerate(rg)]))
        for p, full, rg in zip(self.params, fulls, ranges):
            rows, cols = p.shape
            o = newton_schulz(full.view(rows, cols)).reshape(-1)
            self.ns_flops += newton_schulz_flops(rows, cols)
            s, e = rg[rank]
            local = p.to_local()
            local.mul_(1 - self.lr * self.wd)
            # torch.optim.Muon's default lr adjustment (adjust_lr_fn=None)
            local.add_(o[s:e], alpha=-(self.lr * math.sqrt(max(1, rows / cols))))


def _rank_main(layout, args) -> dict:
    """One rank's measurements (runs in a forked gloo rank of ``tests.harness.World``)."""
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor rename
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    shapes = model_shapes(args.d_model, args.layers)
    if layout == "vescale":  # one flat buffer cut into equal row-aligned shards
        plan = plan_layout(list(shapes.items()), world, granularity="row")
        place = {n: plan.placement(n) for n in shapes}
    else:  # "even": every matrix split over all ranks by rows (FSDP2's per-parameter Shard(0))
        place = rows_layout(shapes, world)
    full, grads = weights_and_grads(shapes, args.steps)
    params, opts, times = {}, {}, {v: [] for v in VARIANTS}
    for variant in VARIANTS:
        params[variant] = ragged_params(full, place, mesh)
        if variant.startswith("ours"):
            cap = 32.0 if variant == "ours" else args.bucket_cap_mb  # 32 MB: Muon's default
            opts[variant] = Muon(list(params[variant].items()), lr=0.02, bucket_cap_mb=cap)
        else:
            opts[variant] = NaiveDistributedMuon(params[variant].values(), lr=0.02,
                                                 batched=variant == "naive-batched")
    for step in range(args.steps):  # variants interleaved: load changes hit all alike
        for variant in VARIANTS:
            set_ragged_grads(params[variant], grads[step], place, mesh)
            dist.barrier()
            t0 = time.perf_counter()
            opts[variant].step()
            dist.barrier()  # a step is done when the slowest rank is done
            times[variant].append(time.perf_counter() - t0)
    out = {v: dict(step_s=statistics.median(times[v][args.warmup:]),
                   comm_bytes=opts[v].comm_bytes / args.steps,
                   ns_flops=opts[v].ns_flops / args.steps) for v in VARIANTS}
    finals = {v: torch.cat([params[v][n].detach().to_local() for n in shapes]) for v in VARIANTS}
    out["equal"] = all(torch.equal(finals["ours"], finals[v]) for v in VARIANTS)
    return out


def run(world: int, layout: str, args) -> dict:
    from tests.harness import World

    with World(world, pg_timeout_s=300) as ranks:  # a failing rank raises, none hangs
        per_rank = ranks.run(_rank_main, layout, args, timeout=1800)
    shapes = model_shapes(args.d_model, args.layers)
    summary = {"world_size": world, "layout": layout, "matrices": len(shapes),
               "matrix_params": sum(math.prod(s) for s in shapes.values()),
               "bitwise_equal": all(v["equal"] for v in per_rank)}
    for variant in VARIANTS:
        rows = [per_rank[r][variant] for r in range(world)]
        flops = [r["ns_flops"] for r in rows]
        summary[variant] = dict(
            step_ms=1e3 * max(r["step_s"] for r in rows),
            comm_mb=sum(r["comm_bytes"] for r in rows) / 2**20,
            ns_gflop_max=max(flops) / 1e9,
            ns_imbalance=max(flops) / (sum(flops) / world),
        )
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--layout", nargs="+", default=["even", "vescale"], choices=["even", "vescale"])
    args = ap.parse_args(argv)
    os.makedirs(OUT_DIR, exist_ok=True)
    print(f"model: {args.layers} layers x d_model {args.d_model}; CPU/gloo, 1 thread per rank, "
          f"{os.cpu_count()} cores; median of {args.steps - args.warmup} steps")
    print("| layout | world | variant | step ms | MB sent/step (all ranks) | "
          "NS GFLOP max rank | NS max/mean |")
    print("|---|---|---|---|---|---|---|")
    all_results = []
    for layout in args.layout:
        for world in args.world_size:
            s = run(world, layout, args)
            all_results.append(s)
            for v in VARIANTS:
                r = s[v]
                print(f"| {layout} | {world} | {v} | {r['step_ms']:.1f} | {r['comm_mb']:.2f} | "
                      f"{r['ns_gflop_max']:.3f} | {r['ns_imbalance']:.2f} |", flush=True)

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else ("= (both 0)" if a == 0 else "inf (ours 0)")

    print()
    print("| layout | world | time naive/ours | time naive-batched/ours | "
          "time small-buckets/ours | bytes naive/ours | bytes naive-batched/ours | "
          "NS max-rank FLOPs naive/ours | ours NS max/mean | bitwise equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for s in all_results:
        o, n, nb, ob = s["ours"], s["naive"], s["naive-batched"], s["ours-small-buckets"]
        print(f"| {s['layout']} | {s['world_size']} | {ratio(n['step_ms'], o['step_ms'])} | "
              f"{ratio(nb['step_ms'], o['step_ms'])} | {ratio(ob['step_ms'], o['step_ms'])} | "
              f"{ratio(n['comm_mb'], o['comm_mb'])} | {ratio(nb['comm_mb'], o['comm_mb'])} | "
              f"{ratio(n['ns_gflop_max'], o['ns_gflop_max'])} | {o['ns_imbalance']:.3f} | "
              f"{s['bitwise_equal']} |")
    with open(os.path.join(OUT_DIR, "muon_vs_naive.json"), "w") as f:
        json.dump({"args": vars(args), "results": all_results}, f, indent=2)


if __name__ == "__main__":
    main()
