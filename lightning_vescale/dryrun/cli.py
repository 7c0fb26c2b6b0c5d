"""``python -m lightning_vescale.dryrun``: will it fit on N GPUs, and with which settings?

One training step of ``fully_shard`` (and of torch's FSDP2) as rank r of N under torch's fake
process group, on FakeTensors (design note [dryrun])::

    python -m lightning_vescale.dryrun --preset llama3-70b --world-size 1024
    python -m lightning_vescale.dryrun --preset deepseek-v3 --world-size 64 --replicas 8 \\
        --optimizer adamw8bit --granularity 256 --activation-checkpointing
    python -m lightning_vescale.dryrun --hf-config path/to/config.json --world-size 64
    python -m lightning_vescale.dryrun --model my_pkg.models:GPT --init-args '{"n_layer": 4}'
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lightning_vescale.dryrun._run import OPTIMIZERS
from lightning_vescale.planner.cli import _granularity_arg
from lightning_vescale.planner.presets import PRESETS

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lightning_vescale.dryrun",
                                description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("model (one of)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="transformer shape preset")
    src.add_argument("--config", help="JSON TransformerConfig fields overriding the preset "
                     "(e.g. '{\"layers\": 4}'), or attributes of --hf-config")
    src.add_argument("--hf-config", help="a transformers config.json (file or directory)")
    src.add_argument("--model", help="'pkg.module:ClassName' (an nn.Module/LightningModule "
                     "whose forward takes token ids)")
    src.add_argument("--init-args", help="JSON keyword arguments for --model's class")
    p.add_argument("--world-size", type=int, required=True, help="ranks N")
    p.add_argument("--rank", type=int, default=0, help="the rank to be (default 0)")
    p.add_argument("--replicas", type=int, default=1, help="HSDP replicas (default 1: FSDP)")
    p.add_argument("--batch-size", type=int, default=1, help="micro-batch per rank")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--granularity", type=_granularity_arg, default=None,
                   help="fully_shard's granularity (ours only)")
    p.add_argument("--reshard-after-forward", choices=("default", "true", "false"),
                   default="default")
    p.add_argument("--mixed-precision", choices=("bf16", "none"), default="bf16")
    p.add_argument("--comm-policy", help="JSON CommPolicy fields (ours only), e.g. "
                   "'{\"all_gather\": \"int8\"}'")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="every block recomputes its forward in backward")
    p.add_argument("--engines", default="vescale,fsdp2",
                   help="comma-separated: vescale, fsdp2 (default both)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--chart", metavar="PNG", help="also write a bar chart of memory per rank "
                   "by category, ours vs FSDP2 (needs matplotlib: the 'plot' extra)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from lightning_vescale.dryrun import dry_run, format_report

    sources = [bool(args.preset), bool(args.hf_config), bool(args.model)]
    if sum(sources) != 1:
        print("error: give exactly one of --preset, --hf-config, --model", file=sys.stderr)
        return 2
    if args.chart:  # before the dry run: a missing matplotlib must not cost its minutes
        from lightning_vescale.dryrun._chart import require_matplotlib
        try:
            require_matplotlib()
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    overrides = json.loads(args.config) if args.config else None
    comm = None
    if args.comm_policy:
        from lightning_vescale.fsdp import CommPolicy
        comm = CommPolicy(**json.loads(args.comm_policy))
    raf = {"default": None, "true": True, "false": False}[args.reshard_after_forward]
    report = dry_run(
        args.model or args.preset, hf_config=args.hf_config, world_size=args.world_size,
        rank=args.rank, replicas=args.replicas, engines=tuple(args.engines.split(",")),
        batch_size=args.batch_size, seq_len=args.seq_len, optimizer=args.optimizer,
        granularity=args.granularity, reshard_after_forward=raf,
        mixed_precision=None if args.mixed_precision == "none" else "bf16",
        comm_policy=comm, activation_checkpointing=args.activation_checkpointing,
        init_args=json.loads(args.init_args) if args.init_args else None,
        overrides=overrides)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1, default=str))
    else:
        print(format_report(report))
    if args.chart:
        from lightning_vescale.dryrun._chart import write_chart
        print(f"chart: {write_chart(report, args.chart)}", file=sys.stderr)
    return 0
