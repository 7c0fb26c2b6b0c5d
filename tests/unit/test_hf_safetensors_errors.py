"""``load_safetensors`` / ``save_safetensors`` in one process: plain modules, dtype conversion,
``key_map``, and bad input (issue 27): a missing file, a key or shape mismatch, a truncated file,
a header that lies about its offsets, a shard outside the directory: each a clear error naming
the file and the key, raised before any tensor byte is read."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

from safetensors.torch import load_file, save_file  # noqa: E402

from lightning_vescale.checkpoint import (  # noqa: E402
    checkpoint_keys,
    load_safetensors,
    save_safetensors,
)
from lightning_vescale.checkpoint._errors import CheckpointLoadError  # noqa: E402


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lin = nn.Linear(4, 3)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in Tiny().state_dict().items()}


def _write(path, tensors=None) -> dict[str, torch.Tensor]:
    tensors = tensors if tensors is not None else _tensors()
    save_file(tensors, str(path))
    return tensors


def _header(path) -> tuple[int, dict]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8:8 + n])


def _rewrite_header(path, header: dict) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    raw = json.dumps(header).encode()  # data offsets are relative to the end of the header
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_plain_module_file_and_dtype_conversion(tmp_path):
    ref = _write(tmp_path / "w.safetensors", {k: v.to(torch.bfloat16) for k, v in
                                              _tensors().items()})
    model = Tiny()
    assert load_safetensors(model, tmp_path / "w.safetensors") == ([], [])
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, ref[k].float()), k


def test_meta_plain_module(tmp_path):
    ref = _write(tmp_path / "model.safetensors")
    with torch.device("meta"):
        model = Tiny()
    load_safetensors(model, tmp_path)  # a directory with model.safetensors
    for k, v in model.state_dict().items():
        assert not v.is_meta and torch.equal(v, ref[k]), k


def test_key_map_dict_and_callable(tmp_path):
    ref = _write(tmp_path / "w.safetensors", {f"model.{k}": v for k, v in _tensors().items()})
    model = Tiny()
    load_safetensors(model, tmp_path / "w.safetensors", key_map=lambda k: k[len("model."):])
    assert torch.equal(model.lin.weight, ref["model.lin.weight"])
    model = Tiny()
    mapping = {f"model.{k}": k for k in _tensors()}
    load_safetensors(model, tmp_path / "w.safetensors", key_map=mapping)
    assert torch.equal(model.emb.weight, ref["model.emb.weight"])


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_safetensors(Tiny(), tmp_path / "nope.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor"):
        load_safetensors(Tiny(), tmp_path)


def test_index_names_a_missing_shard(tmp_path):
    _write(tmp_path / "model-00001-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in _tensors()}
    weight_map["extra"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors.*missing"):
        load_safetensors(Tiny(), tmp_path)


def test_index_pointing_outside_the_directory(tmp_path):
    (tmp_path / "ckpt").mkdir()
    _write(tmp_path / "outside.safetensors")
    weight_map = {k: "../outside.safetensors" for k in _tensors()}
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointLoadError, match=r"outside the checkpoint directory"):
        load_safetensors(Tiny(), tmp_path / "ckpt")


def test_key_mismatch_names_the_keys(tmp_path):
    tensors = _tensors()
    tensors["extra.weight"] = tensors.pop("lin.bias")
    _write(tmp_path / "w.safetensors", tensors)
    with pytest.raises(RuntimeError, match=r"missing.*'lin\.bias'.*\n.*unexpected.*'extra\.weight'"):
        load_safetensors(Tiny(), tmp_path / "w.safetensors")
    model = Tiny()
    result = load_safetensors(model, tmp_path / "w.safetensors", strict=False)
    assert result.missing_keys == ["lin.bias"] and result.unexpected_keys == ["extra.weight"]
    assert torch.equal(model.lin.weight, tensors["lin.weight"])


def test_shape_mismatch_names_key_and_both_shapes(tmp_path):
    tensors = _tensors()
    tensors["lin.weight"] = torch.zeros(5, 4)
    _write(tmp_path / "w.safetensors", tensors)
    model = Tiny()
    before = model.emb.weight.clone()
    with pytest.raises(ValueError, match=r"'lin\.weight'.*\(5, 4\).*\(3, 4\)"):
        load_safetensors(model, tmp_path / "w.safetensors")
    assert torch.equal(model.emb.weight, before), "nothing is loaded when a shape mismatches"


def test_truncated_file(tmp_path):
    path = tmp_path / "w.safetensors"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    n, header = _header(path)
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(CheckpointLoadError, match=rf"w\.safetensors.*{last}.*truncated"):
        load_safetensors(Tiny(), path)
    path.write_bytes(data[:6])
    with pytest.raises(CheckpointLoadError, match="shorter than the 8-byte header length"):
        load_safetensors(Tiny(), path)


def test_header_lies_about_offsets(tmp_path):
    path = tmp_path / "w.safetensors"
    _write(path)
    _, header = _header(path)
    good = json.loads(json.dumps(header))
    header["lin.weight"]["data_offsets"] = [10**12, 10**12 + 48]
    _rewrite_header(path, header)
    with pytest.raises(CheckpointLoadError, match=r"w\.safetensors.*'lin\.weight'.*end past"):
        load_safetensors(Tiny(), path)
    header = json.loads(json.dumps(good))
    begin = header["lin.weight"]["data_offsets"][0]
    header["lin.weight"]["data_offsets"] = [begin, begin + 4]  # fewer bytes than the shape
    _rewrite_header(path, header)
    with pytest.raises(CheckpointLoadError, match=r"'lin\.weight'.*needs 48"):
        load_safetensors(Tiny(), path)
    header = json.loads(json.dumps(good))
    header["lin.weight"]["dtype"] = "X99"
    _rewrite_header(path, header)
    with pytest.raises(CheckpointLoadError, match=r"'lin\.weight'.*unknown dtype"):
        load_safetensors(Tiny(), path)


def test_header_length_past_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    _write(path)
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 10**9) + data[8:])
    with pytest.raises(CheckpointLoadError, match=r"header claims 1,000,000,000 bytes"):
        load_safetensors(Tiny(), path)
    path.write_bytes(struct.pack("<Q", 4) + b"[1] " + data[12:])
    with pytest.raises(CheckpointLoadError, match="not an object"):
        load_safetensors(Tiny(), path)


def test_save_round_trip_manifest_and_stale_shards(tmp_path):
    model = Tiny()
    files = save_safetensors(model, tmp_path, max_shard_size=100)
    shards = [f for f in files if f.name.endswith(".safetensors")]
    assert len(shards) == 2 and (tmp_path / ".integrity.json").exists()
    manifest = json.loads((tmp_path / ".integrity.json").read_text())
    assert manifest["format"] == "safetensors"
    assert set(manifest["files"]) == {f.name for f in files}
    loaded = {}
    for f in shards:
        loaded.update(load_file(f))
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert sorted(checkpoint_keys(tmp_path)) == sorted(model.state_dict())
    save_safetensors(model, tmp_path)  # one file now: the two shards go
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    # a file cut short is caught by its size in the manifest before its header is parsed
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-4])
    with pytest.raises(CheckpointLoadError, match=r"model\.safetensors.*integrity check"):
        load_safetensors(Tiny(), tmp_path)


def test_save_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_shard_size"):
        save_safetensors(Tiny(), tmp_path, max_shard_size="lots")
    save_safetensors(Tiny(), tmp_path, max_shard_size="1KB", dtype=torch.float16,
                     key_map=lambda k: None if k.startswith("emb") else f"x.{k}")
    loaded = load_file(tmp_path / "model.safetensors")
    assert sorted(loaded) == ["x.lin.bias", "x.lin.weight"]
    assert loaded["x.lin.weight"].dtype == torch.float16


def test_verify_checks_every_crc(tmp_path):
    save_safetensors(Tiny(), tmp_path, max_shard_size=100)
    load_safetensors(Tiny(), tmp_path, verify=True)
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # a flipped bit in a tensor: same size, header fine
    shard.write_bytes(bytes(data))
    load_safetensors(Tiny(), tmp_path)  # unverified: loads
    with pytest.raises(CheckpointLoadError, match=rf"{shard.name}.*CRC-32"):
        load_safetensors(Tiny(), tmp_path, verify=True)
    (tmp_path / ".integrity.json").unlink()
    with pytest.raises(CheckpointLoadError, match="has no checksum"):
        load_safetensors(Tiny(), tmp_path, verify=True)


def _rewrite_raw_header(path, raw: bytes) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_overlapping_offsets_duplicate_keys_and_uncovered_bytes(tmp_path):
    """Issue 34: each loaded wrong weights without a word (two tensors over the same bytes; the
    last of two entries of one key; the safetensors library refuses both, and uncovered bytes);
    also through ``pretrained_weights=`` (``load_pretrained``)."""
    from lightning_vescale._lightning.pretrained import load_pretrained

    path = tmp_path / "w.safetensors"
    _write(path)
    _, good = _header(path)
    header = json.loads(json.dumps(good))
    weight = header["lin.weight"]["data_offsets"]
    header["lin.bias"]["data_offsets"] = [weight[0], weight[0] + 12]  # inside lin.weight
    _rewrite_header(path, header)
    for load in (lambda: load_safetensors(Tiny(), path),
                 lambda: load_pretrained(Tiny(), path, strict=True)):
        with pytest.raises(CheckpointLoadError,
                           match=r"w\.safetensors.*'lin\.weight'.*overlap.*'lin\.bias'"):
            load()
    # one key twice: JSON keeps the last entry, which points at another tensor's bytes
    raw = json.dumps(good)[:-1] + ', "lin.weight": ' + json.dumps(
        {"dtype": "F32", "shape": [3, 4], "data_offsets": good["emb.weight"]["data_offsets"][:1]
         + [good["emb.weight"]["data_offsets"][0] + 48]}) + "}"
    _rewrite_raw_header(path, raw.encode())
    with pytest.raises(CheckpointLoadError, match=r"w\.safetensors.*'lin\.weight'.*appears twice"):
        load_safetensors(Tiny(), path)
    # bytes no tensor covers: a gap between two tensors, and bytes after the last one
    _rewrite_header(path, good)
    data = path.read_bytes()
    path.write_bytes(data + b"\0" * 8)
    with pytest.raises(CheckpointLoadError, match=r"w\.safetensors.*last 8 bytes.*belong to no"):
        load_safetensors(Tiny(), path)
    header = json.loads(json.dumps(good))
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    header[last]["data_offsets"] = [o + 8 for o in header[last]["data_offsets"]]
    _rewrite_header(path, header)
    with pytest.raises(CheckpointLoadError, match=rf"bytes \[\d+, \d+\) before tensor '{last}' "
                                                  "belong to no tensor"):
        load_safetensors(Tiny(), path)
    # the untouched entries still describe a valid file
    _rewrite_header(path, good)
    path.write_bytes(path.read_bytes()[:-8])
    load_safetensors(Tiny(), path)


def test_save_layout_argument_is_checked(tmp_path):
    from lightning_vescale.checkpoint import save_safetensors

    with pytest.raises(ValueError, match=r"layout='hf'.*'save_pretrained'.*'state_dict'"):
        save_safetensors(torch.nn.Linear(2, 2), tmp_path, layout="hf")
