"""Reading and validating ``.integrity.json``, the checksums of a sharded checkpoint.

The manifest is plain JSON written by :func:`lightning_vescale.checkpoint._trust.write_manifest`
(design note [checkpoint-trust])::

    {"version": 1, "algorithm": "crc32",
     "files": {".metadata": {"size": int, "crc32": int}, "meta.pt": {...}},
     "items": {"<fqn>|<offsets>|<index>": crc32, ...}}

A Hugging Face safetensors directory written by ``save_safetensors`` has one too, with
``"format": "safetensors"`` and whole-file entries for every shard and the index (no
``.metadata``, no items).

It comes with the checkpoint, so it is checked like any other input before anything uses it
(:func:`load_manifest`): its size is bounded before it is read (:func:`manifest_size_cap`), and
its schema (types, ranges, the ``.metadata`` entry every manifest has) is validated, so a damaged
or crafted one is a :class:`CheckpointLoadError` naming the problem, never a raw
``AttributeError``/``KeyError``/``RecursionError`` or a silently skipped check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lightning_vescale.checkpoint._confine import read_inside, resolve_inside
from lightning_vescale.checkpoint._errors import CheckpointLoadError

__all__ = ["INTEGRITY_FILENAME", "MANIFEST_VERSION", "SAFETENSORS_FORMAT", "load_manifest",
           "manifest_size_cap"]

#: The manifest of checksums beside ``.metadata`` in every sharded checkpoint we write.
INTEGRITY_FILENAME = ".integrity.json"
MANIFEST_VERSION = 1
#: The ``"format"`` of the manifest of a safetensors directory (``_hf_save.py``).
SAFETENSORS_FORMAT = "safetensors"
_METADATA_FILENAME = ".metadata"

#: The manifest holds one entry per item of ``.metadata``, which describes each item in more
#: bytes (measured: the manifest is 0.17x the size of ``.metadata`` for 10-character names, 0.58x
#: for 200, 0.92x for 2000); the cap leaves a wide margin.
MANIFEST_BYTES_PER_METADATA_BYTE = 16
MANIFEST_BASE_BYTES = 1 << 20


def manifest_size_cap(root: Path) -> int:
    """The largest ``.integrity.json`` a checkpoint may have: ``MANIFEST_BASE_BYTES`` (1 MiB)
    plus ``MANIFEST_BYTES_PER_METADATA_BYTE`` (16) times the size of its ``.metadata``."""
    try:
        metadata_size = os.stat(resolve_inside(root, _METADATA_FILENAME, "metadata")).st_size
    except (OSError, CheckpointLoadError):
        metadata_size = 0  # reported when .metadata itself is read
    return MANIFEST_BASE_BYTES + MANIFEST_BYTES_PER_METADATA_BYTE * metadata_size


def load_manifest(root: Path) -> dict[str, Any] | None:
    """The validated manifest of the checkpoint ``root``, or ``None`` if it has none."""
    root = Path(root)
    path = root / INTEGRITY_FILENAME
    if not os.path.lexists(path):
        return None
    try:
        data = read_inside(root, INTEGRITY_FILENAME, "integrity manifest",
                           max_size=manifest_size_cap(root))
    except FileNotFoundError:
        return None  # removed meanwhile
    except OSError as err:
        raise CheckpointLoadError(f"Could not read the integrity manifest {path}: {err}") \
            from err
    try:
        manifest = json.loads(data)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise CheckpointLoadError(
            f"The integrity manifest {path} is damaged: {type(err).__name__}: {err}") from None
    problem = _schema_problem(manifest)
    if problem is not None:
        raise CheckpointLoadError(
            f"The integrity manifest {path} is damaged or not ours: {problem}. Restore it (or "
            "remove it to load the checkpoint unverified).")
    return manifest


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _schema_problem(manifest: Any) -> str | None:
    """What is wrong with a parsed manifest, or ``None`` if it has the schema above."""
    if not isinstance(manifest, dict):
        return f"it holds a JSON {type(manifest).__name__}, not an object"
    if manifest.get("version") != MANIFEST_VERSION or isinstance(manifest.get("version"), bool):
        return (f"unknown format version {manifest.get('version')!r} (expected "
                f"{MANIFEST_VERSION})")
    if manifest.get("algorithm") != "crc32":
        return f"unknown checksum algorithm {manifest.get('algorithm')!r} (expected 'crc32')"
    files, items = manifest.get("files"), manifest.get("items")
    if not isinstance(files, dict):
        return f"'files' is a {type(files).__name__}, not an object"
    if not isinstance(items, dict):
        return f"'items' is a {type(items).__name__}, not an object"
    if _METADATA_FILENAME not in files and manifest.get("format") != SAFETENSORS_FORMAT:
        return f"it has no entry for {_METADATA_FILENAME!r} (every manifest checks it)"
    for name, entry in files.items():
        if not (isinstance(entry, dict) and _is_int(entry.get("size"), 0, 1 << 63)
                and _is_int(entry.get("crc32"), 0, 1 << 32)):
            return (f"the entry of file {name!r} is {_short(entry)}, not "
                    "{'size': <int >= 0>, 'crc32': <32-bit int>}")
    for key, crc in items.items():
        if not _is_int(crc, 0, 1 << 32):
            return f"the checksum of item {key!r} is {_short(crc)}, not a 32-bit integer"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
