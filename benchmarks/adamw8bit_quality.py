"""Quality: AdamW8bit vs fp32 torch.optim.AdamW on the small GPT, same seed, data and steps.

Trains ``examples/gpt.py``'s GPT on its embedded character data, single process, with identical
hyper-parameters for both optimizers (lr with warm-up and linear decay, betas (0.9, 0.95),
weight decay 0.1). Reports, averaged over seeds, the final training loss (mean of the last 10
steps) and the loss on held-out batches (another sampling seed), the relative difference
8-bit vs fp32, the share of parameters with 8-bit states, and saves the curves to
``benchmarks/out/adamw8bit_quality.png`` (matplotlib, optional) and ``.json``.

The default lr (1e-3) keeps the 300 steps in the learning regime; at 3e-3 the model memorises
the short embedded text (loss -> 0.3) and relative differences of near-zero losses say little.

Run:  python benchmarks/adamw8bit_quality.py           (~2-3 min on 1 CPU core)
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
from lightning_vescale.optim import AdamW8bit  # noqa: E402

OUT_DIR = os.path.join(ROOT, "benchmarks", "out")


def train(kind: str, args, seed: int) -> dict:
    model = build_gpt(args.layers, args.d_model, args.block, seed)
    hp = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    opt = AdamW8bit(model.parameters(), **hp) if kind == "adamw8bit" else \
        torch.optim.AdamW(model.parameters(), **hp)
    run = train_lm(model, opt, steps=args.steps, batch=args.batch, block=args.block, seed=seed)
    n = sum(p.numel() for p in model.parameters())
    n8 = sum(p.numel() for p in model.parameters() if p.numel() >= 4096)
    return dict(kind=kind, seed=seed, params=n, params_8bit=n8, **run)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(OUT_DIR, exist_ok=True)

    runs = {k: [train(k, args, s) for s in args.seeds] for k in ("adamw", "adamw8bit")}
    summary = {}
    for k, rs in runs.items():
        summary[k] = dict(
            final_train=statistics.mean(r["final_train"] for r in rs),
            eval_loss=statistics.mean(r["eval_loss"] for r in rs),
            seconds=statistics.mean(r["seconds"] for r in rs),
        )
    r0 = runs["adamw"][0]
    print(f"GPT: {r0['params']:,} parameters, {r0['params_8bit'] / r0['params']:.1%} of them with "
          f"8-bit states; {args.steps} steps, lr {args.lr}, seeds {args.seeds}")
    print(f"{'optimizer':10s} {'final train':>12s} {'held-out':>10s} {'s/run':>7s}")
    for k, s in summary.items():
        print(f"{k:10s} {s['final_train']:12.4f} {s['eval_loss']:10.4f} {s['seconds']:7.1f}")
    rel_train = summary["adamw8bit"]["final_train"] / summary["adamw"]["final_train"] - 1
    rel_eval = summary["adamw8bit"]["eval_loss"] / summary["adamw"]["eval_loss"] - 1
    per_seed = [b["final_train"] / a["final_train"] - 1
                for a, b in zip(runs["adamw"], runs["adamw8bit"])]
    def window(r, i):  # mean of the 10 steps ending at step i (fewer at the start)
        return statistics.mean(r["losses"][max(0, i - 9):i + 1])

    curve_gap = max(abs(window(b, i) / window(a, i) - 1)
                    for a, b in zip(runs["adamw"], runs["adamw8bit"])
                    for i in range(args.steps // 10, args.steps))
    print(f"8-bit vs fp32: final train {rel_train:+.2%} (per seed "
          f"{', '.join(f'{x:+.2%}' for x in per_seed)}), held-out {rel_eval:+.2%}; "
          f"largest gap of the 10-step-averaged curves after step {args.steps // 10}: "
          f"{curve_gap:.2%}")
    if len(runs["adamw"]) > 1:
        fp = [r["final_train"] for r in runs["adamw"]]
        print(f"(for scale: fp32 AdamW's own seed-to-seed spread of the final train loss is "
              f"{(max(fp) - min(fp)) / statistics.mean(fp):.2%})")
    ok = abs(rel_train) < 0.01 and abs(rel_eval) < 0.01
    print("PASS: within 1% relative" if ok else "FAIL: more than 1% apart")

    out = dict(args=vars(args), summary=summary, rel_final_train=rel_train, rel_eval=rel_eval,
               curve_gap=curve_gap, runs={k: [{kk: vv for kk, vv in r.items()} for r in rs]
                                          for k, rs in runs.items()})
    with open(os.path.join(OUT_DIR, "adamw8bit_quality.json"), "w") as f:
        json.dump(out, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install matplotlib)")
        return out
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})

    def smooth(xs):
        return [statistics.mean(xs[max(0, j - 9):j + 1]) for j in range(len(xs))]

    for k, color in (("adamw", "tab:blue"), ("adamw8bit", "tab:orange")):
        for i, r in enumerate(runs[k]):
            ax.plot(smooth(r["losses"]), color=color, alpha=1.0 if i == 0 else 0.5,
                    label=f"{k} (seed {r['seed']})")
    for a, b in zip(runs["adamw"], runs["adamw8bit"]):
        sa, sb = smooth(a["losses"]), smooth(b["losses"])
        ax2.plot([100 * (y / x - 1) for x, y in zip(sa, sb)], label=f"seed {a['seed']}")
    ax2.axhline(0, color="gray", lw=0.5)
    ax2.set_ylabel("8-bit / fp32 - 1 (%)")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8)
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title(f"AdamW8bit vs fp32 AdamW, GPT {r0['params'] / 1e6:.2f}M params, lr {args.lr}")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(OUT_DIR, "adamw8bit_quality.png")
    fig.savefig(path, dpi=120)
    print(f"curves: {path}")
    return out


if __name__ == "__main__":
    main()
