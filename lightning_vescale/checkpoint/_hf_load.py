"""``load_safetensors``: a Hugging Face checkpoint into a ``fully_shard`` (or plain) module.

Design note [hf-load]
---------------------
Each rank reads only the bytes of what it owns. A ``RaggedShard`` parameter's local shard is the
contiguous flat range ``[start, end)`` of the row-major tensor (design note [ragged-shard]),
which in a safetensors file is one contiguous byte range (design note [safetensors-io]): the rank
reads exactly that range and copies it into its shard, converting dtype (and device) on the way.
No full tensor is built for a sharded parameter; a rank's peak extra memory is its largest local
shard in the file's dtype (none when the dtypes match and the shard is a CPU tensor: the bytes
are read straight into it). Over tensor parallelism (design note [fsdp-tp]) a rank's shard is
its range of its TP-local tensor: the runs of that box (one per row for ``Shard(1)``), read run
by run. Plain tensors (buffers, parameters of an unsharded module) are read
whole; a ``DTensor`` of another placement whose local block is one contiguous range (torch's
FSDP2 ``Shard(0)``) reads that range only, any other is read whole and cut to its local part
(one full tensor at a time).

No collective runs: every rank validates every header the same way, so a bad checkpoint raises
the same error on every rank, and no rank waits for another.

Layout: when ``module`` is (or holds) a ``transformers`` model for which the library declares a
conversion (the stacked experts of Mixtral / Qwen3-MoE, stored one tensor per expert), the
checkpoint's tensors are first seen as ``from_pretrained`` converts them, each converted tensor
read range by range from its sources (design note [hf-convert]): still only a rank's own bytes.

Keys: the module's ``state_dict()`` names. ``key_map`` (a dict, or a callable returning the new
name or ``None`` to skip) renames checkpoint keys first. Tied parameters (one tensor under two
names, e.g. ``lm_head.weight`` and ``model.embed_tokens.weight``) need only one of their names in
the checkpoint, as ``save_pretrained`` writes them. ``strict`` raises on missing and unexpected
keys, naming them; a shape mismatch always raises, naming the key and both shapes.

Meta device: a module whose parameters (or ``fully_shard`` buffers) are on meta is first
given storage on ``device`` without initialising parameters (``_meta_buffers.allocate``: what
``fsdp.materialize(..., init_params=False)`` does, without importing layer 3), which also
recomputes its non-persistent buffers (design note [meta-buffers]); then the weights are loaded.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from collections.abc import Callable, Mapping
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_vescale._meta_buffers import allocate
from lightning_vescale.checkpoint._hf_convert import Entry, convert_entries, read_entry
from lightning_vescale.checkpoint._hf_files import OpenCheckpoint, open_checkpoint
from lightning_vescale.checkpoint._state_dicts import _copy_full_into, _is_ragged
from lightning_vescale.placement import RaggedShard, ragged_shard_and_rank
from lightning_vescale.placement._ragged_tp import is_tp_layout, tp_flat_runs

__all__ = ["IncompatibleKeys", "KeyMap", "load_safetensors", "checkpoint_keys"]

KeyMap = Union[Mapping[str, str], Callable[[str], Optional[str]], None]


class IncompatibleKeys(NamedTuple):
    """What :func:`load_safetensors` did not match (like ``nn.Module.load_state_dict``'s)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def checkpoint_keys(path: Union[str, os.PathLike],
                    module: Optional[nn.Module] = None) -> list[str]:
    """The tensor names of a Hugging Face safetensors checkpoint (headers only are read); with
    ``module``, as :func:`load_safetensors` sees them for it (after ``transformers``' conversion,
    design note [hf-convert])."""
    with open_checkpoint(path) as ckpt:
        if module is None:
            return sorted(ckpt.entries)
        return sorted(convert_entries(module, ckpt.entries))


def _apply_key_map(keys: list[str], key_map: KeyMap) -> dict[str, str]:
    """checkpoint key -> module key (keys mapped to ``None`` dropped)."""
    out = {}
    for k in keys:
        if key_map is None:
            new: Optional[str] = k
        elif callable(key_map):
            new = key_map(k)
        else:
            new = key_map.get(k, k)
        if new is not None:
            out[k] = new
    return out


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Every parameter/buffer name -> all names of the same tensor (tied weights)."""
    by_id: dict[int, list[str]] = {}
    named = itertools.chain(module.named_parameters(remove_duplicate=False),
                            module.named_buffers(remove_duplicate=False))
    for name, t in named:
        by_id.setdefault(id(t), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def _needs_materialize(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _default_device(module: nn.Module) -> torch.device:
    """Where a meta module is materialised: its mesh's device type (this process's device of
    it), else the device of any real tensor, else CPU."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        if isinstance(t, DTensor):
            kind = t.device_mesh.device_type
            if kind == "cpu":
                return torch.device("cpu")
            return torch.device(kind, torch.get_device_module(kind).current_device())
        if not t.is_meta:
            return t.device
    return torch.device("cpu")


def _materialize(module: nn.Module, device: Optional[torch.device]) -> None:
    allocate(module, device or _default_device(module))


