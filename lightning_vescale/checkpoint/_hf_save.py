"""``save_safetensors``: a (sharded) module as Hugging Face safetensors shards plus the index.

Design note [hf-save]
---------------------
No rank gathers the model. A safetensors file's layout follows from names, dtypes and shapes
alone (design note [safetensors-io]), so every rank computes the same plan: which tensors go to
which shard file (in ``state_dict()`` order, a new file when the next tensor would pass
``max_shard_size``; one tensor larger than that gets a file of its own) and each tensor's byte
offset. Then:

1. rank 0 creates each file under a hidden temporary name (``.<name>.tmp-<token>``, the token
   recording rank 0's pid and host) with its header, at its final size; the file names and the
   ``save_id`` in every header come from the token (design note [hf-publish]);
2. every rank writes the bytes it owns with ``os.pwrite``: for a ``RaggedShard`` parameter its
   local flat range, converted to the output dtype, is one contiguous byte range of the tensor
   (on HSDP only the first replica writes); over tensor parallelism (design note [fsdp-tp])
   its range of its TP-local tensor, one run per row of the TP box for ``Shard(1)``
   (``tp_flat_runs``); a plain tensor, or a ``DTensor`` of another placement
   (gathered with ``full_tensor()``, one tensor at a time, a collective), is written by rank 0;
   a rank whose write fails writes nothing more but still joins the remaining gathers;
3. after every rank reports success (an ``all_gather_object`` of each rank's error, or
   ``None``: a rank that failed never leaves the others waiting, and they name its error), the
   ranks compute the CRC-32s of the files (each a share), and rank 0 publishes the save as one
   unit (design note [hf-publish]): the files under their names, ``model.safetensors.index.json``
   for several (the ``weight_map`` and ``total_size`` of ``save_pretrained``), shards of earlier
   saves removed, then ``.integrity.json`` (design note [checkpoint-trust], ``"format":
   "safetensors"``: the size and CRC-32 of every file). Every rank learns whether that worked.

A full disk (``ENOSPC``, or a quota) is reported as the other formats report it: "No space left
on <dir> (... MiB free now) while ..." and what is left (``_files.raise_if_no_space``).

Layout: for a ``transformers`` model, a tensor that the library converts on load (stacked MoE
experts) is written as ``save_pretrained`` writes it, cut into its file tensors: a rank writes
the runs of its range that fall in each of them (design note [hf-convert]).

Memory bound per rank: its largest local shard in the output dtype, plus, for a non-RaggedShard
``DTensor``, one full tensor. The directory must be visible to every rank (one machine, or a
shared file system); files of other names in it (the user's ``config.json``) are kept.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_vescale.checkpoint import _files
from lightning_vescale.checkpoint._hf_files import INDEX_NAME
from lightning_vescale.checkpoint._hf_publish import (
    SAVE_ID_KEY,
    PublishedWithoutManifest,
    publish_save,
    save_id_of,
    shard_names,
    temp_name,
)
from lightning_vescale.checkpoint._hf_convert import SavedAs, save_layout
from lightning_vescale.checkpoint._manifest import MANIFEST_VERSION, SAFETENSORS_FORMAT
from lightning_vescale.checkpoint._safetensors_format import build_header, dtype_code
from lightning_vescale.checkpoint._state_dicts import _is_ragged
from lightning_vescale.placement import RaggedShard, ragged_mesh_dim
from lightning_vescale.placement._ragged_tp import is_tp_layout, tp_flat_runs

__all__ = ["LAYOUTS", "parse_size", "save_safetensors", "write_safetensors"]

#: ``save_safetensors(layout=...)``: transformers' ``save_pretrained`` layout, or the module's.
LAYOUTS = ("save_pretrained", "state_dict")

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int, or ``"5GB"``/``"500MB"``/``"2GiB"`` (HF's units)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper()) \
        if isinstance(size, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive number of bytes or a string such as "
                         f"'5GB', '500MB' or '2GiB', got {size!r}.")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True, kw_only=True)
class _Item:
    name: str
    tensor: Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str = ""
    offset: int = 0
    # A file tensor that is a part of ``tensor`` (save_pretrained's layout, design note
    # [hf-convert]): the leaf ``piece`` of ``saved``, whose runs say which ranges.
    saved: Optional[SavedAs] = None
    piece: str = ""


def _items(module_or_sd: Union[nn.Module, dict[str, Tensor]], dtype: Optional[torch.dtype],
           key_map: Optional[Callable[[str], Optional[str]]],
           layout: str = "save_pretrained") -> list[_Item]:
    """The tensors to write, tied duplicates dropped (first name kept), each cut into the file
    tensors of ``save_pretrained``'s layout where ``transformers`` converts it (``layout``),
    renamed by ``key_map``."""
    if isinstance(module_or_sd, nn.Module):
        sd = module_or_sd.state_dict()
        first: dict[int, str] = {}
        for n, t in itertools.chain(module_or_sd.named_parameters(remove_duplicate=False),
                                    module_or_sd.named_buffers(remove_duplicate=False)):
            first.setdefault(id(t), n)
        keep, aliases = set(first.values()), _all_names(module_or_sd)
        sd = {k: v for k, v in sd.items() if k in keep or k not in aliases}
    else:
        sd = module_or_sd
    saved = {}
    if isinstance(module_or_sd, nn.Module) and layout == "save_pretrained":
        saved = save_layout(module_or_sd, {k: (tuple(t.shape), t.dtype) for k, t in sd.items()
                                           if isinstance(t, Tensor)})
    out = []
    for k, t in sd.items():
        if not isinstance(t, Tensor):
            continue
        out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        dtype_code(out_dtype)  # a dtype safetensors cannot store: fail before writing anything
        parts = saved[k].pieces if k in saved else ((k, "", tuple(t.shape)),)
        for file_key, leaf, shape in parts:
            name = key_map(file_key) if key_map is not None else file_key
            if name is not None:
                out.append(_Item(name=name, tensor=t, dtype=out_dtype, shape=shape,
                                 saved=saved.get(k), piece=leaf))
    return out


def _all_names(module: nn.Module) -> set[str]:
    return {n for n, _ in itertools.chain(module.named_parameters(remove_duplicate=False),
                                          module.named_buffers(remove_duplicate=False))}


def _plan(items: list[_Item], max_bytes: int, save_id: str
          ) -> tuple[dict[str, bytes], list[_Item]]:
    """Shard files (name -> header, ``save_id`` in its ``__metadata__``) and the items with
    their file and absolute offset."""
    groups: list[list[_Item]] = [[]]
    size = 0
    for it in items:
        nbytes = math.prod(it.shape) * it.dtype.itemsize
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(it)
        size += nbytes
    headers, placed = {}, []
    for name, group in zip(shard_names(save_id, len(groups)), groups):
        header, offsets = build_header([(it.name, it.dtype, it.shape) for it in group],
                                       {"format": "pt", SAVE_ID_KEY: save_id})
        headers[name] = header
        placed += [dataclasses.replace(it, file=name, offset=offsets[it.name]) for it in group]
    return headers, placed


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _pwrite(fd: int, t: Tensor, offset: int) -> None:
    data = memoryview(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _write_owned(item: _Item, fds: dict[str, int], rank: int, failed: bool = False,
                 gathered: Optional[dict[int, Tensor]] = None) -> None:
    """Write the bytes of ``item`` this rank owns (see the design note, step 2). ``failed``
    (this rank has failed already): write nothing, but still join the gather of a DTensor of
    another placement, which its peers are running. ``gathered`` keeps the last such gather
    for the next pieces of the same tensor (one gather per tensor, one full tensor held)."""
    t, fd = item.tensor, fds.get(item.file)
    if isinstance(t, DTensor) and _is_ragged(t):
        if failed:
            return
        mesh, placements = t.device_mesh, tuple(t.placements)
        if is_tp_layout(placements, placements):  # [fsdp-tp]: the runs of its TP-local box
            _write_tp(fd, item, t)
            return
        dim = ragged_mesh_dim(placements, "save_safetensors")
        if any(mesh.get_local_rank(d) != 0 for d in range(mesh.ndim) if d != dim):
            return  # HSDP: another replica holds the same range
        if _copy_outside_mesh(mesh):
            return  # e.g. a parameter without TP beside TP ones: tp rank 0 writes it
        start, end = placements[dim].local_range(tuple(t.shape), mesh.get_local_rank(dim))
        _write_range(fd, item, t.to_local().view(-1), start, end)
        return
    full = t
    if isinstance(t, DTensor):
        gathered = {} if gathered is None else gathered
        if id(t) not in gathered:
            gathered.clear()
            gathered[id(t)] = t.full_tensor()  # a collective
        full = gathered[id(t)]
    if rank == 0 and not failed:
        _write_range(fd, item, full.reshape(-1), 0, full.numel())


def _copy_outside_mesh(mesh: Any) -> bool:
    """Whether this rank's coordinate on a dim of ``mesh``'s root mesh that ``mesh`` leaves out
    is not 0: a data-parallel sub-mesh of a ``(dp, tp)`` mesh (design note [fsdp-tp]) exists
    once per tp rank, all holding the same shards, and the first writes them."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else None
    if root is None or root is mesh or not root.mesh_dim_names or not mesh.mesh_dim_names:
        return False
    if not set(mesh.mesh_dim_names) <= set(root.mesh_dim_names):
        return False  # a flattened dim: which root dims it covers is not named; all write
    return any(root.get_local_rank(d) != 0 for d, n in enumerate(root.mesh_dim_names)
               if n not in mesh.mesh_dim_names)


