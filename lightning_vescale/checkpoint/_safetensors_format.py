"""The safetensors file format, read and written without trusting the file.

Design note [safetensors-io]
----------------------------
A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
``{name: {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}``,
then the data; a tensor's bytes are ``[8 + N + begin, 8 + N + end)`` of the file, row-major and
little-endian. We parse the header ourselves (:func:`read_header`) and validate it against the
file's size *before* reading any tensor byte: ``N`` must fit in the file and stay under
:data:`MAX_HEADER_BYTES`, no JSON object may name a key twice (``json`` would keep the last one
silently), every entry must have a known dtype, a non-negative shape and offsets with
``begin <= end``, ``end - begin == numel * itemsize`` and ``8 + N + end <= file size``, and the
tensors must tile the data exactly, as the safetensors library requires: sorted by offset, each
begins where the previous ends, the first at 0 and the last at the end of the file (two tensors
over the same bytes would load one's values into the other; bytes no tensor covers are a sign of
a damaged or hand-edited file). A header that breaks any of this (offsets past the end, a size
that does not match the shape, overlapping offsets, a duplicate key, a gap) or a truncated file
is a :class:`~lightning_vescale.checkpoint.CheckpointLoadError` naming the file and the key;
nothing is read outside the file.

With a validated entry, a contiguous flat element range ``[start, end)`` of the tensor is the
byte range ``[begin + start * itemsize, begin + end * itemsize)``: :func:`read_range` reads exactly
those bytes (``readinto`` a fresh buffer; no ``mmap`` of the whole file, no full tensor), which is
what a ``RaggedShard`` rank owns (design note [ragged-shard]). Writing (:func:`build_header`) is
the inverse: the header follows from names, dtypes and shapes alone, so every rank computes the
same file layout and can write its own byte ranges into the file (``_hf_save.py``).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from lightning_vescale.checkpoint._errors import CheckpointLoadError

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "TensorEntry",
    "build_header",
    "dtype_code",
    "read_header",
    "read_range",
]

#: safetensors' own limit on the JSON header (100 MB).
MAX_HEADER_BYTES = 100_000_000

#: safetensors dtype codes -> torch dtypes (those this torch has).
DTYPES: dict[str, torch.dtype] = {
    code: dt for code, dt in (
        ("F64", torch.float64), ("F32", torch.float32), ("F16", torch.float16),
        ("BF16", torch.bfloat16), ("I64", torch.int64), ("I32", torch.int32),
        ("I16", torch.int16), ("I8", torch.int8), ("U8", torch.uint8), ("BOOL", torch.bool),
        ("U16", getattr(torch, "uint16", None)), ("U32", getattr(torch, "uint32", None)),
        ("U64", getattr(torch, "uint64", None)),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
    ) if dt is not None
}
_CODES = {dt: code for code, dt in DTYPES.items()}


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One validated tensor of a safetensors file: where its bytes are (absolute offsets)."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of ``dtype`` (``ValueError`` for one the format has not)."""
    if dtype not in _CODES:
        raise ValueError(f"safetensors cannot store dtype {dtype}; pass dtype= (e.g. "
                         "torch.bfloat16) to convert.")
    return _CODES[dtype]


def _bad(path: Path, key: str | None, problem: str) -> CheckpointLoadError:
    where = f"tensor {key!r} of " if key is not None else ""
    return CheckpointLoadError(
        f"The safetensors file {str(path)!r} is damaged or not a safetensors file: {where}"
        f"{problem}. Nothing was read outside the file; re-download or re-save it.")


