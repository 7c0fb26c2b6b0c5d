"""``python -m lightning_vescale.consolidate IN OUT``: a sharded checkpoint to one full file.

A sharded checkpoint (the default ``state_dict_type="sharded"``: a directory that every rank
wrote its part of) needs this package and ``torch.distributed.checkpoint`` to load. This command
reads it in one process, without GPUs or a process group, and writes the *full* format: one
``torch.save`` file with full tensors that a single-process or DDP run (or any tool) can read::

    python -m lightning_vescale.consolidate checkpoints/last.ckpt full.ckpt
    python -m lightning_vescale.consolidate checkpoints/last.ckpt weights.pt --state-dict-only
    python -m lightning_vescale.consolidate downloaded/ckpt full.ckpt --trust   # see below

*Full file* (default): the Lightning checkpoint layout (``state_dict``, ``optimizer_states`` in
torch's plain per-index format, loops, callbacks, hyper-parameters); ``Trainer.fit(ckpt_path=)``
of any strategy, or ``torch.load``, reads it. ``--state-dict-only`` writes just the model's state
dict, under the LightningModule's names (e.g. ``model.blocks.0.attn.qkv.weight``).

*Safe by default.* Reading is :func:`lightning_vescale.checkpoint.consolidate` with
``weights_only=True``: no object in the checkpoint is unpickled except tensors and plain
containers, and every stored item is checked against the checkpoint's CRC-32 manifest. A
checkpoint holding other objects (custom classes in the hyper-parameters, say) is refused with an
error naming the file and the object; if you trust its source, pass ``--trust`` (the same as
``--no-weights-only``), which lets it run code while loading.

The output is written to a temporary sibling and renamed onto ``OUT``, so an interrupted run never
leaves half a file; an existing ``OUT`` is replaced only with ``--force``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_vescale.checkpoint import consolidate

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_vescale.consolidate",
        description="Convert a sharded (distributed) checkpoint directory into one full "
                    "checkpoint file, in one process (no GPUs, no process group).")
    p.add_argument("input", metavar="IN", help="the sharded checkpoint directory")
    p.add_argument("output", metavar="OUT", help="the full checkpoint file to write")
    p.add_argument("--weights-only", action=argparse.BooleanOptionalAction, default=True,
                   help="load safely: tensors and plain containers only (default); "
                        "--no-weights-only unpickles anything, for checkpoints you trust")
    p.add_argument("--trust", action="store_true",
                   help="the same as --no-weights-only")
    p.add_argument("--state-dict-only", action="store_true",
                   help="write only the model's state dict (no optimizer or trainer state)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    return p


def _summary(checkpoint: dict[str, Any]) -> str:
    tensors = [t for t in checkpoint.get("state_dict", checkpoint).values()
               if isinstance(t, torch.Tensor)]
    numel = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    opts = len(checkpoint.get("optimizer_states", ()))
    return (f"{len(tensors)} model tensors ({numel:,} elements, {nbytes / 2**20:.1f} MiB)"
            + (f", {opts} optimizer state(s)" if opts else ""))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    src, dst = Path(args.input), Path(args.output)
    weights_only = args.weights_only and not args.trust
    if dst.exists() and not args.force:
        parser.error(f"{str(dst)!r} exists; pass --force to replace it")
    if dst.resolve() == src.resolve():
        parser.error("IN and OUT must be different paths")
    try:
        checkpoint = consolidate(src, weights_only=weights_only)
    except (ValueError, RuntimeError, OSError) as exc:
        hint = ("" if not weights_only else
                " (if the checkpoint comes from a source you trust and holds other objects, "
                "--trust loads it without the weights_only restriction)")
        parser.error(f"cannot consolidate {str(src)!r}: {exc}{hint}")
    out: dict[str, Any] = checkpoint["state_dict"] if args.state_dict_only else checkpoint
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        torch.save(out, tmp)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    what = "state dict" if args.state_dict_only else "full checkpoint"
    print(f"wrote {what} {dst}: {_summary(out)}"
          f"{'' if weights_only else ' (loaded with weights_only=False)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
