"""Padding of the structure-aware planner vs. its lower bound, FSDP2 and FSDP1 sharding.

For a transformer preset grouped per block (the FSDP2 way: ``fully_shard`` on every block, then
the root), plan every group at world sizes 8..16384 and element, row, 32-row and 128-row
granularity, and print, summed over groups:

* planner padding (``sum(m*S - real) / sum(m*S)``) and the lower bound's padding,
* FSDP2-style even row-wise sharding (dim 0 padded to a multiple of ``m``) and FSDP1-style flat
  sharding (concatenate, pad to a multiple of ``m``), with the number of tensors whose blocks of
  the requested granularity they cut across ranks (the planner never cuts one),
* the planner's load imbalance (max/mean real elements per rank) and planning time.

Then time planning DeepSeek-V3 (45,395 tensors, 671B parameters) at 10,000 ranks.

    python benchmarks/planner_padding.py                      # LLaMA-3-70B-like, prints tables
    python benchmarks/planner_padding.py --markdown benchmarks/RESULTS_planner.md

Pure Python, no process group, no GPU; a minute on one core.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_vescale.planner import (  # noqa: E402
    DEFAULT_ALIGN,
    PRESETS,
    fsdp1_flat,
    fsdp2_even_rowwise,
    num_params,
    plan_layout,
    transformer_groups,
)

WORLD_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
GRANULARITIES = ["element", "row", "32rows", "128rows"]


def padding_rows(preset: str, grouping: str, world_sizes, granularities, align: int):
    groups = transformer_groups(PRESETS[preset], grouping)
    rows = []
    for g in granularities:
        for m in world_sizes:
            t0 = time.process_time()
            plans = [plan_layout(p, m, granularity=g, align=align) for _, p in groups]
            seconds = time.process_time() - t0
            total = sum(p.total_numel for p in plans)
            buf = sum(p.buffer_size for p in plans)
            lb = sum(p.lower_bound for p in plans) * m
            loads = [0] * m
            for p in plans:
                for r, x in enumerate(p.rank_loads()):
                    loads[r] += x
            f2 = [fsdp2_even_rowwise(p, m, granularity=g) for _, p in groups]
            f1 = [fsdp1_flat(p, m, granularity=g) for _, p in groups]
            f2buf = sum(f.buffer_size for f in f2)
            f1buf = sum(f.buffer_size for f in f1)
            rows.append({
                "granularity": g, "world_size": m,
                "planner": (buf - total) / buf, "lower_bound": (lb - total) / lb,
                "at_lb": sum(p.optimal for p in plans), "groups": len(plans),
                "fsdp2": (f2buf - total) / f2buf, "fsdp2_split": sum(f.split_tensors for f in f2),
                "fsdp1": (f1buf - total) / f1buf, "fsdp1_split": sum(f.split_tensors for f in f1),
                "imbalance": max(loads) * m / total, "seconds": seconds,
            })
    return rows


def format_padding(rows, markdown: bool) -> str:
    head = ["granularity", "world", "planner pad", "lower bound", "groups at LB", "FSDP2 pad",
            "FSDP2 split", "FSDP1 pad", "FSDP1 split", "planner max/mean", "plan time"]
    body = [[
        r["granularity"], str(r["world_size"]), f"{100 * r['planner']:.3f}%",
        f"{100 * r['lower_bound']:.3f}%", f"{r['at_lb']}/{r['groups']}",
        f"{100 * r['fsdp2']:.3f}%", str(r["fsdp2_split"]), f"{100 * r['fsdp1']:.3f}%",
        str(r["fsdp1_split"]), f"{r['imbalance']:.4f}", f"{1e3 * r['seconds']:.1f} ms",
    ] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(lines)
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head)] + [fmt.format(*b) for b in body])


class TimingRow(NamedTuple):
    """Planning time of one DeepSeek-V3 grouping and granularity (process CPU seconds)."""

    grouping: str
    groups: int
    granularity: str
    median: float
    max: float
    padding: float
    lower_bound: float  # padding at the lower bound


def timing_rows(world_size: int, repeats: int, align: int) -> list[TimingRow]:
    """Planning time (process CPU seconds, median of ``repeats``) of DeepSeek-V3."""
    out = []
    for grouping in ("block", "model"):
        groups = transformer_groups(PRESETS["deepseek-v3"], grouping)
        for g in ("element", "row", "32rows"):
            times = []
            for _ in range(repeats):
                t0 = time.process_time()
                plans = [plan_layout(p, world_size, granularity=g, align=align) for _, p in groups]
                times.append(time.process_time() - t0)
            total = sum(p.total_numel for p in plans)
            buf = sum(p.buffer_size for p in plans)
            lb = sum(p.lower_bound for p in plans) * world_size
            out.append(TimingRow(
                grouping=grouping, groups=len(groups), granularity=g,
                median=statistics.median(times), max=max(times),
                padding=(buf - total) / buf, lower_bound=(lb - total) / lb,
            ))
    return out


def format_timing(rows, markdown: bool) -> str:
    head = ["grouping", "groups", "granularity", "plan time (median)", "max", "padding",
            "lower bound"]
    body = [[r.grouping, str(r.groups), r.granularity, f"{r.median:.3f} s", f"{r.max:.3f} s",
             f"{100 * r.padding:.4f}%", f"{100 * r.lower_bound:.4f}%"] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    return "\n".join("  ".join(f"{c:>18}" for c in r) for r in [head] + body)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-70b", choices=sorted(PRESETS))
    p.add_argument("--groupings", nargs="+", default=["block", "model"],
                   choices=("block", "model"), help="one table per grouping")
    p.add_argument("--world-sizes", type=int, nargs="+", default=WORLD_SIZES)
    p.add_argument("--granularities", nargs="+", default=GRANULARITIES)
    p.add_argument("--align", type=int, default=DEFAULT_ALIGN)
    p.add_argument("--timing-world-size", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--markdown", type=Path, help="also write the tables to this Markdown file")
    args = p.parse_args(argv)

    cfg = PRESETS[args.preset]
    tables = []
    for grouping in args.groupings:
        rows = padding_rows(args.preset, grouping, args.world_sizes, args.granularities,
                            args.align)
        title = (f"{args.preset} ({num_params(cfg):,} parameters), grouping={grouping}, "
                 f"align={args.align}")
        print(title)
        print(format_padding(rows, markdown=False))
        print()
        tables.append((title, rows))
    timing = timing_rows(args.timing_world_size, args.repeats, args.align)
    print(f"\nDeepSeek-V3 ({num_params(PRESETS['deepseek-v3']):,} parameters) at "
          f"{args.timing_world_size} ranks, CPU seconds:")
    print(format_timing(timing, markdown=False))
    if args.markdown:
        machine = f"{platform.python_implementation()} {platform.python_version()}, " \
                  f"{platform.machine()}"
        text = "\n".join([
            "# Planner: padding and planning time",
            "",
            f"Reproduce: `python benchmarks/planner_padding.py --markdown {args.markdown}` "
            f"({machine}; times are process CPU seconds, so other load on the machine does not "
            "inflate them).",
            "",
            "Padding is `sum(m*S - real) / sum(m*S)` over all groups (the fraction of every "
            "all-gather/reduce-scatter that is waste). *Lower bound*: the smallest admissible "
            "`S` for any order (`shard_size_lower_bound`); *groups at LB*: groups whose plan is "
            "provably optimal. *Split*: tensors with a block of the requested granularity cut "
            "across ranks (the planner: never). FSDP2 pads each dim 0 to a multiple of `m` and "
            "keeps whole rows but not whole multi-row blocks; FSDP1 pads only the flat total "
            "and cuts anywhere.",
            "",
            *[part for title, rows in tables for part in (
                f"## Padding: {title}", "", format_padding(rows, markdown=True), "")],
            f"## Planning time: DeepSeek-V3 at {args.timing_world_size} ranks",
            "",
            "45,395 tensors (one module per routed expert, as in the Hugging Face model); "
            f"median of {args.repeats} runs.",
            "",
            format_timing(timing, markdown=True),
            "",
            "## Reading the tables",
            "",
            "* The planner's padding equals the lower bound wherever *groups at LB* is full: "
            "there it is optimal for any tensor order, not just the given one.",
            "* Per-block groups with coarse blocks at many ranks pay a structural price: a "
            "tensor spanning more than two shards forces `S` to a multiple of its block, so `S` "
            "is a multiple of the lcm of all such blocks (LLaMA-3-70B rows: "
            "lcm(8192, 28672) = 57344 elements; 32-row blocks: 1,835,008). When that lcm "
            "exceeds the mean per-rank load, padding explodes *for any layout that keeps "
            "blocks whole*; larger groups (the whole-model table) or finer blocks fix it.",
            "* FSDP2's even row-wise sharding has less padding at power-of-two world sizes "
            "up to 1,024 (LLaMA dims divide them) but cuts multi-row blocks (*split*) and "
            "explodes once `m` exceeds small dim-0 sizes; FSDP1 never pads but cuts rows.",
            "* Where the exact scan's budget runs out (large instances), the guided search "
            "(jumps, learned steps, bisection) is used; on every case above that we re-ran "
            "with an unlimited exact scan, it returned the order-optimal `S`.",
            "",
        ])
        args.markdown.write_text(text)
        print(f"\nwrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