def read_header(stream: IO[bytes], size: int, path: Path) -> tuple[dict[str, TensorEntry],
                                                                   dict[str, str]]:
    """The validated entries (and ``__metadata__``) of an open safetensors file of ``size`` bytes.

    See design note [safetensors-io] for what is checked; any failure is a
    :class:`CheckpointLoadError` naming ``path`` (and the key, for a bad entry).
    """
    if size < 8:
        raise _bad(path, None, f"it is {size} bytes, shorter than the 8-byte header length")
    stream.seek(0)
    (n,) = struct.unpack("<Q", stream.read(8))
    if n > min(size - 8, MAX_HEADER_BYTES):
        raise _bad(path, None, f"its header claims {n:,} bytes but the file has "
                               f"{size - 8:,} after the length (limit {MAX_HEADER_BYTES:,})")
    raw = stream.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as dup:
        raise _bad(path, dup.key, "its name appears twice in one object of the header (JSON "
                                  "parsers keep one silently; safetensors refuses it)") from None
    except (ValueError, RecursionError) as err:
        raise _bad(path, None, f"its header is not JSON ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise _bad(path, None, f"its header is a JSON {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise _bad(path, None, "its __metadata__ is not an object")
    data_start, data_len = 8 + n, size - 8 - n
    entries = {name: _entry(path, name, info, data_start, data_len)
               for name, info in header.items()}
    _check_tiling(path, entries, data_start, data_len)
    return entries, {str(k): str(v) for k, v in meta.items()}


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook``: an object naming a key twice is refused."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _check_tiling(path: Path, entries: dict[str, TensorEntry], data_start: int,
                  data_len: int) -> None:
    """The tensors cover the data exactly once, back to back (see the design note); an overlap
    is reported before a gap (it is what loads wrong values)."""
    spans = sorted(entries.values(), key=lambda e: (e.begin, e.end))

    def rel(e: TensorEntry) -> list[int]:
        return [e.begin - data_start, e.end - data_start]

    for before, e in zip(spans, spans[1:]):
        if e.begin < before.end:
            raise _bad(path, e.name, f"data_offsets {rel(e)} overlap those of tensor "
                                     f"{before.name!r} {rel(before)} (two tensors over the "
                                     "same bytes)")
    pos = data_start
    for e in spans:
        if e.begin > pos:
            raise _bad(path, None, f"the data bytes [{pos - data_start:,}, {rel(e)[0]:,}) before "
                                   f"tensor {e.name!r} belong to no tensor")
        pos = e.end
    if pos != data_start + data_len:
        raise _bad(path, None, f"the last {data_start + data_len - pos:,} bytes of the data "
                               f"(from byte {pos - data_start:,} of {data_len:,}) belong to no "
                               "tensor")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: Path, name: str, info: Any, data_start: int, data_len: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise _bad(path, name, f"its entry is {type(info).__name__}, not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if code not in DTYPES:
        raise _bad(path, name, f"unknown dtype {code!r}")
    if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
        raise _bad(path, name, f"shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise _bad(path, name, f"data_offsets {offsets!r} are not [begin, end] with begin <= end")
    dtype = DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize
    begin, end = offsets
    if end - begin != expected:
        raise _bad(path, name, f"data_offsets {offsets} span {end - begin:,} bytes but shape "
                               f"{tuple(shape)} of {code} needs {expected:,}")
    if end > data_len:
        raise _bad(path, name, f"data_offsets {offsets} end past the data, which is {data_len:,} "
                               "bytes (the file is truncated, or its header lies)")
    return TensorEntry(file=path, name=name, dtype=dtype, shape=tuple(shape),
                       begin=data_start + begin, end=data_start + end)


def read_range(stream: IO[bytes], entry: TensorEntry, start: int = 0, end: int | None = None,
               *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Elements ``[start, end)`` of the flattened tensor ``entry`` (1-D, the file's dtype).

    Reads exactly those bytes, into ``out`` if given (a contiguous CPU tensor of
    ``entry.dtype`` and ``end - start`` elements, e.g. a shard), else into a new tensor.
    ``entry`` was validated against the file size (:func:`read_header`); a file that shrank
    since is a :class:`CheckpointLoadError`.
    """
    end = entry.numel if end is None else end
    assert 0 <= start <= end <= entry.numel, (start, end, entry.numel)
    if out is None:
        out = torch.empty(end - start, dtype=entry.dtype)
    assert out.dtype == entry.dtype and out.numel() == end - start and out.is_contiguous()
    if end > start:
        stream.seek(entry.begin + start * entry.dtype.itemsize)
        _read_exactly(stream, memoryview(out.view(-1).view(torch.uint8).numpy()), entry)
    return out


def _read_exactly(stream: IO[bytes], view: memoryview, entry: TensorEntry) -> None:
    got = 0
    while got < len(view):
        n = stream.readinto(view[got:])
        if not n:
            raise _bad(entry.file, entry.name, f"the file ended after {got:,} of the "
                       f"{len(view):,} bytes to read (it shrank while being read)")
        got += n


def build_header(tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, int]]:
    """The header bytes (length prefix included) for ``tensors`` in this order, and each
    tensor's absolute byte offset in the file. The data follow the header back to back."""
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offsets, pos = {}, 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_code(dtype), "shape": [int(s) for s in shape],
                        "data_offsets": [pos, pos + nbytes]}
        offsets[name] = pos
        pos += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    start = 8 + len(raw)
    return struct.pack("<Q", len(raw)) + raw, {k: start + v for k, v in offsets.items()}
