"""The strategies' ``pretrained_weights``: start from a Hugging Face checkpoint, sharded.

Design note [pretrained-weights]
--------------------------------
``VeScaleFSDPStrategy(pretrained_weights=path)`` / ``VeScaleFabricStrategy(pretrained_weights=
path)`` load a Hugging Face safetensors checkpoint (a file, or a directory as ``save_pretrained``
writes it) into the model right after it is sharded, before any optimizer is built (the
Trainer's ``setup``, Fabric's ``setup_module``), with
:func:`lightning_vescale.checkpoint.load_safetensors`: each rank reads only the byte ranges of
its own shards, so no host ever holds the full model when the model is built on the meta device
(``configure_model`` under ``torch.device("meta")``, or ``init_module(empty_init=True)``). A meta
model loaded strictly is only allocated (``materialize(..., init_params=False)``: no
``reset_parameters()``, which for a multi-billion-parameter model is minutes of random numbers
the checkpoint overwrites at once; non-persistent buffers such as rotary ``inv_freq`` are still
recomputed, design note [meta-buffers]): a strict load writes every parameter or raises. A
non-strict load (``strict_loading = False``) may leave parameters out, so the model is first
materialised and initialised as usual (design note [fsdp-materialize]), then overwritten.

The checkpoint's keys are the Hugging Face model's own (``model.layers.0...``), while the
LightningModule usually holds that model as an attribute (``self.model``): the keys are matched
after the prefix that makes the most of them names of the module's state dict (``""``,
``"model."``, ...); none matching is an error listing a few keys of each. A checkpoint whose
layout ``transformers`` converts when loading (one tensor per expert for a model that stacks
them: Mixtral, Qwen3-MoE) is seen converted, each rank still reading only its own bytes (design
note [hf-convert]). Strictness follows the
LightningModule's ``strict_loading`` (Trainer) and is on for Fabric: a key of the module that the
checkpoint lacks, or the reverse, is an error naming them.

What is checked when: the strategy's constructor (:func:`validate_pretrained_weights`) opens
the checkpoint as the load will (``open_checkpoint``: headers only, a few KB a file), so a path
that does not exist, a directory with neither ``model.safetensors`` nor the index, a FIFO, device
or symlink out of the directory, a damaged or lying header, an index that does not match its
shards, or files of two saves fail before any process starts (the constructor runs on every
node, in the process that becomes a rank or launches them on that machine, so the path is
checked where the ranks read it). What needs the model waits for the load after sharding: the
key prefix, missing and unexpected keys (``strict``), and shapes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.nn import Module

from lightning_vescale.checkpoint import checkpoint_keys, load_safetensors
from lightning_vescale.checkpoint._hf_files import open_checkpoint

__all__ = ["find_prefix", "load_pretrained", "validate_pretrained_weights"]


def validate_pretrained_weights(value: Any) -> Optional[Path]:
    """The ``pretrained_weights`` argument: ``None`` or the path of a checkpoint that opens
    (see the design note: everything but the match with the model is checked here)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise TypeError(
            f"pretrained_weights must be a path to a Hugging Face safetensors checkpoint (a "
            f".safetensors file or a save_pretrained directory) or None, got {value!r}.")
    path = Path(value)
    try:
        open_checkpoint(path).close()
    except (OSError, RuntimeError) as err:  # FileNotFoundError, CheckpointLoadError, EACCES
        raise ValueError(
            f"pretrained_weights={str(path)!r} cannot be loaded: {err} (checked when the "
            "strategy is built, before any process starts; pass the path of a .safetensors "
            "file or of a directory save_pretrained or save_safetensors wrote).") from err
    return path


def find_prefix(module_keys: list[str], ckpt_keys: list[str]) -> tuple[str, int]:
    """The prefix ``p`` for which the most checkpoint keys ``k`` have ``p + k`` among the module's
    keys (shortest on a tie), and how many match."""
    module_set = set(module_keys)
    counts: dict[str, int] = {}
    for k in ckpt_keys:
        for mk in module_keys:
            if mk.endswith(k):
                p = mk[: len(mk) - len(k)]
                if p == "" or p.endswith("."):
                    counts[p] = counts.get(p, 0) + (p + k in module_set)
    if not counts:
        return "", 0
    best = max(counts.items(), key=lambda item: (item[1], -len(item[0])))
    return best


def load_pretrained(module: Module, path: Union[str, os.PathLike], *, strict: bool) -> None:
    """Load ``path`` into the sharded ``module`` (see design note [pretrained-weights])."""
    keys = checkpoint_keys(path, module)  # as converted for a transformers model in it
    module_keys = list(module.state_dict())
    prefix, matched = find_prefix(module_keys, keys)
    if matched == 0:
        raise ValueError(
            f"pretrained_weights={str(path)!r}: none of its {len(keys)} tensors is a parameter "
            f"or buffer of {type(module).__name__}, under any prefix (checkpoint: {keys[:4]}..., "
            f"model: {module_keys[:4]}...). Is it the checkpoint of this model?")
    result = load_safetensors(module, path, strict=strict, key_map=lambda k: prefix + k)
    rank_zero_info(
        f"vescale_fsdp: loaded {matched} tensors of {str(path)!r} into "
        f"{type(module).__name__}{f' under {prefix[:-1]!r}' if prefix else ''}"
        + (f" (missing: {result.missing_keys}, unexpected: {result.unexpected_keys})"
           if result.missing_keys or result.unexpected_keys else "") + ".")
