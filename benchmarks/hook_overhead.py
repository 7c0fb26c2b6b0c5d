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
    # issue 36: 8, 64 and 256 groups of small layers at world 1, ours against FSDP2
    python -m benchmarks.hook_overhead --world-size 1 --groups 8 64 256           # labels
    python -m benchmarks.hook_overhead --world-size 1 --groups 8 64 256 --wall    # host time
    python -m benchmarks.hook_overhead --world-size 1 --groups 8 64 256 --calls   # Python calls

``--wall`` prints the ratio the issue's target is about: the host time of forward + backward
above the unsharded model's (interleaved medians, no profiler), ours / FSDP2.

Results: ``benchmarks/RESULTS_fsdp.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from benchmarks.fsdp2_vs_vescale import shard_gpt
from examples.gpt import GPTConfig, make_batches

PREFIXES = {"vescale": "vescale::", "fsdp2": "FSDP::"}


class SmallLayers(torch.nn.Module):
    """``groups - 1`` small blocks (LayerNorm + Linear, 4 parameters each) and a root holding an
    input and an output Linear: the "many small modules" model of pytorch#173680, one group per
    block plus the root."""

    def __init__(self, groups: int, width: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, width))
            for _ in range(groups - 1))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return torch.nn.functional.mse_loss(self.out(h).squeeze(-1), y)


def shard_layers(engine: str, groups: int, width: int, seed: int = 0) -> SmallLayers:
    """:class:`SmallLayers` sharded by ``engine`` as FSDP2 does it: each block, then the root."""
    torch.manual_seed(seed)
    model = SmallLayers(groups, width)
    if engine == "vescale":
        from lightning_vescale.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _build(engine: str, cfg: GPTConfig | dict) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    if isinstance(cfg, dict):
        model: torch.nn.Module = shard_layers(engine, cfg["groups"], cfg["width"])
    else:
        model = shard_gpt(engine, cfg)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def _data(cfg_kw: dict, n: int, rank: int, world: int) -> tuple[Any, Any]:
    if "groups" in cfg_kw:  # the small-layers model: a regression batch of 4 rows per rank
        g = torch.Generator().manual_seed(0)
        w = cfg_kw["width"]
        data = [(torch.randn(4 * world, w, generator=g), torch.randn(4 * world, generator=g))
                for _ in range(n)]
        return None, [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in data]
    cfg = GPTConfig(**cfg_kw)
    data = make_batches(n, 4 * world, cfg.block_size)
    return cfg, [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in data]


def _body(engine: str, cfg_kw: dict, steps: int, warmup: int) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, data = _data(cfg_kw, warmup + steps, rank, world)
    model, opt = _build(engine, cfg if cfg is not None else cfg_kw)

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
    params = sum(1 for _ in model.parameters())
    return {"labels": dict(labels), "steps": steps, "groups": groups, "params": params}


