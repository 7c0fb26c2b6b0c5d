"""Activation checkpointing under ``fully_shard``: peak memory and step time with and without.

The example GPT (``examples/gpt.py``), one group per block plus the root, trained with AdamW at
``--world-size`` ranks (forked gloo ranks on CPU). Two variants built from the same seed:

* ``none``: no activation checkpointing;
* ``blocks``: ``activation_checkpointing_policy={Block}`` (the strategies' helper: each block's
  forward recomputed in backward; design note [activation-checkpointing]).

Printed per variant, then as ratios (blocks / none):

* median step time (forward + backward + optimizer step, and forward + backward alone) over
  ``--runs`` x ``--steps`` steps, the slowest rank per step; the variants are interleaved step by
  step (alternating which goes first) so machine load hits both alike;
* peak memory per rank during one step: exact live-tensor bytes (``LiveTensorPeak`` of
  ``benchmarks/fsdp2_vs_vescale.py``, a ``TorchDispatchMode`` re-summing every live storage after
  every operator) and its rise above the memory held before the step (parameters, gradients,
  optimizer states: what checkpointing cannot save), plus the process's peak RSS;
* the losses of the two variants (they must agree: the recompute replays the same kernels).

Run from the repository root::

    python -m benchmarks.activation_checkpointing               # ~1.6M-param GPT, T=256
    python -m benchmarks.activation_checkpointing --n-layer 8 --block-size 512 --runs 5

Results: ``benchmarks/RESULTS_activation_checkpointing.md``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.fsdp2_vs_vescale import LiveTensorPeak, _fmt_bytes, _micro, _rss_hwm, _rss_hwm_reset
from examples.gpt import GPT, Block, GPTConfig, make_batches

VARIANTS = ("none", "blocks")


def _build(variant: str, cfg: GPTConfig, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    from lightning_vescale._lightning.activation_checkpointing import (
        apply_activation_checkpointing,
        validate_activation_checkpointing_policy,
    )
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(seed)
    model = GPT(cfg)
    policy = {Block} if variant == "blocks" else None
    apply_activation_checkpointing(model, validate_activation_checkpointing_policy(policy))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _step(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor
          ) -> tuple[float, float, float]:
    t0 = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    return loss.item(), t1 - t0, time.perf_counter() - t0


def _timing_body(cfg_kw: dict, batch: int, steps: int, warmup: int, runs: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    data = _micro(make_batches(warmup + steps, batch * world, cfg.block_size), rank, world)
    built = {v: _build(v, cfg) for v in VARIANTS}
    out: dict[str, dict[str, list[float]]] = {
        v: {"step": [], "fwd_bwd": [], "loss": []} for v in VARIANTS}
    k = 0
    for run in range(runs):
        for i, (x, y) in enumerate(data):
            k += 1
            for v in (VARIANTS if k % 2 else VARIANTS[::-1]):
                dist.barrier()
                loss, fwd_bwd, step = _step(*built[v], x, y)
                if run == 0:
                    out[v]["loss"].append(loss)
                if i >= warmup:
                    out[v]["step"].append(step)
                    out[v]["fwd_bwd"].append(fwd_bwd)
    return out


def _memory_body(variant: str, cfg_kw: dict, batch: int) -> dict:
    """One variant alone in the world: peak memory of a step after two warm-up steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    data = _micro(make_batches(3, batch * world, cfg.block_size), rank, world)
    model, opt = _build(variant, cfg)
    for x, y in data[:2]:  # lazy init, optimizer states, recorded orders
        _step(model, opt, x, y)
    gc.collect()
    _rss_hwm_reset()
    with LiveTensorPeak() as mem:
        _step(model, opt, *data[2])
    return {"peak": mem.peak, "start": mem.start, "rss": _rss_hwm()}


def run(world_size: int, cfg_kw: dict, batch: int, steps: int, warmup: int,
        runs: int) -> dict[str, Any]:
    from tests.harness import run_distributed

    timing = run_distributed(_timing_body, world_size, cfg_kw, batch, steps, warmup, runs,
                             timeout=3600)
    res: dict[str, Any] = {"world_size": world_size, "cfg": cfg_kw, "batch": batch,
                           "nparams": sum(p.numel() for p in GPT(GPTConfig(**cfg_kw))
                                          .parameters())}
    for v in VARIANTS:
        mem = run_distributed(_memory_body, world_size, v, cfg_kw, batch, timeout=3600)
        slowest = {key: [max(ts) for ts in zip(*(r[v][key] for r in timing))]
                   for key in ("step", "fwd_bwd")}
        res[v] = {
            "median_step_s": statistics.median(slowest["step"]),
            "median_fwd_bwd_s": statistics.median(slowest["fwd_bwd"]),
            "steps_timed": len(slowest["step"]),
            "losses": timing[0][v]["loss"],
            "peak_bytes": max(m["peak"] for m in mem),
            "rise_bytes": max(m["peak"] - m["start"] for m in mem),
            "rss_bytes": max(m["rss"] for m in mem),
        }
    return res


def report(res: dict[str, Any]) -> str:
    n, b = res["none"], res["blocks"]
    rows = [
        ("median step time", n["median_step_s"] * 1e3, b["median_step_s"] * 1e3, "ms"),
        ("  forward + backward", n["median_fwd_bwd_s"] * 1e3, b["median_fwd_bwd_s"] * 1e3, "ms"),
        ("peak live tensors / rank", n["peak_bytes"], b["peak_bytes"], "B"),
        ("  rise during the step", n["rise_bytes"], b["rise_bytes"], "B"),
        ("peak RSS / rank (incl. runtime)", n["rss_bytes"], b["rss_bytes"], "B"),
    ]
    cfg = res["cfg"]
    w = max(len(r[0]) for r in rows)
    lines = [f"GPT {res['nparams'] / 1e6:.2f}M parameters (n_layer {cfg['n_layer']}, n_embd "
             f"{cfg['n_embd']}, T {cfg['block_size']}), micro-batch {res['batch']} per rank, "
             f"world size {res['world_size']}, {n['steps_timed']} timed steps per variant "
             f"(slowest rank per step)",
             f"{'':<{w}}  {'none':>12}  {'blocks':>12}  {'ratio':>7}"]
    for name, a, c, unit in rows:
        fa = f"{a:.1f} ms" if unit == "ms" else _fmt_bytes(a)
        fc = f"{c:.1f} ms" if unit == "ms" else _fmt_bytes(c)
        lines.append(f"{name:<{w}}  {fa:>12}  {fc:>12}  {c / a:>7.3f}")
    diff = max(abs(x - y) / abs(y) for x, y in zip(b["losses"], n["losses"]))
    lines.append(f"losses (max relative difference over {len(n['losses'])} steps): {diff:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg_kw = dict(vocab_size=65, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                  n_embd=a.n_embd, tie_weights=True)
    print(report(run(a.world_size, cfg_kw, a.batch, a.steps, a.warmup, a.runs)))


if __name__ == "__main__":
    main()