def _write_tp(fd: int, item: _Item, t: DTensor) -> None:
    """Write a ``fully_shard`` parameter over tensor parallelism (design note [fsdp-tp]): its
    local range of its TP-local tensor, run by run of the global tensor; a rank that replicates
    another's bytes (a ``Replicate()`` dim other than the data-parallel one, at coordinate > 0)
    writes nothing."""
    mesh, placements = t.device_mesh, tuple(t.placements)
    dim = next(d for d, pl in enumerate(placements) if isinstance(pl, RaggedShard))
    if any(pl.is_replicate() and mesh.get_local_rank(d) != 0 for d, pl in enumerate(placements)):
        return
    local = t.to_local().view(-1)
    for pos, start, end in tp_flat_runs(tuple(t.shape), mesh, placements, dim):
        _write_range(fd, item, local[pos:pos + end - start], start, end)


def _write_range(fd: int, item: _Item, data: Tensor, start: int, end: int) -> None:
    """Write ``data``, elements ``[start, end)`` of ``item.tensor`` flattened, converted to the
    output dtype, where they go in ``item``: at their offset, or, for a piece of a tensor saved
    in ``save_pretrained``'s layout, the runs that fall in that piece (design note
    [hf-convert]); only what is written is converted."""
    size = item.dtype.itemsize
    if item.saved is None:
        _pwrite(fd, data.to(item.dtype), item.offset + start * size)
        return
    pos = 0
    for leaf, s, e in item.saved.entry.node.runs(start, end):
        if leaf.entry.name == item.piece:
            _pwrite(fd, data[pos:pos + e - s].to(item.dtype), item.offset + s * size)
        pos += e - s