def _load_one(ckpt: OpenCheckpoint, entry: Entry, target: Tensor) -> None:
    """Read ``entry``'s part that ``target`` holds and write it into ``target``."""
    read = functools.partial(read_entry, ckpt.stream, entry)  # (start, end, *, out)
    if isinstance(target, DTensor) and _is_ragged(target) and \
            is_tp_layout(target.placements, target.placements):  # [fsdp-tp]
        placements = tuple(target.placements)
        dim = next(d for d, pl in enumerate(placements) if isinstance(pl, RaggedShard))
        local = target.to_local().view(-1)
        for pos, start, end in tp_flat_runs(tuple(target.shape), target.device_mesh,
                                            placements, dim):
            local[pos:pos + end - start].copy_(read(start, end))
        return
    if isinstance(target, DTensor) and _is_ragged(target):
        ragged, r = ragged_shard_and_rank(target.device_mesh, target.placements,
                                          "load_safetensors")
        start, end = ragged.local_range(tuple(target.shape), r)
        local = target.to_local().view(-1)
        if local.device.type == "cpu" and local.dtype == entry.dtype and local.is_contiguous():
            read(start, end, out=local)  # straight into the shard
        else:
            local.copy_(read(start, end))
        return
    if isinstance(target, DTensor):
        span = _contiguous_block(target)
        if span is not None:  # e.g. torch's FSDP2 Shard(0): the local rows are one range
            local = target.to_local()
            local.copy_(read(*span).view(local.shape))
            return
        _copy_full_into(target, read().view(entry.shape), entry.name)
    else:
        target.copy_(read().view(entry.shape))


def _contiguous_block(target: DTensor) -> Optional[tuple[int, int]]:
    """The flat range of ``target``'s local block when it is contiguous in the row-major full
    tensor (``Shard(0)``, ``Replicate``: leading dims of size 1, then one partial dim, then full
    dims), else ``None``."""
    shape = tuple(target.shape)
    local, offset = compute_local_shape_and_global_offset(shape, target.device_mesh,
                                                          target.placements)
    if tuple(target.to_local().shape) != tuple(local):
        return None
    partial = [i for i, (n, g) in enumerate(zip(local, shape)) if n != g]
    if partial and any(local[i] != 1 for i in range(partial[-1])):
        return None  # rows of several slabs: not one range
    start, stride = 0, 1
    for i in range(len(shape) - 1, -1, -1):
        start += offset[i] * stride
        stride *= shape[i]
    return start, start + math.prod(local)


def _shape_errors(pairs: list[tuple[str, Entry, Tensor]]) -> list[str]:
    return [f"{key!r}: the checkpoint has shape {entry.shape} ({entry.file.name}), the module "
            f"{tuple(target.shape)}" for key, entry, target in pairs
            if tuple(entry.shape) != tuple(target.shape)]


@torch.no_grad()
def load_safetensors(module: nn.Module, path: Union[str, os.PathLike], *, strict: bool = True,
                     key_map: KeyMap = None,
                     device: Optional[Union[torch.device, str]] = None,
                     verify: bool = False) -> IncompatibleKeys:
    """Load a Hugging Face safetensors checkpoint into ``module`` (sharded or plain).

    Args:
        module: a module sharded with ``fully_shard`` (each rank reads only its own ranges), or a
            plain module; its parameters may be on the meta device (then it is materialised on
            ``device`` first, see design note [hf-load]).
        path: a ``.safetensors`` file, or a directory with ``model.safetensors`` or
            ``model.safetensors.index.json`` and its shards (what ``save_pretrained`` writes).
        strict: raise if a module key has no tensor in the checkpoint or the checkpoint has a
            tensor the module does not (both listed by name).
        key_map: rename checkpoint keys to module keys: a dict (unlisted keys unchanged) or a
            callable returning the new name or ``None`` to skip the tensor. For a
            ``transformers`` model whose checkpoints ``from_pretrained`` converts (stacked
            experts), it renames the converted keys (design note [hf-convert]).
        device: where a meta module is materialised (default: its mesh's device type).
        verify: check each file's CRC-32 against the directory's ``.integrity.json`` (what
            ``save_safetensors`` writes) first: every rank then reads every file once. Without
            it, each file's size is still checked against the manifest when there is one.

    Returns:
        The missing and unexpected keys (empty under ``strict``).

    Raises:
        FileNotFoundError: no checkpoint (or a shard named by the index) at ``path``.
        CheckpointLoadError: a damaged, truncated or lying file (naming the file and key).
        RuntimeError: ``strict`` and keys do not match (naming them).
        ValueError: a tensor's shape differs from the module's (naming the key and shapes).
    """
    if _needs_materialize(module):
        _materialize(module, torch.device(device) if device is not None else None)
    with open_checkpoint(path, verify=verify) as ckpt:
        entries = convert_entries(module, ckpt.entries)
        renamed = _apply_key_map(sorted(entries), key_map)
        targets = module.state_dict()
        aliases = _aliases(module)
        by_module_key = {new: old for old, new in renamed.items()}
        unexpected = sorted(old for old, new in renamed.items() if new not in targets)
        missing = sorted(k for k in targets if not any(a in by_module_key
                                                       for a in aliases.get(k, [k])))
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"load_safetensors({str(path)!r}, strict=True): the checkpoint and "
                f"{type(module).__name__} do not have the same keys.\n  missing in the "
                f"checkpoint: {missing}\n  unexpected in the checkpoint: {unexpected}\nPass "
                "key_map= to rename checkpoint keys, or strict=False to load the common ones.")
        pairs = [(new, entries[old], targets[new]) for old, new in renamed.items()
                 if new in targets and isinstance(targets[new], Tensor)]
        errors = _shape_errors(pairs)
        if errors:
            raise ValueError(f"load_safetensors({str(path)!r}): shape mismatch for "
                             + "; ".join(errors) + ". Was the checkpoint written for another "
                             "model configuration?")
        for _, entry, target in pairs:
            _load_one(ckpt, entry, target)
    return IncompatibleKeys(missing, unexpected)
