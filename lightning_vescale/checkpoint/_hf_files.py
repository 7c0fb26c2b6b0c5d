"""Which files make a Hugging Face safetensors checkpoint, opened confined and validated.

A checkpoint is a ``.safetensors`` file, or a directory as ``save_pretrained`` writes it: one
``model.safetensors``, or ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map":
{name: shard file}}``) and its shards. :func:`open_checkpoint` opens every file of it inside its
directory (design note [checkpoint-confinement]), parses and validates every header (design note
[safetensors-io]), checks the index against the headers and, when the directory has our
``.integrity.json``, each file's size against it. Every rank opens and validates every header
(a few KB each), so a bad checkpoint fails the same way on every rank, without a collective.

A directory holding both ``model.safetensors`` and the index is read as ``model.safetensors``
(what ``transformers`` does; ``save_safetensors`` publishes by that rule, design note
[hf-publish]). Files written by ``save_safetensors`` carry their save's ``save_id`` (shard
headers' ``__metadata__``, the index's ``metadata``, ``.integrity.json``): files of two saves in
one checkpoint (an interrupted or concurrent save of another writer, a shard copied in by hand)
are a :class:`CheckpointLoadError` naming each file's save, not a silent mix. The check costs
nothing beyond the headers that are read anyway.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from lightning_vescale.checkpoint._confine import open_inside, read_inside
from lightning_vescale.checkpoint._errors import CheckpointLoadError
from lightning_vescale.checkpoint._manifest import INTEGRITY_FILENAME, load_manifest
from lightning_vescale.checkpoint._safetensors_format import TensorEntry, read_header

__all__ = ["INDEX_NAME", "SINGLE_NAME", "OpenCheckpoint", "open_checkpoint"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20


@dataclass
class OpenCheckpoint:
    """The open files of a checkpoint and its validated tensors (close it when done)."""

    root: Path
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    streams: dict[Path, IO[bytes]] = field(default_factory=dict)

    def stream(self, entry: TensorEntry) -> IO[bytes]:
        return self.streams[entry.file]

    def close(self) -> None:
        for s in self.streams.values():
            s.close()
        self.streams.clear()

    def __enter__(self) -> "OpenCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


#: The key of a save's identity (``_hf_publish.SAVE_ID_KEY``; not imported: it imports us).
_SAVE_ID_KEY = "save_id"


def _layout(path: Path) -> tuple[Path, list[str], dict[str, str] | None, str | None]:
    """``(root, file names, weight map or None, the index's save_id)`` of the checkpoint at
    ``path`` (``model.safetensors`` first, as ``transformers`` reads a directory)."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"No Hugging Face checkpoint at {str(path)!r}: it does not exist "
                                "(a .safetensors file, or a directory with model.safetensors or "
                                "model.safetensors.index.json).")
    if not path.is_dir():
        return path.parent, [path.name], None, None
    if (path / SINGLE_NAME).exists():
        return path, [SINGLE_NAME], None, None
    if (path / INDEX_NAME).exists():
        return path, *_read_index(path)
    found = sorted(p.name for p in path.iterdir())[:20]
    raise FileNotFoundError(
        f"The directory {str(path)!r} has neither {SINGLE_NAME} nor {INDEX_NAME} (it holds "
        f"{found}); pass the .safetensors file itself, or the directory save_pretrained wrote.")


def _read_index(root: Path) -> tuple[list[str], dict[str, str], str | None]:
    shown = root / INDEX_NAME
    try:
        index = json.loads(read_inside(root, INDEX_NAME, "index", max_size=MAX_INDEX_BYTES))
    except (ValueError, RecursionError) as err:
        raise CheckpointLoadError(f"The index {str(shown)!r} is not JSON "
                                  f"({type(err).__name__}: {err}).") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(weight_map, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())):
        raise CheckpointLoadError(f"The index {str(shown)!r} has no 'weight_map' of tensor names "
                                  "to file names: it is damaged or not a safetensors index.")
    metadata = index.get("metadata")
    save_id = metadata.get(_SAVE_ID_KEY) if isinstance(metadata, dict) else None
    return sorted(set(weight_map.values())), weight_map, \
        None if save_id is None else str(save_id)


