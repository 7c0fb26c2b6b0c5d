"""``python -m lightning_vescale.consolidate IN OUT``: a sharded checkpoint to one full file.

A sharded checkpoint (the default ``state_dict_type="sharded"``: a directory that every rank
wrote its part of) needs this package and ``torch.distributed.checkpoint`` to load. This command
reads it in one process, without GPUs or a process group, and writes the *full* format: one
``torch.save`` file with full tensors that a single-process or DDP run (or any tool) can read::

    python -m lightning_vescale.consolidate checkpoints/last.ckpt full.ckpt
    python -m lightning_vescale.consolidate checkpoints/last.ckpt weights.pt --state-dict-only
    python -m lightning_vescale.consolidate downloaded/ckpt full.ckpt --trust   # see below

*Full file* (default): every entry of the checkpoint under its own key, with full tensors. A
Trainer checkpoint keeps the Lightning layout (``state_dict``, ``optimizer_states`` in torch's
plain per-index format, loops, callbacks, hyper-parameters), which ``Trainer.fit(ckpt_path=)`` of
any strategy, or ``torch.load``, reads; a Fabric checkpoint (``fabric.save(path, {"model": ...,
"optimizer": ..., "step": ...})``) keeps its state keys (each module's state dict, each
optimizer's state in the plain format, the other values as saved), which ``fabric.load`` of any
strategy reads. The command prints what it wrote. ``--state-dict-only`` writes just the model's
state dict (``state_dict``, or a Fabric checkpoint's one module entry), under the module's names
(e.g. ``model.blocks.0.attn.qkv.weight``).

*Safe by default.* Reading is :func:`lightning_vescale.checkpoint.consolidate` with
``weights_only=True``: no object in the checkpoint is unpickled except tensors and plain
containers, and every stored item is checked against the checkpoint's CRC-32 manifest. A
checkpoint holding other objects (custom classes in the hyper-parameters, say) is refused with an
error naming the file and the object, and the error suggests ``--trust`` (the same as
``--no-weights-only``), which lets it run code while loading: pass it only if you trust the
checkpoint's source. Other errors (a damaged file, a failed checksum) name the file and say nothing
of ``--trust``, which would not help.

*Hugging Face safetensors* (``--format safetensors``): ``OUT`` is a directory that gets the
model's weights as ``save_pretrained`` writes them (``model.safetensors`` or shards of
``--max-shard-size``, ``model.safetensors.index.json``, a CRC-32 ``.integrity.json``), for
``transformers``' ``from_pretrained`` (add the model's ``config.json``) or ``load_safetensors``.
``--strip-prefix model.`` keeps only the keys under the attribute the LightningModule holds the
Hugging Face model as, without it (``model.model.layers.0...`` -> ``model.layers.0...``);
``--dtype bf16`` converts floating-point tensors. Other files in ``OUT`` (``config.json``) are
kept::

    python -m lightning_vescale.consolidate checkpoints/last.ckpt hf_out --format safetensors \
        --strip-prefix model. --dtype bf16

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
from lightning_vescale.checkpoint._errors import CheckpointRefusedError
from lightning_vescale.checkpoint._hf_save import write_safetensors

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
    p.add_argument("--format", choices=["full", "safetensors"], default="full",
                   help="full: one torch.save file (default); safetensors: OUT is a directory of "
                        "Hugging Face safetensors shards + index (model weights only)")
    p.add_argument("--strip-prefix", default="", metavar="PREFIX",
                   help="safetensors: keep only keys starting with PREFIX, without it "
                        "(e.g. 'model.' for a LightningModule's self.model)")
    p.add_argument("--dtype", choices=sorted(_DTYPES),
                   help="safetensors: convert floating-point tensors (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="safetensors: bytes per shard file (default 5GB)")
    return p


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _write_safetensors(state: dict[str, Any], dst: Path, args: argparse.Namespace) -> str:
    """``--format safetensors``: the model state dict as HF shards in the directory ``dst``."""
    prefix = args.strip_prefix
    tensors = {k[len(prefix):]: v for k, v in state.items()
               if k.startswith(prefix) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise ValueError(f"no tensor key of the checkpoint starts with --strip-prefix "
                         f"{prefix!r} (keys: {sorted(state)[:4]}...)")
    write_safetensors(tensors, dst, max_shard_size=args.max_shard_size,
                      dtype=_DTYPES.get(args.dtype))
    return (f"wrote Hugging Face safetensors to {dst}: {_describe('state_dict', tensors)}"
            f"{f' (dtype {args.dtype})' if args.dtype else ''}")


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) state entry."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _describe(key: str, value: Any) -> str:
    tensors = _tensors(value)
    numel = sum(t.numel() for t in tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    size = f"{numel:,} elements, {nbytes / 2**20:.1f} MiB"
    if key == "state_dict":
        return f"{len(tensors)} model tensors ({size})"
    if key == "optimizer_states":
        return f"{len(value)} optimizer state(s) ({len(tensors)} tensors, {size})"
    if isinstance(value, dict) and "param_groups" in value:
        return f"{key!r}: optimizer state ({len(tensors)} tensors, {size})"
    return f"{key!r}: {len(tensors)} tensors ({size})"


def _summary(out: dict[str, Any], state_dict_only: bool) -> str:
    """What was written: every entry holding tensors, then how many other entries."""
    if state_dict_only:
        return _describe("state_dict", out)
    parts = [_describe(k, v) for k, v in out.items() if _tensors(v)]
    others = [k for k, v in out.items() if not _tensors(v)]
    if others:
        parts.append(f"{len(others)} other entr{'y' if len(others) == 1 else 'ies'}")
    return "; ".join(parts) or "no tensors"


def _model_state(checkpoint: dict[str, Any], src: Path) -> dict[str, Any]:
    """The model's state dict: ``state_dict`` (Trainer), or the one module entry (Fabric)."""
    if "state_dict" in checkpoint:
        return checkpoint["state_dict"]
    modules = [k for k, v in checkpoint.items() if isinstance(v, dict) and v
               and "param_groups" not in v
               and all(isinstance(t, torch.Tensor) for t in v.values())]
    if len(modules) != 1:
        raise ValueError(
            f"--state-dict-only: {str(src)!r} has no 'state_dict' key and "
            f"{'no' if not modules else len(modules)} entries that are module state dicts "
            f"({modules}); write the whole checkpoint instead (drop --state-dict-only).")
    return checkpoint[modules[0]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    src, dst = Path(args.input), Path(args.output)
    weights_only = args.weights_only and not args.trust
    if args.format == "safetensors":
        return _main_safetensors(parser, args, src, dst, weights_only)
    if dst.exists() and not args.force:
        parser.error(f"{str(dst)!r} exists; pass --force to replace it")
    if dst.resolve() == src.resolve():
        parser.error("IN and OUT must be different paths")
    try:
        checkpoint = consolidate(src, weights_only=weights_only)
        out = _model_state(checkpoint, src) if args.state_dict_only else checkpoint
    except (ValueError, RuntimeError, OSError) as exc:
        hint = ("" if not isinstance(exc, CheckpointRefusedError) else
                " (if the checkpoint comes from a source you trust, --trust loads it without the "
                "weights_only restriction)")
        parser.error(f"cannot consolidate {str(src)!r}: {exc}{hint}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    try:
        torch.save(out, tmp)
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    what = "state dict" if args.state_dict_only else "full checkpoint"
    print(f"wrote {what} {dst}: {_summary(out, args.state_dict_only)}"
          f"{'' if weights_only else ' (loaded with weights_only=False)'}")
    return 0


def _main_safetensors(parser: argparse.ArgumentParser, args: argparse.Namespace, src: Path,
                      dst: Path, weights_only: bool) -> int:
    if dst.exists() and not dst.is_dir():
        parser.error(f"{str(dst)!r} is a file; --format safetensors writes a directory")
    if dst.resolve() == src.resolve():
        parser.error("IN and OUT must be different paths")
    try:
        state = _model_state(consolidate(src, weights_only=weights_only), src)
        print(_write_safetensors(state, dst, args))
    except (ValueError, RuntimeError, OSError) as exc:
        hint = ("" if not isinstance(exc, CheckpointRefusedError) else
                " (if the checkpoint comes from a source you trust, --trust loads it without the "
                "weights_only restriction)")
        parser.error(f"cannot convert {str(src)!r}: {exc}{hint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
