"""Overhead of ``MemoryProfiler``: training step time with and without the callback.

Trains the embedded small GPT (``examples/gpt.py``) for ``--steps`` steps in three variants,
interleaved ``--repeats`` times (so machine load drifts hit every variant alike):

* ``none``: no profiler;
* ``default``: ``MemoryProfiler()`` (profiles one batch in ``log_every_n_steps``, here 50);
* ``every_step``: ``MemoryProfiler(every_n_steps=1)`` (worst case: every batch, full breakdown).

Step time is measured from the end of the warm-up batches to ``on_train_end`` (the end-of-fit
table is not included), as wall time and as this process's CPU time (far less sensitive to other
load on a shared machine). The wall time spent *inside* the profiler's per-batch hooks is also
measured directly (wrapped with ``perf_counter``) and reported as a share of the baseline step
time. Prints medians and ratios to ``none``. Usage::

    python benchmarks/memory_overhead.py [--steps 110] [--repeats 7] [--accelerator cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from examples.gpt import GPT, GPTConfig, CharDataset  # noqa: E402
from examples.memory_profile import LitGPT  # noqa: E402  (the example's module)
from lightning_vescale import MemoryProfiler  # noqa: E402


class StepTimer(L.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0 = self.t1 = 0.0
        self.c0 = self.c1 = 0.0  # process CPU time: far less sensitive to other load

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001
        if batch_idx == self.warmup:
            self.t0 = time.perf_counter()
            self.c0 = time.process_time()

    def on_train_end(self, trainer, pl_module):  # noqa: ANN001
        self.t1 = time.perf_counter()
        self.c1 = time.process_time()


_HOOKS = ("on_train_batch_start", "on_before_backward", "on_after_backward",
          "on_before_optimizer_step", "on_train_batch_end")


def time_hooks(prof: MemoryProfiler, timer: StepTimer) -> list[float]:
    """Wrap the profiler's per-batch hooks to add up the seconds spent inside them."""
    spent = [0.0]
    for name in _HOOKS:
        orig = getattr(prof, name)

        def timed(*a, _orig=orig, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return _orig(*a, **k)
            finally:
                if timer.t0:  # after warm-up only
                    spent[0] += time.perf_counter() - t

        setattr(prof, name, timed)
    return spent


def run(variant: str, args: argparse.Namespace, config: GPTConfig,
        tmp: str) -> tuple[float, float, float, float]:
    L.seed_everything(0, verbose=False)
    timer = StepTimer(args.warmup)
    callbacks: list[L.Callback] = [timer]
    spent = [0.0]
    if variant != "none":
        prof = MemoryProfiler(every_n_steps=1 if variant == "every_step" else None,
                              print_table=False)
        spent = time_hooks(prof, timer)
        callbacks.append(prof)
    data = CharDataset(block_size=config.block_size, length=args.steps * args.batch_size, seed=0)
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, log_every_n_steps=50,
        logger=CSVLogger(tmp, name=variant), callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    start = time.perf_counter()
    trainer.fit(LitGPT(config, lr=1e-3), torch.utils.data.DataLoader(data, batch_size=args.batch_size))
    total = time.perf_counter() - start
    n = args.steps - args.warmup
    per_step = (timer.t1 - timer.t0) / n
    return per_step * 1e3, total, spent[0] / n * 1e3, (timer.c1 - timer.c0) / n * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=110)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--accelerator", default="cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=4,
                       block_size=args.block_size)
    n_params = sum(p.numel() for p in GPT(config).parameters())
    variants = ("none", "default", "every_step")
    times: dict[str, list[float]] = {v: [] for v in variants}
    totals: dict[str, list[float]] = {v: [] for v in variants}
    in_hooks: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        run("default", args, config, tmp)  # discarded: the first fit of a process pays lazy init
        for r in range(args.repeats):
            order = variants if r % 2 == 0 else tuple(reversed(variants))
            for v in order:
                ms, total, hook_ms, cpu_ms = run(v, args, config, tmp)
                cpu[v].append(cpu_ms)
                times[v].append(ms)
                totals[v].append(total)
                in_hooks[v].append(hook_ms)
    print(f"GPT {n_params / 1e6:.2f}M params, batch {args.batch_size}x{args.block_size}, "
          f"{args.steps} steps ({args.warmup} warm-up), {args.repeats} interleaved repeats, "
          f"{args.threads} thread(s), accelerator={args.accelerator}, torch {torch.__version__}")
    base = statistics.median(times["none"])
    best_base = min(times["none"])
    cpu_base = statistics.median(cpu["none"])
    print(f"{'variant':<12}{'wall ms/step':>14}{'ratio':>7}{'best wall':>11}{'ratio':>7}"
          f"{'CPU ms/step':>13}{'ratio':>7}{'in hooks ms/step':>18}{'hooks/step':>12}")
    for v in variants:
        med = statistics.median(times[v])
        best = min(times[v])
        c = statistics.median(cpu[v])
        hook = statistics.median(in_hooks[v])
        print(f"{v:<12}{med:>14.2f}{med / base:>7.3f}{best:>11.2f}{best / best_base:>7.3f}"
              f"{c:>13.2f}{c / cpu_base:>7.3f}{hook:>18.4f}{hook / base:>12.2%}")
    print("wall: median over repeats (best: the fastest repeat); CPU: this process's CPU time per "
          "step (median), the least sensitive to other load on a shared machine; ratios are to "
          "'none'. in hooks: wall time spent inside the profiler's per-batch hooks, and its share "
          "of the 'none' median step time (the direct measure of the callback's cost).")
    print("median fit wall s: " + ", ".join(
        f"{v} {statistics.median(totals[v]):.2f}" for v in variants)
        + " (includes start-up and, with the profiler, the end-of-fit table)")


if __name__ == "__main__":
    main()
