"""gloo's ``reduce_scatter_tensor`` vs the DBuffer's form on gloo (all-to-all plus local sum).

Design note [dbuffer-collectives] in ``lightning_vescale/dbuffer.py``: on CPU/gloo a DBuffer's
SUM reduce-scatter is ``all_to_all_single`` into an input-sized temporary plus one local sum in
gloo's ring order. This benchmark times both on the same flat fp32 input in one fork-started
gloo world (interleaved, a barrier before each call, median over ``--repeats``), checks that the
results are bitwise equal, and prints the ratio.

Run from the repository root::

    python -m benchmarks.gloo_reduce_scatter                  # 640k and 3M elements, 2 and 3 ranks
    python -m benchmarks.gloo_reduce_scatter --elements 1000000 --world-sizes 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _body(n: int, repeats: int) -> dict:
    from lightning_vescale.dbuffer import DBuffer
    from lightning_vescale.planner import plan_layout

    world = dist.get_world_size()
    buf = DBuffer(plan_layout([("x", (n,), 1)], world), dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(dist.get_rank())
    full = torch.randn(buf.buffer_size, generator=g)
    ref = torch.empty(buf.shard_size)
    times: dict[str, list[float]] = {"gloo reduce_scatter_tensor": [], "DBuffer (all-to-all)": []}
    for i in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.reduce_scatter_tensor(ref, full, op=dist.ReduceOp.SUM)
        t1 = time.perf_counter()
        buf.materialize_grad()
        buf.grad_full.copy_(full)
        dist.barrier()
        t2 = time.perf_counter()
        buf.reduce_scatter(op="sum")
        t3 = time.perf_counter()
        buf.free_grad()
        if i >= 2:  # warm-up
            times["gloo reduce_scatter_tensor"].append(t1 - t0)
            times["DBuffer (all-to-all)"].append(t3 - t2)
    return {"median": {k: statistics.median(v) for k, v in times.items()},
            "equal": torch.equal(buf.grad_shard, ref)}


def main(argv: list[str] | None = None) -> None:
    from tests.harness import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=int, nargs="+", default=[640_000, 3_000_000])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3])
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    for world in a.world_sizes:
        for n in a.elements:
            res = run_distributed(_body, world, n, a.repeats, timeout=600)
            med = {k: max(r["median"][k] for r in res) for k in res[0]["median"]}  # slowest rank
            gloo, ours = med["gloo reduce_scatter_tensor"], med["DBuffer (all-to-all)"]
            print(f"world {world}, {n:,} fp32 elements: gloo reduce_scatter_tensor "
                  f"{gloo * 1e3:.2f} ms, DBuffer {ours * 1e3:.2f} ms, gloo / DBuffer "
                  f"{gloo / ours:.2f}x, bitwise equal: {all(r['equal'] for r in res)}")


if __name__ == "__main__":
    main()
