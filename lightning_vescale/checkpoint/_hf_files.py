"""Which files make a Hugging Face safetensors checkpoint, opened confined and validated.

A checkpoint is a ``.safetensors`` file, or a directory as ``save_pretrained`` writes it: one
``model.safetensors``, or ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map":
{name: shard file}}``) and its shards. :func:`open_checkpoint` opens every file of it inside its
directory (design note [checkpoint-confinement]), parses and validates every header (design note
[safetensors-io]), checks the index against the headers and, when the directory has our
``.integrity.json``, each file's size against it. Every rank opens and validates every header
(a few KB each), so a bad checkpoint fails the same way on every rank, without a collective.
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


def _layout(path: Path) -> tuple[Path, list[str], dict[str, str] | None]:
    """``(root, file names, weight map or None)`` of the checkpoint at ``path``."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"No Hugging Face checkpoint at {str(path)!r}: it does not exist "
                                "(a .safetensors file, or a directory with model.safetensors or "
                                "model.safetensors.index.json).")
    if not path.is_dir():
        return path.parent, [path.name], None
    if (path / INDEX_NAME).exists():
        return path, *_read_index(path)
    if (path / SINGLE_NAME).exists():
        return path, [SINGLE_NAME], None
    found = sorted(p.name for p in path.iterdir())[:20]
    raise FileNotFoundError(
        f"The directory {str(path)!r} has neither {SINGLE_NAME} nor {INDEX_NAME} (it holds "
        f"{found}); pass the .safetensors file itself, or the directory save_pretrained wrote.")


def _read_index(root: Path) -> tuple[list[str], dict[str, str]]:
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
    return sorted(set(weight_map.values())), weight_map


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


def open_checkpoint(path: str | os.PathLike, *, verify: bool = False) -> OpenCheckpoint:
    """Open and validate the checkpoint at ``path`` (see the module docstring); ``verify``: also
    check every file's CRC-32 against ``.integrity.json`` (reads every file once, in chunks).

    Raises:
        FileNotFoundError: ``path`` (or a shard the index names) does not exist.
        CheckpointLoadError: a file is outside the directory, damaged, truncated, lies in its
            header, or disagrees with the index; the message names the file (and the key).
    """
    root, names, weight_map = _layout(Path(path))
    manifest = load_manifest(root) if (root / INTEGRITY_FILENAME).exists() else None
    ckpt = OpenCheckpoint(root=root)
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
            entries, _ = read_header(stream, size, root / name)
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
    except BaseException:
        ckpt.close()
        raise
    return ckpt