def _agree(failed: bool) -> bool:
    """Whether any rank failed (every rank calls it: it replaces a barrier)."""
    return any(_gather(failed))


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank (object collectives pick the backend's device themselves)."""
    _, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _crc_file(path: Path) -> dict[str, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": crc & 0xFFFFFFFF}


def _create_files(root: Path, headers: dict[str, bytes], sizes: dict[str, int],
                  token: str) -> None:
    """Rank 0: each temporary file with its header, at its final size (step 1)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, header in headers.items():
        with open(root / temp_name(name, token), "wb") as f:
            f.write(header)
            f.truncate(sizes[name])


def _index_and_manifest(headers: dict[str, bytes], items: list[_Item], save_id: str,
                        crcs: dict[str, dict[str, int]]
                        ) -> tuple[Optional[bytes], Callable[[], bytes]]:
    """The index (``None`` for a save of one file, as ``save_pretrained`` writes it) and the
    manifest's bytes of this save, both naming ``save_id``."""
    files = dict(crcs)
    index_bytes = None
    if len(headers) > 1:
        total = sum(math.prod(it.shape) * it.dtype.itemsize for it in items)
        index = {"metadata": {"total_size": total, SAVE_ID_KEY: save_id},
                 "weight_map": {it.name: it.file for it in items}}
        index_bytes = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
        files[INDEX_NAME] = {"size": len(index_bytes),
                             "crc32": zlib.crc32(index_bytes) & 0xFFFFFFFF}
    manifest = {"version": MANIFEST_VERSION, "algorithm": "crc32", "format": SAFETENSORS_FORMAT,
                "files": files, "items": {}, SAVE_ID_KEY: save_id}
    return index_bytes, lambda: json.dumps(manifest, sort_keys=True).encode()


def write_safetensors(source: Union[nn.Module, dict[str, Tensor]],
                      directory: Union[str, os.PathLike], *,
                      max_shard_size: Union[int, str] = "5GB",
                      dtype: Optional[torch.dtype] = None,
                      key_map: Optional[Callable[[str], Optional[str]]] = None,
                      layout: str = "save_pretrained") -> list[Path]:
    """:func:`save_safetensors` for a module or a plain state dict (design note [hf-save])."""
    if layout not in LAYOUTS:
        raise ValueError(f"save_safetensors(layout={layout!r}): expected one of {LAYOUTS} "
                         "('save_pretrained': the layout transformers' save_pretrained writes; "
                         "'state_dict': the module's own names and shapes).")
    max_bytes = parse_size(max_shard_size)
    rank, world = _rank_world()
    root = Path(directory)
    token = _broadcast(_files._new_token())
    save_id = save_id_of(token)
    headers, items = _plan(_items(source, dtype, key_map, layout), max_bytes, save_id)
    names = list(headers)
    sizes = {name: len(h) for name, h in headers.items()}
    for it in items:
        sizes[it.file] += math.prod(it.shape) * it.dtype.itemsize
    error: Optional[BaseException] = None
    try:
        if rank == 0:
            _create_files(root, headers, sizes, token)
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        error = err
    _raise_if_any_failed(error, root, names, token)
    fds: dict[str, int] = {}
    try:
        for name in names:
            fds[name] = os.open(root / temp_name(name, token), os.O_WRONLY)
    except Exception as err:  # noqa: BLE001
        error = err
    try:
        gathered: dict[int, Tensor] = {}
        for it in items:  # a rank that failed keeps joining the gathers: none waits on it
            try:
                _write_owned(it, fds, rank, failed=error is not None, gathered=gathered)
            except Exception as err:  # noqa: BLE001
                error = error or err
    finally:
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError as err:  # NFS reports a failed write at close
                error = error or err
    _raise_if_any_failed(error, root, names, token)
    crcs: dict[str, dict[str, int]] = {}
    try:
        crcs = {n: _crc_file(root / temp_name(n, token)) for i, n in enumerate(sorted(names))
                if i % world == rank}
    except Exception as err:  # noqa: BLE001
        error = err
    _raise_if_any_failed(error, root, names, token)
    crcs = {k: v for part in _gather(crcs) for k, v in part.items()}
    index_bytes, manifest = _index_and_manifest(headers, items, save_id, crcs)
    try:
        if rank == 0:
            publish_save(root, names, token, index_bytes, manifest)
    except Exception as err:  # noqa: BLE001
        error = err
    _raise_if_any_failed(error, root, names, token, published=True)
    return [root / n for n in names] + ([root / INDEX_NAME] if index_bytes is not None else [])


def _raise_if_any_failed(error: Optional[BaseException], root: Path, names: list[str],
                         token: str, *, published: bool = False) -> None:
    """Every rank learns which failed (and why); then all raise, rank 0 having removed this
    save's temporaries. A full disk is named first (``_files.raise_if_no_space``)."""
    if isinstance(error, PublishedWithoutManifest):
        aftermath = ("the weights are published, but without their .integrity.json (they load "
                     "unverified)")
    else:
        aftermath = ("nothing was published: the previous save in that directory (if any) is "
                     "untouched and this save's temporary files were removed")

    def named(err: BaseException) -> BaseException:
        try:
            _files.raise_if_no_space(err, root / names[0], "saving Hugging Face weights to",
                                     aftermath)
        except OSError as no_space:
            return no_space
        return err

    shown = None if error is None else named(error)
    summary = None if shown is None else f"{type(shown).__name__}: {shown}"[:500]
    failed = {i: s for i, s in enumerate(_gather(summary)) if s is not None}
    if not failed:
        return
    if _rank_world()[0] == 0 and not published:
        for name in names:
            _files.discard(root / temp_name(name, token))
    if error is not None:
        raise named(error)  # after the clean-up: the free space it names is what is left
    raise RuntimeError(f"save_safetensors({str(root)!r}) failed on rank(s) {sorted(failed)}: "
                       + "; ".join(f"rank {i}: {s}" for i, s in sorted(failed.items()))
                       + ("" if published else f". {aftermath[0].upper()}{aftermath[1:]}."))


def save_safetensors(module: nn.Module, directory: Union[str, os.PathLike], *,
                     max_shard_size: Union[int, str] = "5GB",
                     dtype: Optional[torch.dtype] = None,
                     key_map: Optional[Callable[[str], Optional[str]]] = None,
                     layout: str = "save_pretrained") -> list[Path]:
    """Write ``module``'s weights as Hugging Face safetensors shards plus the index.

    Call on every rank (a collective). ``transformers``' ``from_pretrained(directory)`` (with the
    model's ``config.json`` in it) and ``safetensors.torch.load_file`` read the result. No rank
    gathers the model: each writes the bytes of its own shards (design note [hf-save]); peak
    extra memory per rank is its largest local shard in the output dtype (plus one full tensor
    for a parameter that is a ``DTensor`` of another placement than ``RaggedShard``).

    Args:
        module: a ``fully_shard`` module (or a plain one). Tied parameters are written once,
            under their first name (as ``save_pretrained`` does).
        directory: created if needed; other files in it are kept (``config.json``), shards of
            earlier saves are removed once this one is published. The save is published as one
            unit (design note [hf-publish]): a reader sees the whole previous save or the whole
            new one, never a mix. Must be visible to every rank.
        max_shard_size: bytes per file (an int, or ``"5GB"``, ``"500MB"``, ``"2GiB"``); a tensor
            larger than it gets a file of its own.
        dtype: convert floating-point tensors to it (e.g. ``torch.bfloat16``); default: as they
            are.
        key_map: rename (or, returning ``None``, drop) keys: e.g. ``lambda k:
            k.removeprefix("model.")`` for a LightningModule holding the HF model as ``model``.
            Applied to the file's keys (after ``layout``).
        layout: ``"save_pretrained"`` (default): for a ``transformers`` model (or a module
            holding one) the tensors the library converts on load are written as its
            ``save_pretrained`` writes them (stacked experts one tensor per expert, Mixtral's
            ``block_sparse_moe`` names), each rank still writing only its own byte runs
            (design note [hf-convert]); ``"state_dict"``: the module's own names and shapes
            (``from_pretrained`` reads both).

    Returns:
        The files written: ``model.safetensors``, or the shards
        ``model-<save_id>-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``
        (``.integrity.json`` holds their sizes and CRC-32s).

    Raises:
        OSError: ``ENOSPC`` (or a quota), "No space left on <dir>" first, with the free space
            and what was left behind.
    """
    return write_safetensors(module, directory, max_shard_size=max_shard_size, dtype=dtype,
                             key_map=key_map, layout=layout)
