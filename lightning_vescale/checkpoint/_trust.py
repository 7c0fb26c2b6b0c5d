"""Safe, verified reading of torch distributed checkpoints (DCP directories).

Design note [checkpoint-trust]
------------------------------
torch's ``FileSystemReader`` unpickles ``.metadata`` with plain :mod:`pickle`, and its
``DefaultLoadPlanner`` reads every non-tensor entry with ``torch.load(weights_only=False)``: a
checkpoint directory someone hands you runs arbitrary code when it is loaded, whatever
``weights_only`` the caller asked for. Nothing checks the stored bytes either, so a flipped bit in
a shard loads silently, and a damaged file surfaces as a bare ``EOFError`` inside a
``CheckpointException`` that names neither the file nor the rank.

This module closes those holes for every DCP directory the package reads:

- :class:`SafeFileSystemReader` reads ``.metadata`` through :class:`_MetadataUnpickler`, which
  resolves only the DCP metadata classes, ``torch.Size``, dtypes and layouts, paths and
  builtin containers (:data:`_METADATA_GLOBALS`); any other global is refused with an error that
  names the file and the global. Tensor entries were always read with ``weights_only=True``; byte
  entries (optimizer hyper-parameters, Python scalars) now are too, by the planners that
  :func:`safe_planner` builds. ``weights_only=False`` opts out, for trusted files only.
- Integrity: :func:`write_integrity_manifest` runs after a save and records the CRC-32 and size of
  every stored item and of the metadata file in ``.integrity.json`` (plain JSON: reading it runs
  nothing). The reader checks ``.metadata`` before unpickling it and every item's bytes as it reads
  them (they are in memory anyway, so the check costs one CRC pass, ~7 GB/s here). CRC-32 detects
  corruption, not tampering: anyone who can rewrite the data can rewrite the manifest. Protection
  against malicious files is the restricted loading above, not the checksum.
- Harmless standard types load under ``weights_only=True`` too (:data:`HARMLESS_GLOBALS`:
  ``pathlib`` paths and ``datetime`` values, which ``save_hyperparameters()`` stores when a
  LightningModule takes them as arguments): reconstructing them runs no user code.
- Every failure is a :class:`CheckpointLoadError` naming the file (and, through
  :func:`raise_load_error`, the rank), for missing, truncated and corrupted files alike.

A checkpoint without a manifest (written by an older version, or by another tool) loads, with a
warning that its bytes cannot be verified. Every file is read confined to the checkpoint directory
(design note [checkpoint-confinement], ``_confine.py``), and the manifest is validated before use
(``_manifest.py``).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import pathlib
import pickle
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.futures import Future

from lightning_vescale.checkpoint._confine import open_inside
from lightning_vescale.checkpoint._errors import CheckpointLoadError, CheckpointRefusedError
from lightning_vescale.checkpoint._manifest import (
    INTEGRITY_FILENAME,
    MANIFEST_VERSION as _MANIFEST_VERSION,
    load_manifest,
)

__all__ = [
    "CheckpointLoadError",
    "CheckpointRefusedError",
    "INTEGRITY_FILENAME",
    "load",
    "SafeFileSystemReader",
    "load_manifest",
    "read_metadata",
    "read_verified_file",
    "raise_load_error",
    "safe_planner",
    "checksum_items",
    "write_integrity_manifest",
    "write_manifest",
]

_METADATA_FILENAME = ".metadata"


# -- restricted metadata unpickling ---------------------------------------------------------------
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP ``.metadata`` file needs (see [checkpoint-trust])."""

    def __init__(self, file: io.BytesIO, *, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointRefusedError(
            f"Refusing to load {self._path}: it asks to unpickle the global {module}.{name}, "
            "which a distributed-checkpoint metadata file never needs (it may run code). If you "
            "trust this checkpoint, load it with weights_only=False.")


def _crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def _item_key(index: MetadataIndex) -> str:
    offset = "" if index.offset is None else ",".join(str(int(o)) for o in index.offset)
    return f"{index.fqn}|{offset}|{'' if index.index is None else index.index}"


def read_verified_file(root: Path, name: str, *, what: str = "",
                       manifest: Mapping[str, Any] | None = None) -> bytes:
    """The bytes of ``root/name``, checked against the manifest's size and CRC-32 if it has one.

    ``manifest``: pass :func:`load_manifest`'s result (``None`` reads it here; a checkpoint
    without a manifest is read unchecked). A manifest without an entry for ``name`` is an error
    (it does not belong to this checkpoint). The file is read confined to ``root`` (design note
    [checkpoint-confinement]), and a file whose size differs from the manifest's is not read.
    """
    root = Path(root)
    if manifest is None:
        manifest = load_manifest(root)
    path = root / name
    expected = manifest["files"].get(name) if manifest else None
    if manifest and expected is None:
        raise CheckpointLoadError(
            f"{root / INTEGRITY_FILENAME} has no checksum for {name!r}: the manifest does not "
            "belong to this checkpoint (restore it, or remove it to load unverified).")
    try:
        stream, size = open_inside(root, name, what or name)
    except FileNotFoundError:
        raise CheckpointLoadError(f"The checkpoint's {what or name} file {path} is missing.") \
            from None
    with stream:
        if expected is not None and size != expected["size"]:
            raise CheckpointLoadError(
                f"{path} fails its integrity check ({size} bytes, expected {expected['size']} "
                f"bytes with CRC-32 {expected['crc32']:#010x}): the file is damaged; restore it "
                "or use another checkpoint.")
        try:
            data = stream.read(size)
        except OSError as err:
            raise CheckpointLoadError(
                f"Could not read the checkpoint's {what or name} file {path}: {err}") from err
    if expected is not None and _crc32(data) != expected["crc32"]:
        raise CheckpointLoadError(
            f"{path} fails its integrity check ({len(data)} bytes with CRC-32 "
            f"{_crc32(data):#010x}, expected {expected['size']} bytes with CRC-32 "
            f"{expected['crc32']:#010x}): the file is damaged; restore it or use another "
            "checkpoint.")
    return data


def read_metadata(root: Path, *, weights_only: bool = True,
                  manifest: Mapping[str, Any] | None = None) -> Metadata:
    """Read, verify and (restrictedly, unless ``weights_only=False``) unpickle ``.metadata``."""
    path = Path(root) / _METADATA_FILENAME
    data = read_verified_file(root, _METADATA_FILENAME, what="metadata", manifest=manifest)
    try:
        if weights_only:
            metadata = _MetadataUnpickler(io.BytesIO(data), path=path).load()
        else:
            metadata = pickle.loads(data)  # noqa: S301  (the user opted out: trusted file)
    except CheckpointLoadError:
        raise
    except Exception as err:  # EOFError, UnpicklingError, UnicodeDecodeError, ...
        raise CheckpointLoadError(
            f"{path} is damaged or not a distributed-checkpoint metadata file "
            f"({type(err).__name__}: {err}).") from err
    if not isinstance(metadata, Metadata):
        raise CheckpointLoadError(
            f"{path} holds a {type(metadata).__name__}, not distributed-checkpoint Metadata.")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that loads safely, verifies checksums and names files in errors.

    Args:
        path: the checkpoint directory.
        weights_only: ``True`` (default) restricts ``.metadata`` to the DCP metadata classes and
            reads byte entries with ``torch.load(weights_only=True)`` (together with
            :func:`safe_planner`). ``False`` trusts the files (plain pickle), as torch does.
        verify: check the sizes and CRC-32s of ``.integrity.json`` while reading (default on).
    """

    def __init__(self, path: str | os.PathLike, *, weights_only: bool = True,
                 verify: bool = True) -> None:
        super().__init__(path)
        self.weights_only = weights_only
        self._root = Path(path)
        self._manifest = load_manifest(self._root) if verify else None
        if verify and self._manifest is None:
            warnings.warn(
                f"The checkpoint {self._root} has no {INTEGRITY_FILENAME} (written by an older "
                "version or another tool): its bytes cannot be verified.", stacklevel=3)

    # DCP falls back to per-rank metadata files when read_metadata takes **kwargs; ours never
    # writes those, and the fallback would hide the real error behind "metadata is None".
    def read_metadata(self) -> Metadata:  # type: ignore[override]
        metadata = read_metadata(self._root, weights_only=self.weights_only,
                                 manifest=self._manifest or {})
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """torch's ``FileSystemReader.read_data`` with checks: each item's bytes are read whole,
        their size and CRC-32 checked, then decoded (``weights_only=True`` for tensors always)."""
        items = self._manifest["items"] if self._manifest is not None else None
        per_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for relative_path, reqs in per_file.items():
            path = self._root / relative_path
            try:  # confined to the checkpoint directory ([checkpoint-confinement])
                stream, size = open_inside(self._root, relative_path, "data")
            except FileNotFoundError:
                raise CheckpointLoadError(
                    f"The checkpoint file {path} is missing (the checkpoint is incomplete; it "
                    f"holds {len(reqs)} item(s) this rank needs, e.g. "
                    f"{reqs[0].storage_index.fqn!r}).") from None
            with stream:
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info: _StorageInfo = self.storage_data[req.storage_index]
                    data = self._read_item(stream, size, path, info, req, items)
                    self._decode(data, path, req, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, stream: io.BufferedReader, size: int, path: Path, info: _StorageInfo,
                   req: ReadItem, items: Mapping[str, Any] | None) -> bytes:
        if not (isinstance(info.offset, int) and isinstance(info.length, int)
                and info.offset >= 0 and info.length >= 0):
            raise CheckpointLoadError(
                f"{self._root / _METADATA_FILENAME} gives item {req.storage_index.fqn!r} of "
                f"{path} the byte range offset={info.offset!r}, length={info.length!r}: the "
                "metadata is damaged or crafted.")
        data = b""
        if info.offset + info.length <= size:  # never read past what the file holds
            stream.seek(info.offset)
            data = stream.read(info.length)
        if len(data) != info.length:
            raise CheckpointLoadError(
                f"The checkpoint file {path} is truncated: item {req.storage_index.fqn!r} needs "
                f"bytes [{info.offset}, {info.offset + info.length}) but the file ends at "
                f"{info.offset + len(data) if data else size}.")
        if items is not None:
            expected = items.get(_item_key(req.storage_index))
            if expected is None:
                raise CheckpointLoadError(
                    f"{self._root / INTEGRITY_FILENAME} has no checksum for item "
                    f"{req.storage_index.fqn!r} of {path}: the manifest does not belong to "
                    "this checkpoint.")
            if _crc32(data) != expected:
                raise CheckpointLoadError(
                    f"The checkpoint file {path} is corrupted: item "
                    f"{req.storage_index.fqn!r} (bytes {info.offset}..{info.offset + info.length})"
                    f" fails its CRC-32 check ({_crc32(data):#010x}, expected {expected:#010x}). "
                    "Restore the file or use another checkpoint.")
        if info.transform_descriptors:
            raise CheckpointLoadError(
                f"{path}: item {req.storage_index.fqn!r} was written with storage transforms "
                f"{list(info.transform_descriptors)}, which this reader does not support.")
        return data

    def _decode(self, data: bytes, path: Path, req: ReadItem, planner: LoadPlanner) -> None:
        try:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data))
                return
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except CheckpointLoadError:
            raise
        except pickle.UnpicklingError as err:
            raise CheckpointRefusedError(
                f"Refusing to load item {req.storage_index.fqn!r} of {path}: {err}. If you trust "
                "this checkpoint, load it with weights_only=False.") from err
        except Exception as err:
            raise CheckpointLoadError(
                f"Item {req.storage_index.fqn!r} of {path} is damaged "
                f"({type(err).__name__}: {err}).") from err
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise CheckpointLoadError(
                f"Item {req.storage_index.fqn!r} of {path} has shape {tuple(tensor.shape)} but "
                f"the destination expects {tuple(target.shape)}.")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


# -- harmless standard types ----------------------------------------------------------------------
#: Classes besides torch's own that ``weights_only=True`` loads allow: values of the standard
#: library whose reconstruction runs no user code, and which ``save_hyperparameters()`` stores
#: when a LightningModule takes them as arguments (a ``pathlib.Path`` data directory, a
#: ``timedelta`` interval). Listed in the README's checkpoint-trust section.
HARMLESS_GLOBALS: tuple[type, ...] = (
    pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath,
    datetime.date, datetime.datetime, datetime.time, datetime.timedelta, datetime.timezone,
)


def safe_torch_load(source: Any, *, weights_only: bool, **kwargs: Any) -> Any:
    """``torch.load`` that, under ``weights_only=True``, also allows :data:`HARMLESS_GLOBALS`."""
    if not weights_only:
        return torch.load(source, weights_only=False, **kwargs)
    with torch.serialization.safe_globals(list(HARMLESS_GLOBALS)):
        return torch.load(source, weights_only=True, **kwargs)


# -- planners whose byte entries load safely ------------------------------------------------------
class _SafeBytesMixin:
    weights_only: bool = True

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = safe_torch_load(value, weights_only=self.weights_only)
        if getattr(self, "flatten_state_dict", False):
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _SafeLoadPlanner(_SafeBytesMixin, DefaultLoadPlanner):
    pass


class _SafeEmptyStateDictLoadPlanner(_SafeBytesMixin, _EmptyStateDictLoadPlanner):
    pass


def safe_planner(*, weights_only: bool = True, empty: bool = False) -> LoadPlanner:
    """A DCP load planner that reads byte entries with ``torch.load(weights_only=...)``.

    ``empty=True`` builds the planner that fills an empty state dict from the metadata (what
    offline consolidation uses).
    """
    planner = _SafeEmptyStateDictLoadPlanner() if empty else _SafeLoadPlanner()
    planner.weights_only = weights_only
    return planner


def load(state_dict: dict[str, Any], path: str | os.PathLike, *, weights_only: bool = True,
         verify: bool = True, planner: LoadPlanner | None = None,
         process_group: dist.ProcessGroup | None = None, no_dist: bool = False) -> None:
    """``dcp.load`` through :class:`SafeFileSystemReader` and :func:`safe_planner`.

    A failure on any rank becomes one :class:`CheckpointLoadError` naming the rank and the file
    (DCP's own ``CheckpointException`` derives from ``BaseException``, so ``except Exception``
    would not even see it). ``no_dist=True`` reads in this process alone, even inside a
    distributed job (offline consolidation).
    """
    if planner is None:
        planner = safe_planner(weights_only=weights_only)
    reader = SafeFileSystemReader(path, weights_only=weights_only, verify=verify)
    alone = no_dist or not (dist.is_available() and dist.is_initialized())
    try:
        _load_state_dict(state_dict, storage_reader=reader, planner=planner,
                         process_group=process_group, no_dist=alone)
    except CheckpointException as err:
        raise_load_error(err, Path(path), alone=alone)


def raise_load_error(err: CheckpointException, path: Path, *, alone: bool = False) -> None:
    """Re-raise a DCP ``CheckpointException`` as one error that names the rank and the file.

    ``alone``: DCP ran in this process only (its "rank 0" is not a rank of any job, so the error
    keeps the rank it was raised with, none outside a distributed job)."""
    failures = getattr(err, "failures", {}) or {}
    causes = {rank: (exc[0] if isinstance(exc, tuple) else exc)
              for rank, exc in sorted(failures.items())}
    for rank, cause in causes.items():  # our errors first: they name the file
        if isinstance(cause, CheckpointLoadError):
            raise type(cause)(cause.detail, rank=cause.rank if alone else rank) from cause
    detail = "; ".join(f"rank {rank}: {type(c).__name__}: {c}" for rank, c in causes.items())
    raise CheckpointLoadError(
        f"Loading the sharded checkpoint {path} failed: {detail or err}") from err


# -- writing the manifest -------------------------------------------------------------------------
def _checksum_files(root: Path, metadata: Metadata, files: list[str]) -> dict[str, int]:
    wanted = set(files)
    by_file: dict[str, list[tuple[MetadataIndex, _StorageInfo]]] = {}
    for index, info in metadata.storage_data.items():
        if info.relative_path in wanted:
            by_file.setdefault(info.relative_path, []).append((index, info))
    out: dict[str, int] = {}
    for relative_path, entries in by_file.items():
        data = memoryview((root / relative_path).read_bytes())
        for index, info in entries:
            out[_item_key(index)] = _crc32(data[info.offset:info.offset + info.length])
    return out


def checksum_items(root: Path, group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """CRC-32 of every item a DCP directory stores; collective over ``group`` when distributed.

    Call it on every rank right after ``dcp.save``: the data files are split across ranks, each
    reads its share back (from the page cache, just written), and every rank gets the merged
    table. A failure on any rank raises on every rank (the outcome is gathered first), so no rank
    is left waiting in a later collective.
    """
    root = Path(root)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    try:
        metadata = read_metadata(root)
        files = sorted({info.relative_path for info in metadata.storage_data.values()})
        mine: dict[str, int] | str = _checksum_files(root, metadata, files[rank::world])
    except Exception as err:  # noqa: BLE001 - reported to every rank below
        mine = f"{type(err).__name__}: {err}"
    gathered: list[Any] = [None] * world
    if distributed:
        dist.all_gather_object(gathered, mine, group=group)
    else:
        gathered = [mine]
    failures = [f"rank {r}: {g}" for r, g in enumerate(gathered) if isinstance(g, str)]
    if failures:
        raise RuntimeError(f"Checksumming the checkpoint {root} failed: {'; '.join(failures)}")
    items: dict[str, int] = {}
    for part in gathered:
        items.update(part)
    return items


def write_manifest(root: Path, items: Mapping[str, int], *,
                   extra_files: tuple[str, ...] = ()) -> None:
    """Write ``root/.integrity.json`` (one process): the item checksums of
    :func:`checksum_items`, and whole-file checksums of ``.metadata`` and ``extra_files`` (names
    relative to ``root``, e.g. a side file of non-tensor state; read them back with
    :func:`read_verified_file`)."""
    root = Path(root)
    whole_files = {}
    for name in (_METADATA_FILENAME, *extra_files):
        data = (root / name).read_bytes()
        whole_files[name] = {"size": len(data), "crc32": _crc32(data)}
    manifest = {"version": _MANIFEST_VERSION, "algorithm": "crc32", "files": whole_files,
                "items": dict(items)}
    tmp = root / (INTEGRITY_FILENAME + ".tmp")
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    os.replace(tmp, root / INTEGRITY_FILENAME)


def write_integrity_manifest(root: Path, group: dist.ProcessGroup | None = None, *,
                             extra_files: tuple[str, ...] = ()) -> None:
    """:func:`checksum_items` (collective) then :func:`write_manifest` on rank 0."""
    items = checksum_items(root, group)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0:
        write_manifest(root, items, extra_files=extra_files)