def _check_file(root: Path, name: str, stream: IO[bytes], size: int,
                manifest: dict[str, Any] | None, verify: bool) -> None:
    """The file's size against the manifest (always), its CRC-32 too with ``verify``."""
    expected = (manifest or {}).get("files", {}).get(name)
    if verify and expected is None:
        raise CheckpointLoadError(
            f"load_safetensors(verify=True): {str(root / name)!r} has no checksum (the directory "
            f"has no {INTEGRITY_FILENAME} naming it; save_safetensors writes one). Pass "
            "verify=False to load it unverified.")
    if expected is not None and expected["size"] != size:
        raise CheckpointLoadError(
            f"{str(root / name)!r} fails its integrity check ({size:,} bytes, expected "
            f"{expected['size']:,} by {INTEGRITY_FILENAME}): the file is truncated or damaged; "
            "restore it or use another checkpoint.")
    if verify:
        crc = 0
        stream.seek(0)
        while chunk := stream.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
        if crc & 0xFFFFFFFF != expected["crc32"]:
            raise CheckpointLoadError(
                f"{str(root / name)!r} fails its integrity check (CRC-32 {crc & 0xFFFFFFFF:#010x},"
                f" expected {expected['crc32']:#010x}): the file is damaged; restore it or use "
                "another checkpoint.")


def _check_one_save(root: Path, saves: dict[str, str | None]) -> None:
    """Raise unless the files (``name -> save_id``, ``None`` for a file without one) that carry
    a ``save_id`` all carry the same, and, if any does, all carry one (see the module
    docstring). A checkpoint none of whose files has one (another writer's) is not checked."""
    ids = set(saves.values())
    if ids == {None} or len(ids) <= 1:
        return
    listed = ", ".join(f"{name}: {'no save_id' if sid is None else f'save {sid}'}"
                       for name, sid in sorted(saves.items()))
    raise CheckpointLoadError(
        f"The checkpoint {str(root)!r} mixes files of {len(ids)} different saves ({listed}): "
        "a save into this directory was interrupted or overlapped another, or a file was "
        "copied in from another save. Its tensors would not be one model's; save it again or "
        "restore the directory.")


def open_checkpoint(path: str | os.PathLike, *, verify: bool = False) -> OpenCheckpoint:
    """Open and validate the checkpoint at ``path`` (see the module docstring); ``verify``: also
    check every file's CRC-32 against ``.integrity.json`` (reads every file once, in chunks).

    Raises:
        FileNotFoundError: ``path`` (or a shard the index names) does not exist.
        CheckpointLoadError: a file is outside the directory, damaged, truncated, lies in its
            header, or disagrees with the index; the message names the file (and the key).
    """
    root, names, weight_map, index_save = _layout(Path(path))
    manifest = load_manifest(root) if (root / INTEGRITY_FILENAME).exists() else None
    ckpt = OpenCheckpoint(root=root)
    saves: dict[str, str | None] = {}
    try:
        for name in names:
            try:
                stream, size = open_inside(root, name, "safetensors")
            except FileNotFoundError:
                raise FileNotFoundError(
                    f"The safetensors file {str(root / name)!r} is missing"
                    f"{f' (named by {INDEX_NAME})' if weight_map else ''}.") from None
            ckpt.streams[root / name] = stream
            _check_file(root, name, stream, size, manifest, verify)
            entries, metadata = read_header(stream, size, root / name)
            saves[name] = metadata.get(_SAVE_ID_KEY)
            for key, entry in entries.items():
                if key in ckpt.entries:
                    raise CheckpointLoadError(
                        f"Tensor {key!r} is in both {str(ckpt.entries[key].file)!r} and "
                        f"{str(entry.file)!r}: the checkpoint is damaged.")
                ckpt.entries[key] = entry
        for key, name in (weight_map or {}).items():
            entry = ckpt.entries.get(key)
            if entry is None or entry.file != root / name:
                raise CheckpointLoadError(
                    f"The index {str(root / INDEX_NAME)!r} puts tensor {key!r} in {name!r}, but "
                    f"{'no file has it' if entry is None else f'it is in {entry.file.name!r}'}: "
                    "the index does not match its shards.")
        if weight_map is not None:
            saves[INDEX_NAME] = index_save
        if manifest is not None and _SAVE_ID_KEY in manifest and any(
                name in manifest["files"] for name in names):
            saves[INTEGRITY_FILENAME] = str(manifest[_SAVE_ID_KEY])
        _check_one_save(root, saves)
    except BaseException:
        ckpt.close()
        raise
    return ckpt
