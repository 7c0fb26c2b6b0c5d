"""One optimizer step on sharded parameters: lightning_vescale vs PyTorch FSDP2 vs the flat limit.

The model is ``examples.gpt``'s GPT with many small tensors (24 blocks of width 80: 292
parameter tensors, 1.88M parameters), sharded block by block and then at the root by each
engine, with gradients from one real forward/backward. Timed per rank, interleaved step by
step (so machine load hits every variant alike), median over ``--steps`` steps:

* ``vescale``: ``torch.optim.<Opt>`` on lightning_vescale's RaggedShard DTensors, whose local
  tensors tile each group's DBuffer shard. With the flat step (design note [flat-step] in
  ``lightning_vescale.placement._flat_step``) the element-wise work runs on whole shards;
* ``vescale flat-params``: the same optimizer wrapped in
  ``lightning_vescale.optim.FlatParamOptimizer`` (design note [flat-params]): the optimizer
  itself sees one plain flat tensor per run of a DBuffer shard, not one DTensor per parameter;
* ``vescale per-tensor``: the same, with the flat step switched off
  (``lightning_vescale.placement.flat_step_enabled(False)``): today's per-tensor DTensor path;
* ``fsdp2``: the same optimizer on FSDP2's ``Shard(0)`` DTensors, with this package's handlers
  removed (``fsdp2 + handlers``: installed, i.e. what importing this package costs FSDP2);
* ``local per-tensor``: the same optimizer on plain tensors of the same local shapes (no
  DTensor at all): what per-tensor kernels cost without any dispatch overhead;
* ``layout limit``: the same optimizer on plain tensors with the sizes of the flat tensors
  ``vescale flat-params`` steps (one per run of a DBuffer shard, so one per sharded group):
  the wrapper's layout without the wrapper, the most that layout can give;
* ``flat limit``: the same optimizer on ONE plain tensor with the rank's element count, and
  with ``fused=True`` (torch's single fused kernel): the limit for element-wise work.

Every variant runs the same hyper-parameters. Printed: each variant's median, then ratios.

Run from the repository root::

    python -m benchmarks.optimizer_step                       # AdamW(foreach=True), world 2
    python -m benchmarks.optimizer_step --optimizer sgd --groups 2
    python -m benchmarks.optimizer_step --fused               # AdamW(fused=True) everywhere

Results and how they were taken: ``benchmarks/RESULTS_fsdp.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks.fsdp2_vs_vescale import shard_gpt
from examples.gpt import GPTConfig, make_batches

VARIANTS = ("vescale flat-params", "vescale", "vescale per-tensor", "fsdp2", "fsdp2 + handlers", "local per-tensor",
            "layout limit", "flat limit", "flat limit fused")
#: Variants timed with lightning_vescale's flat-step handlers installed (the default); all
#: others run with them removed (``set_flat_step_enabled(False)``, switched outside the timed
#: region), so FSDP2 pays nothing for them. "fsdp2 + handlers" is FSDP2 with them installed:
#: what the handlers' entry and fallback cost a user of FSDP2 who imports this package.
WITH_HANDLERS = ("vescale", "fsdp2 + handlers")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def make_optimizer(name: str, groups: list[dict[str, Any]], *, fused: bool) -> torch.optim.Optimizer:
    """The optimizer under test; ``fused`` picks torch's fused kernel instead of foreach."""
    kind = {"foreach": not fused, "fused": fused} if name != "sgd" or fused else {"foreach": True}
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=1e-3, weight_decay=0.1, **kind)
    if name == "adam":
        return torch.optim.Adam(groups, lr=1e-3, **kind)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, **kind)
    raise ValueError(f"--optimizer={name!r}: use adamw, adam or sgd")


