"""Quality: Muon (+ AdamW for embeddings/head/1-D) vs AdamW alone on the small GPT, equal steps.

Trains ``examples/gpt.py``'s GPT on its embedded character data, single process, with the same
seed, data and number of steps for each optimizer, after a small learning-rate sweep for each
(so neither side wins by a badly chosen lr). Reports the final training loss (mean of the last
10 steps) and the loss on held-out batches (a different sampling seed), averaged over seeds, and
saves the curves to ``benchmarks/out/muon_quality.png`` (and ``.json``).

Run:  python benchmarks/muon_quality.py            (~10 min on 1 busy CPU core)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from benchmarks._lm import build_gpt, train_lm  # noqa: E402
from lightning_vescale.optim import Muon  # noqa: E402

OUT_DIR = os.path.join(ROOT, "benchmarks", "out")


def train(kind: str, lr: float, args, seed: int) -> dict:
    model = build_gpt(args.layers, args.d_model, args.block, seed)
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    else:  # Muon for hidden matrices; embeddings/head/1-D on AdamW at AdamW's best lr
        opt = Muon(model.named_parameters(), lr=lr, weight_decay=0.1, momentum=0.95,
                   adamw_lr=args.adamw_lr_for_muon, adamw_betas=(0.9, 0.95),
                   adamw_weight_decay=0.1)
    run = train_lm(model, opt, steps=args.steps, batch=args.batch, block=args.block, seed=seed)
    return dict(kind=kind, lr=lr, seed=seed, **run)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--adamw-lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3])
    ap.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(OUT_DIR, exist_ok=True)

    def sweep(kind, lrs):
        runs = {lr: [train(kind, lr, args, s) for s in args.seeds] for lr in lrs}
        for lr, rs in runs.items():
            final = statistics.mean(r["final_train"] for r in rs)
            print(f"{kind:6s} lr={lr:<7g} final train {final:.4f}"
                  f"  held-out {statistics.mean(r['eval_loss'] for r in rs):.4f}"
                  f"  ({statistics.mean(r['seconds'] for r in rs):.1f} s/run)", flush=True)
        best = min(lrs, key=lambda lr: statistics.mean(r["final_train"] for r in runs[lr]))
        return best, runs[best]

    best_adamw_lr, adamw_runs = sweep("adamw", args.adamw_lrs)
    args.adamw_lr_for_muon = best_adamw_lr
    best_muon_lr, muon_runs = sweep("muon", args.muon_lrs)

    def summary(runs):
        return dict(final_train=statistics.mean(r["final_train"] for r in runs),
                    eval_loss=statistics.mean(r["eval_loss"] for r in runs),
                    curve=[statistics.mean(v) for v in zip(*(r["losses"] for r in runs))])

    a, m = summary(adamw_runs), summary(muon_runs)
    print(f"\nbest AdamW lr={best_adamw_lr:g}, best Muon lr={best_muon_lr:g} "
          f"(Muon's AdamW part at lr={best_adamw_lr:g}); {args.steps} steps, "
          f"seeds {args.seeds}")
    print("| optimizer | final train loss (last 10 steps) | held-out loss |")
    print("|---|---|---|")
    print(f"| AdamW | {a['final_train']:.4f} | {a['eval_loss']:.4f} |")
    print(f"| Muon  | {m['final_train']:.4f} | {m['eval_loss']:.4f} |")
    print(f"Muon/AdamW held-out loss ratio: {m['eval_loss'] / a['eval_loss']:.3f}")
    for frac in (0.25, 0.5, 1.0):
        k = max(1, int(args.steps * frac)) - 1
        print(f"  step {k + 1}: AdamW {a['curve'][k]:.4f}  Muon {m['curve'][k]:.4f}")
    with open(os.path.join(OUT_DIR, "muon_quality.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items()}, "adamw": a, "muon": m,
                   "best_adamw_lr": best_adamw_lr, "best_muon_lr": best_muon_lr}, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return

    def smooth(v, w=10):
        return [statistics.mean(v[max(0, i - w + 1): i + 1]) for i in range(len(v))]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(smooth(a["curve"]), label=f"AdamW (lr={best_adamw_lr:g})")
    ax.plot(smooth(m["curve"]), label=f"Muon (lr={best_muon_lr:g}) + AdamW fallback")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title(f"GPT {args.layers}x{args.d_model}, char LM, mean of seeds {args.seeds}")
    ax.legend()
    ax.grid(alpha=0.3)
    path = os.path.join(OUT_DIR, "muon_quality.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
