"""CPU time the sharding engine's hooks add per group: lightning_vescale vs PyTorch FSDP2.

Both engines label their hooks with ``record_function`` (``vescale::*`` and ``FSDP::*``). Under
``torch.profiler`` a label's *self* CPU time is the time inside it not spent in child
operators (collectives, copies, casts: those are counted separately, as "ops under labels"):
the engine's own Python and bookkeeping. This benchmark trains the same GPT with each engine
(one group per block plus the root), profiles ``--steps`` steps after a warm-up, and prints
per label: calls per step, self CPU per call, and the total per step and per group.

Run from the repository root::

    python -m benchmarks.hook_overhead                         # world 2, 24 blocks of width 80
    python -m benchmarks.hook_overhead --n-layer 4 --n-embd 256

Results: ``benchmarks/RESULTS_fsdp.md``.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.fsdp2_vs_vescale import shard_gpt
from examples.gpt import GPTConfig, make_batches

PREFIXES = {"vescale": "vescale::", "fsdp2": "FSDP::"}


def _build(engine: str, cfg: GPTConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard_gpt(engine, cfg)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _body(engine: str, cfg_kw: dict, steps: int, warmup: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    data = make_batches(warmup + steps, 4 * world, cfg.block_size)
    data = [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in data]
    model, opt = _build(engine, cfg)

    def step(x, y):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    for x, y in data[:warmup]:
        step(x, y)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in data[warmup:]:
            step(x, y)
    prefix = PREFIXES[engine]
    labels: dict[str, dict[str, float]] = defaultdict(lambda: {"calls": 0, "self_us": 0.0,
                                                                "total_us": 0.0})
    for ev in prof.key_averages():
        if ev.key.startswith(prefix):
            row = labels[ev.key.split(" (")[0].split(" for ")[0]]  # FSDP2 appends the module
            row["calls"] += ev.count
            row["self_us"] += ev.self_cpu_time_total
            row["total_us"] += ev.cpu_time_total
    groups = len(model.blocks) + 1
    return {"labels": dict(labels), "steps": steps, "groups": groups}


#: Labels that wrap communication (issuing a collective or waiting for one): their self time
#: is mostly the collective itself on CPU/gloo, not engine bookkeeping.
_COMM_WORDS = ("all_gather", "reduce_scatter", "post_backward_reduce", "rs_wait", "comm_wait",
               "all_reduce")


def is_comm(label: str) -> bool:
    return any(w in label for w in _COMM_WORDS)


def run(world_size: int, cfg_kw: dict, steps: int, warmup: int) -> dict[str, Any]:
    """Per engine: the labels of rank 0 and every rank's self-CPU total per step."""
    from tests.harness import run_distributed

    out = {}
    for engine in PREFIXES:
        res = run_distributed(_body, world_size, engine, cfg_kw, steps, warmup, timeout=3600)
        totals = [sum(r["self_us"] for k, r in rr["labels"].items() if not is_comm(k))
                  / rr["steps"] for rr in res]
        out[engine] = {"rank0": res[0], "self_us_per_step": totals}
    return out


def report(res: dict[str, Any]) -> str:
    lines = []
    for engine, r in res.items():
        r0 = r["rank0"]
        steps, groups = r0["steps"], r0["groups"]
        lines.append(f"{engine}: {groups} groups; per step on rank 0 (self CPU = the engine's own "
                     "time, child operators excluded)")
        for key, row in sorted(r0["labels"].items(), key=lambda kv: -kv[1]["self_us"]):
            calls = row["calls"] / steps
            lines.append(("  [comm] " if is_comm(key) else "  ") + f"{key:<42} {calls:6.1f} calls  {row['self_us'] / max(row['calls'], 1):8.1f}"
                         f" us/call self  {row['self_us'] / steps / 1e3:7.3f} ms/step self  "
                         f"{row['total_us'] / steps / 1e3:7.3f} ms/step incl. ops")
        per_step = statistics.median(r["self_us_per_step"])
        lines.append(f"  bookkeeping (labels not marked [comm]), self CPU: {per_step / 1e3:.3f} "
                     f"ms/step (median over ranks), {per_step / groups:.1f} us/group/step")
    v = statistics.median(res["vescale"]["self_us_per_step"])
    f = statistics.median(res["fsdp2"]["self_us_per_step"])
    lines.append(f"ratio vescale / fsdp2 (bookkeeping self CPU per step): {v / f:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=80)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    cfg_kw = dict(vocab_size=65, block_size=a.block_size, n_layer=a.n_layer, n_head=4,
                  n_embd=a.n_embd)
    print(report(run(a.world_size, cfg_kw, a.steps, a.warmup)))


if __name__ == "__main__":
    main()
