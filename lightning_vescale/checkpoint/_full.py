"""The full format: one ``torch.save`` file from rank 0, loadable without this package.

Model tensors are full, under the module's FQNs; optimizer states are the plain torch format
(full tensors, integer keys in parameter order). :func:`consolidate` turns a sharded directory
into this format offline. See design note [checkpoint-formats] (``lightning_vescale/checkpoint``).
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import torch
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.nn import Module
from torch.optim import Optimizer

from lightning_vescale.checkpoint._files import (
    check_checkpoint_path,
    discard,
    raise_if_no_space,
    is_sharded_checkpoint,
    publish,
    rank0_agreed,
    temp_sibling,
)
from lightning_vescale.checkpoint._sharded import read_side_file
from lightning_vescale.checkpoint._trust import (
    CheckpointLoadError,
    CheckpointRefusedError,
    load,
    read_metadata,
    safe_torch_load,
)
from lightning_vescale.checkpoint._state_dicts import (
    load_full_model_state,
    load_full_optimizer_state,
    missing_optimizer_error,
)

__all__ = ["save_full", "read_full", "load_full", "consolidate"]


def save_full(path: Path, checkpoint: dict[str, Any]) -> None:
    """Collective: rank 0 writes ``checkpoint`` (already gathered) to one file, atomically."""
    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
    tmp = temp_sibling(path)

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # through a Python file: its write errors (ENOSPC) stay in the exception chain,
            # where torch's own file writer reports only "unexpected pos ..."
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
            publish(tmp, path)
        except BaseException as e:
            discard(tmp)  # rank 0 alone writes the full format
            raise_if_no_space(e, path, "writing the full checkpoint",
                              "any previous checkpoint at that path is untouched")
            raise

    rank0_agreed(write, f"write the checkpoint {path}")


def read_full(path: Path, *, weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Read a full checkpoint file memory-mapped on CPU (tensors are sliced when loaded).

    ``weights_only=None`` means ``True`` (safe: no arbitrary objects are unpickled); pass
    ``False`` for trusted files only.
    """
    weights_only = True if weights_only is None else weights_only
    try:
        return safe_torch_load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        raise CheckpointRefusedError(
            f"Refusing to load {path}: {err}. If you trust this checkpoint, load it with "
            "weights_only=False.") from err
    except (EOFError, RuntimeError) as err:
        raise CheckpointLoadError(f"The checkpoint file {path} is damaged or truncated "
                                  f"({type(err).__name__}: {err}).") from err


def load_full(checkpoint: dict[str, Any], module: Module, optimizers: Mapping[str, Optimizer],
              *, path: Path, model_key: str = "state_dict", strict: bool = True
              ) -> dict[str, Any]:
    """Load a full checkpoint (as :func:`read_full` returns it) into a sharded module and its
    optimizers, slicing every tensor to this rank's part.

    ``checkpoint[model_key]`` is the model's state dict; ``optimizers`` maps keys of
    ``checkpoint`` to optimizers. Under ``strict`` a missing optimizer key raises a ``KeyError``,
    otherwise that optimizer is left as it is. The loaded entries are removed from
    ``checkpoint``, which is returned (``path`` is only for error messages).
    """
    if model_key not in checkpoint:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint (no {model_key!r} key).")
    load_full_model_state(checkpoint.pop(model_key), module, strict=strict)
    for key, optimizer in optimizers.items():
        if key not in checkpoint:
            if strict:
                saved = [k for k, v in checkpoint.items()
                         if isinstance(v, dict) and "param_groups" in v]
                raise missing_optimizer_error(key, saved)
            continue
        load_full_optimizer_state(checkpoint.pop(key), module, optimizer)
    return checkpoint


def consolidate(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """Read a sharded checkpoint directory into one full, plain checkpoint dict (no process group).

    Every entry is kept under its own key, with full tensors, for Trainer and Fabric checkpoints
    alike, so the result can be ``torch.save``-d and loaded by a single-process or DDP run:

    * a Trainer checkpoint (tensor keys ``"state_dict"`` and ``"optimizer_<i>"``): the model's
      state dict under ``"state_dict"``, the optimizer states as Lightning's
      ``"optimizer_states"`` list;
    * anything else, e.g. ``fabric.save(path, {"model": ..., "optimizer": ..., "step": ...})``:
      each module's state dict under its own key, each optimizer's state under its own key.

    Optimizer states become the plain torch format (integer keys in parameter-group order); the
    non-tensor state (``meta.pt``) is kept as it is. An entry that cannot be converted (a key
    both among the tensors and in ``meta.pt``, an optimizer state that does not match its
    parameter groups) raises a ``ValueError`` naming the keys. Runs in one process. Loading is
    safe and verified as for training (``weights_only=False`` only for trusted files).
    """
    path = check_checkpoint_path(Path(path))
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is already a single-file (full) checkpoint.")
    md = read_metadata(path, weights_only=weights_only)
    flat: dict[str, Any] = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            flat[key] = None
    load(flat, path, weights_only=weights_only, no_dist=True)
    nested = unflatten_state_dict(flat, md.planner_data) if md.planner_data else flat
    checkpoint = dict(read_side_file(path, weights_only=weights_only))
    clash = sorted(set(nested) & set(checkpoint))
    if clash:
        raise ValueError(
            f"Cannot consolidate {str(path)!r}: the keys {clash} are both among its tensors and "
            "in its non-tensor state (meta.pt); the checkpoint is damaged or not one of ours.")
    if "state_dict" in nested and all(k == "state_dict" or _TRAINER_OPTIMIZER.fullmatch(k)
                                      for k in nested):  # the Trainer's layout
        checkpoint["state_dict"] = nested.pop("state_dict")
        opt_keys = sorted(nested, key=lambda k: int(k.split("_", 1)[1]))
        if opt_keys:
            checkpoint["optimizer_states"] = [_convert(path, k, nested[k]) for k in opt_keys]
        return checkpoint
    for key, value in nested.items():  # Fabric's (or any other) state keys
        checkpoint[key] = _convert(path, key, value) if _is_optimizer_state(value) else value
    return checkpoint


_TRAINER_OPTIMIZER = re.compile(r"optimizer_\d+")


def _is_optimizer_state(value: Any) -> bool:
    return isinstance(value, dict) and "param_groups" in value


def _convert(path: Path, key: str, osd: Any) -> dict[str, Any]:
    """:func:`_index_keyed`, or a ``ValueError`` naming the entry it cannot convert."""
    try:
        return _index_keyed(osd)
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"Cannot consolidate {str(path)!r}: the optimizer state under {key!r} does not match "
            f"its parameter groups ({type(err).__name__}: {err}); the checkpoint is damaged or "
            "not one of ours.") from err


def _index_keyed(osd: dict[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict (the sharded format's) in the plain torch format."""
    order = [fqn for g in osd["param_groups"] for fqn in g["params"]]
    index = {fqn: i for i, fqn in enumerate(order)}
    groups, start = [], 0
    for g in osd["param_groups"]:
        n = len(g["params"])
        groups.append({**g, "params": list(range(start, start + n))})
        start += n
    return {"state": {index[f]: s for f, s in osd.get("state", {}).items()},
            "param_groups": groups}
