"""The language-model training run shared by the optimizer benchmarks.

``adamw8bit_quality.py``, ``adamw8bit_vs_peers.py`` and ``muon_quality.py`` compare optimizers on
``examples/gpt.py``'s GPT and embedded character data. The comparison is fair only if every
optimizer sees the same model initialisation, batches, learning-rate schedule and evaluation, so
all three call :func:`train_lm` rather than keeping their own copy of the loop.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from examples.gpt import GPT, GPTConfig, make_batches

__all__ = ["build_gpt", "train_lm"]


def build_gpt(layers: int, d_model: int, block: int, seed: int) -> GPT:
    """The benchmark GPT (4 heads), initialised from ``seed``."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=layers, n_head=4, n_embd=d_model, block_size=block))


def train_lm(model: torch.nn.Module, opt: torch.optim.Optimizer, *, steps: int, batch: int,
             block: int, seed: int) -> dict[str, Any]:
    """Train ``steps`` steps, then evaluate on 8 held-out batches (sampling seed ``10000+seed``).

    Schedule: linear warm-up over ``steps // 20`` steps, then linear decay to 10 % of the lr.
    Returns the per-step ``losses``, ``final_train`` (mean of the last 10), ``eval_loss`` and the
    wall ``seconds`` of the training loop.
    """
    warmup = max(1, steps // 20)
    schedule: Callable[[int], float] = \
        lambda s: min((s + 1) / warmup, 1.0 - 0.9 * max(0, s - warmup) / steps)  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    losses = []
    t0 = time.perf_counter()
    for x, y in make_batches(steps, batch, block, seed=seed):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        eval_loss = statistics.mean(
            model(x, y).item() for x, y in make_batches(8, batch, block, seed=10_000 + seed))
    return dict(losses=losses, final_train=statistics.mean(losses[-10:]), eval_loss=eval_loss,
                seconds=seconds)
