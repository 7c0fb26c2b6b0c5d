"""Quality: AdamW, Muon, SOAP and Shampoo on the small GPT, equal steps, tuned learning rates.

Trains ``examples/gpt.py``'s GPT on its embedded character data, single process (the
distributed optimizers equal one process: tests/distributed/test_soap_dist.py), with the same
seeds, data and number of steps for each optimizer, after a learning-rate sweep for each (grids
printed; the best lr by mean final training loss over the seeds). Reports the final training
loss (mean of the last 10 steps), the held-out loss, and how many steps each optimizer needs to
reach AdamW's final training loss (first step where its 10-step mean curve is at or below it).
Saves the curves to ``benchmarks/figures/soap_quality.png`` and the numbers to
``benchmarks/out/soap_quality.json``.

Run:  python benchmarks/soap_quality.py            (~5 min on 1 busy CPU core)
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
from lightning_vescale.optim import SOAP, Muon, Shampoo  # noqa: E402

OUT_DIR = os.path.join(ROOT, "benchmarks", "out")
FIG_DIR = os.path.join(ROOT, "benchmarks", "figures")
GRIDS = {"adamw": [1e-3, 3e-3, 1e-2, 3e-2], "muon": [0.02, 0.05, 0.1],
         "soap": [3e-3, 1e-2, 3e-2], "shampoo": [3e-3, 1e-2, 3e-2]}


def _optimizer(kind: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    if kind == "muon":
        return Muon(model.named_parameters(), lr=lr, weight_decay=0.1, adamw_lr=3e-3,
                    adamw_betas=(0.9, 0.95), adamw_weight_decay=0.1)
    if kind == "soap":
        return SOAP(model.parameters(), lr=lr, betas=(0.95, 0.95), weight_decay=0.1,
                    precondition_frequency=10)
    return Shampoo(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, epsilon=1e-10,
                   precondition_frequency=10, start_preconditioning_step=10,
                   grafting_beta2=0.95)


def _smooth(v: list[float], w: int = 10) -> list[float]:
    return [statistics.mean(v[max(0, i - w + 1): i + 1]) for i in range(len(v))]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out-dir", default=None, help="where the JSON and PNG go (default: "
                    "benchmarks/out and benchmarks/figures)")
    args = ap.parse_args(argv)
    out_dir, fig_dir = (args.out_dir, args.out_dir) if args.out_dir else (OUT_DIR, FIG_DIR)
    torch.set_num_threads(1)
    os.makedirs(out_dir, exist_ok=True)
    best = {}
    for kind, lrs in GRIDS.items():
        results = {}
        for lr in lrs:
            runs = []
            for seed in args.seeds:
                model = build_gpt(args.layers, args.d_model, args.block, seed)
                runs.append(train_lm(model, _optimizer(kind, model, lr), steps=args.steps,
                                     batch=args.batch, block=args.block, seed=seed))
            results[lr] = runs
            print(f"{kind:8s} lr={lr:<7g} final train "
                  f"{statistics.mean(r['final_train'] for r in runs):.4f}  held-out "
                  f"{statistics.mean(r['eval_loss'] for r in runs):.4f}  "
                  f"({statistics.mean(r['seconds'] for r in runs):.1f} s/run)", flush=True)
        lr = min(lrs, key=lambda x: statistics.mean(r["final_train"] for r in results[x]))
        runs = results[lr]
        best[kind] = dict(lr=lr, final_train=statistics.mean(r["final_train"] for r in runs),
                          eval_loss=statistics.mean(r["eval_loss"] for r in runs),
                          seconds=statistics.mean(r["seconds"] for r in runs),
                          curve=[statistics.mean(v) for v in zip(*(r["losses"] for r in runs))])
    target = best["adamw"]["final_train"]
    print(f"\n{args.steps} steps, GPT {args.layers}x{args.d_model}, seeds {args.seeds}; "
          f"grids {GRIDS}")
    print("| optimizer | best lr | final train loss | held-out loss | steps to AdamW's final "
          "loss | s/run |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind, b in best.items():
        reach = next((i + 1 for i, v in enumerate(_smooth(b["curve"])) if v <= target), None)
        b["steps_to_adamw_final"] = reach
        shown = f"{reach} ({reach / args.steps:.0%})" if reach else "not reached"
        print(f"| {kind} | {b['lr']:g} | {b['final_train']:.4f} | {b['eval_loss']:.4f} | "
              f"{shown} | {b['seconds']:.1f} |")
    with open(os.path.join(out_dir, "soap_quality.json"), "w") as f:
        json.dump({"args": vars(args), "grids": GRIDS, "best": best}, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, b in best.items():
        ax.plot(_smooth(b["curve"]), label=f"{kind} (lr={b['lr']:g})")
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean, mean of seeds)")
    ax.set_title(f"GPT {args.layers}x{args.d_model}, char LM, seeds {args.seeds}")
    ax.legend()
    ax.grid(alpha=0.3)
    os.makedirs(fig_dir, exist_ok=True)
    path = os.path.join(fig_dir, "soap_quality.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