def param_groups(model: torch.nn.Module, n: int) -> list[dict[str, Any]]:
    """One group, or two (matrices with weight decay, vectors without: the common GPT recipe)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if n == 1:
        return [{"params": params}]
    return [{"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _sharded(engine: str, cfg: GPTConfig, x, y) -> torch.nn.Module:
    model = shard_gpt(engine, cfg)
    model(x, y).backward()
    return model


def _plain_like(model: torch.nn.Module) -> torch.nn.Module:
    """A module-less stand-in: plain tensors with the local shapes/gradients of ``model``."""
    holder = torch.nn.Module()
    for i, p in enumerate(model.parameters()):
        q = torch.nn.Parameter(_local(p.detach()).clone())
        q.grad = _local(p.grad).clone() if p.grad is not None else None
        holder.register_parameter(f"p{i}", q)
    return holder


def _layout_like(numels: list[list[int]]) -> list[dict[str, Any]]:
    """Plain tensors of the given sizes with gradients set, one param group per list (a second
    group without weight decay, as in :func:`param_groups`)."""
    out: list[dict[str, Any]] = []
    for k, sizes in enumerate(numels):
        ps = []
        for n in sizes:
            q = torch.nn.Parameter(torch.randn(n) * 0.02)
            q.grad = torch.randn(n) * 1e-3
            ps.append(q)
        out.append({"params": ps} if k == 0 else {"params": ps, "weight_decay": 0.0})
    return out


def _body(cfg_kw: dict, opt_name: str, fused: bool, groups: int, steps: int,
          warmup: int) -> dict[str, Any]:
    from lightning_vescale.optim import FlatParamOptimizer
    from lightning_vescale.placement import set_flat_step_enabled

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    x, y = make_batches(1, 4 * world, cfg.block_size)[0]
    x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    ours = _sharded("vescale", cfg, x, y)
    ours_fp = _sharded("vescale", cfg, x, y)
    ours_pt = _sharded("vescale", cfg, x, y)
    theirs = _sharded("fsdp2", cfg, x, y)
    theirs_h = _sharded("fsdp2", cfg, x, y)
    plain = _plain_like(theirs)
    # the flat limits: one tensor per param group with the rank's element count of that group
    flat = _layout_like([[sum(_local(p).numel() for p in g["params"])]
                         for g in param_groups(theirs, groups)])
    wrapped = FlatParamOptimizer(make_optimizer(opt_name, param_groups(ours_fp, groups), fused=fused))
    opts: dict[str, torch.optim.Optimizer] = {
        "vescale flat-params": wrapped,
        "vescale": make_optimizer(opt_name, param_groups(ours, groups), fused=fused),
        "vescale per-tensor": make_optimizer(opt_name, param_groups(ours_pt, groups), fused=fused),
        "fsdp2": make_optimizer(opt_name, param_groups(theirs, groups), fused=fused),
        "fsdp2 + handlers": make_optimizer(opt_name, param_groups(theirs_h, groups),
                                           fused=fused),
        "local per-tensor": make_optimizer(opt_name, param_groups(plain, groups), fused=fused),
        "layout limit": make_optimizer(opt_name, _layout_like(wrapped.flat_tensor_numels()),
                                       fused=fused),
        # the same tensors for both (an optimizer writes its defaults into the group dicts)
        "flat limit": make_optimizer(opt_name, [dict(g) for g in flat], fused=fused),
        "flat limit fused": make_optimizer(opt_name, [dict(g) for g in flat],
                                           fused=opt_name != "sgd" or fused),
    }
    steppers: dict[str, Callable[[], None]] = {k: o.step for k, o in opts.items()}
    times: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for i in range(warmup + steps):
        order = VARIANTS if i % 2 else VARIANTS[::-1]
        for k in order:
            set_flat_step_enabled(k in WITH_HANDLERS)
            t0 = time.perf_counter()
            steppers[k]()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[k].append(dt)
    set_flat_step_enabled(True)
    same = all(torch.equal(_local(a), _local(b))
               for a, b in zip(ours.parameters(), ours_pt.parameters()))
    same_fp = all(torch.equal(_local(a), _local(b))
                  for a, b in zip(ours_fp.parameters(), ours_pt.parameters()))
    flat_tensors = wrapped.num_flat_tensors()
    tensors = sum(len(g["params"]) for g in opts["vescale"].param_groups)
    numel = sum(_local(p).numel() for p in ours.parameters())
    return {"times": times, "bitwise_equal": same, "bitwise_equal_fp": same_fp,
            "flat_tensors": flat_tensors, "tensors": tensors, "numel": numel}


def run(world_size: int, cfg_kw: dict, opt_name: str, fused: bool, groups: int, steps: int,
        warmup: int) -> dict[str, Any]:
    """Run the benchmark in a fork-started gloo world; per-variant medians (slowest rank)."""
    from tests.harness import run_distributed

    res = run_distributed(_body, world_size, cfg_kw, opt_name, fused, groups, steps, warmup,
                          timeout=3600)
    out: dict[str, Any] = {"world_size": world_size, "tensors": res[0]["tensors"],
                           "numel": [r["numel"] for r in res],
                           "bitwise_equal": all(r["bitwise_equal"] for r in res),
                           "bitwise_equal_fp": all(r["bitwise_equal_fp"] for r in res),
                           "flat_tensors": [r["flat_tensors"] for r in res]}
    for k in VARIANTS:
        per_step = [max(ts) for ts in zip(*(r["times"][k] for r in res))]
        out[k] = statistics.median(per_step)
    return out


def report(res: dict[str, Any], label: str) -> str:
    """A table of medians and the ratios the issue asks for."""
    lines = [f"{label}, world size {res['world_size']}, {res['tensors']} parameter tensors, "
             f"{res['numel']} elements per rank; median of the slowest rank per step"]
    w = max(len(k) for k in VARIANTS)
    for k in VARIANTS:
        lines.append(f"  {k:<{w}}  {res[k] * 1e3:8.2f} ms")
    v = res["vescale"]
    lines.append(f"  fsdp2 / vescale (speed-up)            {res['fsdp2'] / v:6.2f}x")
    lines.append(f"  fsdp2 + handlers / fsdp2 (their cost)  {res['fsdp2 + handlers'] / res['fsdp2']:6.2f}x")
    lines.append(f"  vescale per-tensor / vescale          {res['vescale per-tensor'] / v:6.2f}x")
    lines.append(f"  vescale / flat limit (same optimizer) {v / res['flat limit']:6.2f}x")
    lines.append(f"  vescale / flat limit fused            {v / res['flat limit fused']:6.2f}x")
    lines.append(f"  flat step bitwise equal to per-tensor step: {res['bitwise_equal']}")
    f = res["vescale flat-params"]
    lines.append(f"  flat-params: {res['flat_tensors']} flat tensors per rank")
    lines.append(f"  fsdp2 / vescale flat-params (speed-up)  {res['fsdp2'] / f:6.2f}x")
    lines.append(f"  vescale flat-params / layout limit     {f / res['layout limit']:6.2f}x  (the wrapper's own cost)")
    lines.append(f"  fsdp2 / layout limit (the most this layout gives)  {res['fsdp2'] / res['layout limit']:6.2f}x")
    lines.append(f"  vescale flat-params / flat limit       {f / res['flat limit']:6.2f}x")
    lines.append(f"  vescale flat-params / flat limit fused {f / res['flat limit fused']:6.2f}x")
    lines.append(f"  flat-params bitwise equal to per-tensor step: {res['bitwise_equal_fp']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--n-embd", type=int, default=80)
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd"))
    p.add_argument("--fused", action="store_true", help="fused=True instead of foreach=True")
    p.add_argument("--groups", type=int, default=1, choices=(1, 2),
                   help="2: matrices with weight decay, vectors without")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args(argv)
    cfg_kw = dict(vocab_size=65, block_size=32, n_layer=a.n_layer, n_head=4, n_embd=a.n_embd)
    res = run(a.world_size, cfg_kw, a.optimizer, a.fused, a.groups, a.steps, a.warmup)
    label = (f"{a.optimizer}({'fused' if a.fused else 'foreach'}=True), {a.groups} param "
             f"group(s)")
    print(report(res, label))


if __name__ == "__main__":
    main()
