"""Draw the figures of the Concepts pages from the real planner's output.

    python docs/draw_figures.py            # writes docs/concepts/img/*.png
    python docs/draw_figures.py --out DIR  # elsewhere (tests/docs/test_docs_site.py does)

Every box in the figures is a number the planner (``plan_layout``) or the FSDP2 baseline
(``planner.baselines``' row-wise rule) computed for one transformer block of the example GPT
(``examples/gpt.py``, ``n_embd=64``) over 4 ranks, with the granularities training uses by
default (``default_granularity``: element-wise, multiples of 256 elements for tensors of 4,096+
elements). Needs matplotlib (the ``dev`` or ``plot`` extra).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from examples.gpt import GPT, GPTConfig  # noqa: E402
from lightning_vescale.planner import LayoutPlan, TensorSpec, plan_layout  # noqa: E402
from lightning_vescale.planner._granularity import default_granularity  # noqa: E402

WORLD = 4
COLORS = plt.get_cmap("tab20").colors


def block_specs() -> list[TensorSpec]:
    """The parameters of one block of the example GPT, as ``fully_shard`` hands them over."""
    block = GPT(GPTConfig(n_embd=64, n_head=4, n_layer=1)).blocks[0]
    return [TensorSpec(name, tuple(p.shape), default_granularity(p.shape))
            for name, p in block.named_parameters()]


def _legend(ax, specs: list[TensorSpec]) -> None:
    handles = [Rectangle((0, 0), 1, 1, color=COLORS[i % 20]) for i in range(len(specs))]
    labels = [f"{s.name} {tuple(s.shape)}" for s in specs]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", hatch="///", edgecolor="grey"))
    labels.append("padding")
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3,
              fontsize=7, frameon=False)


def draw_buffer(plan: LayoutPlan, specs: list[TensorSpec], path: Path) -> None:
    """One group's flat buffer (DBuffer) and where the rank boundaries fall."""
    fig, ax = plt.subplots(figsize=(11, 2.8))
    size = plan.buffer_size
    ax.add_patch(Rectangle((0, 0), size, 1, facecolor="white", hatch="///", edgecolor="grey"))
    for i, s in enumerate(specs):
        start = plan.offsets[s.name]
        ax.add_patch(Rectangle((start, 0), math.prod(s.shape), 1, color=COLORS[i % 20]))
        g = s.granularity
        if g > 1:  # the blocks that never straddle a rank boundary
            for b in range(start, start + math.prod(s.shape) + 1, g):
                ax.plot([b, b], [0.85, 1.0], color="black", linewidth=0.3)
    for r in range(WORLD + 1):
        x = r * plan.shard_size
        ax.axvline(x, color="red", linewidth=2)
        if r < WORLD:
            ax.text(x + plan.shard_size / 2, 1.12, f"rank {r}: {plan.rank_loads()[r]:,} elements",
                    ha="center", fontsize=9)
    ax.set_xlim(0, size)
    ax.set_ylim(0, 1.35)
    ax.set_yticks([])
    ax.set_xlabel(f"buffer offset (elements); shard size S = {plan.shard_size:,}, "
                  f"padding {plan.padding_ratio:.2%}; ticks: 256-element blocks")
    ax.set_title("The planner's layout of one GPT block over 4 ranks (one DBuffer)")
    _legend(ax, specs)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_fsdp2(specs: list[TensorSpec], path: Path) -> None:
    """What FSDP2 does instead: every tensor's dim 0 split evenly, so each rank's part of the
    group is one chunk per tensor, padded, copied into a communication buffer (and back)."""
    fig, ax = plt.subplots(figsize=(11, 2.8))
    x = 0
    for r in range(WORLD):
        for i, s in enumerate(specs):
            rows = s.shape[0]
            row = math.prod(s.shape[1:])
            chunk = -(-rows // WORLD)
            have = max(0, min(chunk, rows - r * chunk)) * row
            ax.add_patch(Rectangle((x, 0), have, 1, color=COLORS[i % 20]))
            ax.add_patch(Rectangle((x + have, 0), chunk * row - have, 1, facecolor="white",
                                   hatch="///", edgecolor="grey"))
            x += chunk * row
        ax.axvline(x, color="red", linewidth=2)
    per_rank = x // WORLD
    for r in range(WORLD):
        ax.text(per_rank * (r + 0.5), 1.12, f"rank {r}", ha="center",
                fontsize=9)
    ax.set_xlim(0, x)
    ax.set_ylim(0, 1.35)
    ax.set_yticks([])
    ax.set_xlabel("all-gather buffer (elements): each rank copies its chunks in, and every "
                  "tensor is copied out of the gathered buffer")
    ax.set_title("FSDP2: the same block, each rank one dim-0 chunk of every tensor")
    _legend(ax, specs)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def draw_ragged(plan: LayoutPlan, specs: list[TensorSpec], path: Path) -> None:
    """RaggedShard: each tensor's units per rank, uneven and possibly zero."""
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(specs) + 1.2))
    for y, s in enumerate(reversed(specs)):
        numel = math.prod(s.shape)
        for r in range(WORLD):
            lo, hi = plan.local_range(s.name, r)
            if hi > lo:
                ax.add_patch(Rectangle((lo / numel, y + 0.1), (hi - lo) / numel, 0.8,
                                       color=plt.get_cmap("Set2").colors[r], ec="black", lw=0.5))
                ax.text((lo + hi) / 2 / numel, y + 0.5, f"r{r}: {hi - lo:,}", ha="center",
                        va="center", fontsize=7)
        placement = plan.placement(s.name)
        ax.text(1.01, y + 0.5, f"{s.name}  local_units={tuple(placement.local_units)}",
                va="center", fontsize=7)
    ax.set_xlim(0, 1)
    ax.set_ylim(0, len(specs))
    ax.set_yticks([])
    ax.set_xlabel("share of each tensor's elements, by rank")
    ax.set_title("RaggedShard placements of the block's tensors (uneven; a rank may hold none)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "concepts" / "img")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = block_specs()
    plan = plan_layout(specs, WORLD)
    paths = [args.out / "dbuffer_layout.png", args.out / "fsdp2_layout.png",
             args.out / "ragged_placements.png"]
    draw_buffer(plan, specs, paths[0])
    draw_fsdp2(specs, paths[1])
    draw_ragged(plan, specs, paths[2])
    (args.out / "layout.txt").write_text(plan.describe() + "\n")
    for p in paths:
        print(f"wrote {p}")
    return paths


if __name__ == "__main__":
    main()