def _small_models(groups: int, width: int) -> tuple[torch.Tensor, torch.Tensor,
                                                    dict[str, torch.nn.Module]]:
    """This rank's batch and the models that ``--wall`` and ``--calls`` compare: the plain
    :class:`SmallLayers` and the same model (same seed) sharded by each engine of
    :data:`PREFIXES`, in that order."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _, data = _data({"groups": groups, "width": width}, 1, rank, world)
    x, y = data[0]
    torch.manual_seed(0)
    models = {"plain": SmallLayers(groups, width)}
    for engine in PREFIXES:
        models[engine] = shard_layers(engine, groups, width)
    return x, y, models


def _wall_body(groups: int, width: int, steps: int, warmup: int) -> dict[str, Any]:
    """Median host time of forward + backward (the engine's hooks and final callback; the
    optimizer's ``zero_grad`` runs between, untimed) of the plain model and of each engine's,
    interleaved so that load on the machine hits all three alike; no profiler (it would add
    its own cost to every label and operator)."""
    x, y, models = _small_models(groups, width)
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}
    # the optimizer's step is left out: it is not the hooks' cost, and SGD over sharded
    # parameters (DTensor dispatch per tensor) would dominate the difference
    times: dict[str, list[float]] = {k: [] for k in models}
    for i in range(warmup + steps):
        for k, m in models.items():
            t0 = time.perf_counter()
            m(x, y).backward()
            t1 = time.perf_counter()
            opts[k].zero_grad()  # outside the timing, as the step: not the engine's hooks
            if i >= warmup:
                times[k].append(t1 - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _calls_body(groups: int, width: int) -> dict[str, int]:
    """Python calls of one steady-state forward + backward (``sys.setprofile``) per model: a
    measure of the hooks' host work that load on the machine does not change."""
    x, y, models = _small_models(groups, width)
    out = {}
    for k, m in models.items():
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        for _ in range(3):
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
        count = [0]

        def prof(frame, event, arg, count=count):
            if event == "call":
                count[0] += 1

        sys.setprofile(prof)
        try:
            m(x, y).backward()
        finally:
            sys.setprofile(None)
        opt.zero_grad()
        out[k] = count[0]
    return out


def calls_table(groups_list: list[int], width: int, world_size: int = 1) -> str:
    """Python calls per forward + backward above the plain model's, per engine and group count."""
    from tests.harness import run_distributed

    lines = ["| groups | plain calls | vescale calls above plain (per group) | FSDP2 calls above "
             "plain (per group) | ratio |", "| ---: | ---: | ---: | ---: | ---: |"]
    for groups in groups_list:
        r = run_distributed(_calls_body, world_size, groups, width, timeout=3600)[0]
        v, f = r["vescale"] - r["plain"], r["fsdp2"] - r["plain"]
        lines.append(f"| {groups} | {r['plain']} | {v} ({v / groups:.0f}) | {f} "
                     f"({f / groups:.0f}) | {v / f:.3f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def wall_table(groups_list: list[int], width: int, steps: int, warmup: int,
               world_size: int = 1) -> tuple[str, dict[int, float]]:
    """The engines' host overhead per step (engine step - plain step, medians) per group count,
    and the ratio vescale / FSDP2 (the issue's target: <= 0.5)."""
    from tests.harness import run_distributed

    lines = ["| groups | plain fwd+bwd ms | vescale fwd+bwd ms | FSDP2 fwd+bwd ms "
             "| vescale overhead "
             "ms (us/group) | FSDP2 overhead ms (us/group) | ratio |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ratios = {}
    for groups in groups_list:
        n = max(steps, 1600 // groups)  # small models: more steps, the same total time
        r = run_distributed(_wall_body, world_size, groups, width, n, warmup,
                            timeout=3600)[0]
        ov, of = r["vescale"] - r["plain"], r["fsdp2"] - r["plain"]
        ratios[groups] = ov / of
        lines.append(f"| {groups} | {r['plain'] * 1e3:.2f} | {r['vescale'] * 1e3:.2f} | "
                     f"{r['fsdp2'] * 1e3:.2f} | {ov * 1e3:.2f} ({ov / groups * 1e6:.0f}) | "
                     f"{of * 1e3:.2f} ({of / groups * 1e6:.0f}) | {ov / of:.3f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines), ratios


#: Labels that wrap communication (issuing a collective or waiting for one): their self time
#: is mostly the collective itself on CPU/gloo, not engine bookkeeping.
_COMM_WORDS = ("all_gather", "reduce_scatter", "post_backward_reduce", "rs_wait", "comm_wait",
               "all_reduce")


def is_comm(label: str) -> bool:
    return any(w in label for w in _COMM_WORDS)


def run(world_size: int, cfg_kw: dict, steps: int, warmup: int) -> dict[str, Any]:
    """Per engine: the labels of rank 0 and every rank's self-CPU totals per step
    (``self_us_per_step``: bookkeeping labels; ``all_us_per_step``: every label)."""
    from tests.harness import run_distributed

    out = {}
    for engine in PREFIXES:
        res = run_distributed(_body, world_size, engine, cfg_kw, steps, warmup, timeout=3600)
        totals = [sum(r["self_us"] for k, r in rr["labels"].items() if not is_comm(k))
                  / rr["steps"] for rr in res]
        alls = [sum(r["self_us"] for r in rr["labels"].values()) / rr["steps"] for rr in res]
        out[engine] = {"rank0": res[0], "self_us_per_step": totals, "all_us_per_step": alls}
    return out


def report(res: dict[str, Any]) -> str:
    lines = []
    for engine, r in res.items():
        r0 = r["rank0"]
        steps, groups = r0["steps"], r0["groups"]
        lines.append(f"{engine}: {groups} groups, {r0['params']} parameters; per step on rank 0 "
                     "(self CPU = the engine's own time, child operators excluded)")
        for key, row in sorted(r0["labels"].items(), key=lambda kv: -kv[1]["self_us"]):
            calls = row["calls"] / steps
            lines.append(("  [comm] " if is_comm(key) else "  ")
                         + f"{key:<42} {calls:6.1f} calls  "
                         f"{row['self_us'] / max(row['calls'], 1):8.1f} us/call self  "
                         f"{row['self_us'] / steps / 1e3:7.3f} ms/step self  "
                         f"{row['total_us'] / steps / 1e3:7.3f} ms/step incl. ops")
        per_step = statistics.median(r["self_us_per_step"])
        lines.append(f"  bookkeeping (labels not marked [comm]), self CPU: {per_step / 1e3:.3f} "
                     f"ms/step (median over ranks), {per_step / groups:.1f} us/group/step")
    v = statistics.median(res["vescale"]["self_us_per_step"])
    f = statistics.median(res["fsdp2"]["self_us_per_step"])
    lines.append(f"ratio vescale / fsdp2 (bookkeeping self CPU per step): {v / f:.3f}")
    v = statistics.median(res["vescale"]["all_us_per_step"])
    f = statistics.median(res["fsdp2"]["all_us_per_step"])
    lines.append(f"ratio vescale / fsdp2 (every label's self CPU per step): {v / f:.3f}")
    return "\n".join(lines)


def sweep_table(results: dict[int, dict[str, Any]]) -> str:
    """One row per group count: per-step and per-group self CPU of both engines, the ratios."""
    lines = ["| groups | params | vescale ms/step | us/group | FSDP2 ms/step | us/group | ratio "
             "| ratio, every label |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for groups, res in results.items():
        v = statistics.median(res["vescale"]["self_us_per_step"])
        f = statistics.median(res["fsdp2"]["self_us_per_step"])
        va = statistics.median(res["vescale"]["all_us_per_step"])
        fa = statistics.median(res["fsdp2"]["all_us_per_step"])
        lines.append(f"| {groups} | {res['vescale']['rank0']['params']} | {v / 1e3:.3f} | "
                     f"{v / groups:.1f} | {f / 1e3:.3f} | {f / groups:.1f} | {v / f:.3f} | "
                     f"{va / fa:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=80)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--groups", type=int, nargs="+", default=None,
                   help="sweep the small-layers model over these group counts (e.g. 8 64 256) "
                        "instead of the GPT")
    p.add_argument("--width", type=int, default=16, help="the small layers' width")
    p.add_argument("--calls", action="store_true",
                   help="with --groups: Python calls per forward + backward (load-independent)")
    p.add_argument("--wall", action="store_true",
                   help="with --groups: the host time per step without a profiler (engine "
                        "step - plain step, interleaved medians) instead of the labels")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args(argv)
    if a.groups and a.calls:
        print(calls_table(a.groups, a.width, a.world_size))
        return
    if a.groups and a.wall:
        table, _ = wall_table(a.groups, a.width, a.steps, a.warmup, a.world_size)
        print(table)
        return
    if a.groups:
        results = {}
        for groups in a.groups:
            results[groups] = run(a.world_size, {"groups": groups, "width": a.width},
                                  a.steps, a.warmup)
            print(report(results[groups]), flush=True)
        print(sweep_table(results))
        return
    cfg_kw = dict(vocab_size=65, block_size=a.block_size, n_layer=a.n_layer, n_head=4,
                  n_embd=a.n_embd)
    print(report(run(a.world_size, cfg_kw, a.steps, a.warmup)))


if __name__ == "__main__":
    main()
