"""The dry run's chart for the docs: memory per rank by category, ours vs FSDP2 (issue 36).

Runs ``lightning_vescale.dry_run`` (both engines, bf16 mixed precision, every block
checkpointed, AdamW) as rank 0 of ``--world-size`` and draws the report with
``lightning_vescale.dryrun.write_chart`` (what ``python -m lightning_vescale.dryrun --chart``
writes) to ``docs/guides/img/dryrun_memory.png``, the figure of ``docs/guides/dryrun.md``; the
report goes to ``benchmarks/out/dryrun_<preset>_<N>.json``. ``--from-json`` redraws from a saved
report (the CLI's ``--json`` output) without running again.

Run:  python benchmarks/dryrun_chart.py                    (Llama-3-70B at 1,024 ranks: FSDP2's
      side takes ~9 min on a busy 2-core machine, ours ~1 min)
      python benchmarks/dryrun_chart.py --from-json benchmarks/out/dryrun_llama3-70b_1024.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from lightning_vescale.dryrun import dry_run, write_chart  # noqa: E402

FIGURE = os.path.join(ROOT, "docs", "guides", "img", "dryrun_memory.png")
OUT_DIR = os.path.join(ROOT, "benchmarks", "out")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-70b")
    p.add_argument("--world-size", type=int, default=1024)
    p.add_argument("--from-json", help="a saved report (python -m lightning_vescale.dryrun "
                   "--json) to draw instead of running")
    p.add_argument("--out", default=FIGURE)
    args = p.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            report = json.load(f)
    else:
        rep = dry_run(args.preset, world_size=args.world_size, activation_checkpointing=True)
        report = rep.as_dict()
        os.makedirs(OUT_DIR, exist_ok=True)
        path = os.path.join(OUT_DIR, f"dryrun_{args.preset}_{args.world_size}.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"report: {path}")
    print(f"figure: {write_chart(report, args.out)}")


if __name__ == "__main__":
    main()
