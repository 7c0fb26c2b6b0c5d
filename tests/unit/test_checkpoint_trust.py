"""Safe, verified DCP loading (design note [checkpoint-trust]), single process, no process group.

Each attack writes a marker file when its payload is unpickled: the test fails if the marker
appears, so a loader that merely raised *after* running the payload would not pass.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_vescale.checkpoint._trust import (
    INTEGRITY_FILENAME,
    CheckpointLoadError,
    load,
    read_metadata,
    write_integrity_manifest,
)


class _WritesMarker:
    """Unpickling this runs ``Path(marker).touch()``: the stand-in for arbitrary code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@dataclasses.dataclass
class _Custom:
    value: int


def _state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(6, 5), "b": torch.randn(5).to(torch.bfloat16), "lr": 0.1,
            "hp": {"betas": (0.9, 0.99), "name": "adamw"}, "step": torch.tensor(7)}


def _empty_like(state: dict) -> dict:
    return {"w": torch.zeros(6, 5), "b": torch.zeros(5, dtype=torch.bfloat16), "lr": None,
            "hp": {"betas": None, "name": None}, "step": torch.tensor(0)}


def _save(path: Path, state: dict, *, manifest: bool = True) -> Path:
    dcp.save(state, checkpoint_id=str(path))
    if manifest:
        write_integrity_manifest(path)
    return path


def _item(path: Path, fqn: str):
    return next(info for index, info in read_metadata(path).storage_data.items()
                if index.fqn == fqn)


def test_round_trip_with_manifest(tmp_path):
    state = _state()
    _save(tmp_path, state)
    assert (tmp_path / INTEGRITY_FILENAME).exists()
    out = _empty_like(state)
    load(out, tmp_path)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
    assert out["lr"] == 0.1 and out["hp"] == {"betas": (0.9, 0.99), "name": "adamw"}
    assert int(out["step"]) == 7


def test_crafted_metadata_is_refused_before_running_anything(tmp_path):
    _save(tmp_path, _state(), manifest=False)
    marker = tmp_path.parent / f"{tmp_path.name}-metadata-marker"
    metadata = read_metadata(tmp_path)
    metadata.planner_data = _WritesMarker(marker)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.warns(UserWarning, match="cannot be verified"), \
            pytest.raises(CheckpointLoadError, match=r"\.metadata.*global pathlib\.Path\.touch"
                          r"|\.metadata.*global pathlib\.Path"):
        load(_empty_like(_state()), tmp_path)
    assert not marker.exists()


def test_crafted_bytes_entry_is_refused_before_running_anything(tmp_path):
    marker = tmp_path.parent / f"{tmp_path.name}-bytes-marker"
    _save(tmp_path, {"w": torch.randn(3), "evil": _WritesMarker(marker)})
    with pytest.raises(CheckpointLoadError, match=r"(?s)Refusing to load item 'evil' of .*"
                                                  r"__0_0\.distcp.*weights_only=False"):
        load({"w": torch.zeros(3), "evil": None}, tmp_path)
    assert not marker.exists()


def test_weights_only_false_is_the_documented_opt_out(tmp_path):
    _save(tmp_path, {"w": torch.randn(3), "custom": _Custom(3)})
    with pytest.raises(CheckpointLoadError, match="weights_only=False"):
        load({"w": torch.zeros(3), "custom": None}, tmp_path)
    out = {"w": torch.zeros(3), "custom": None}
    load(out, tmp_path, weights_only=False)
    assert out["custom"] == _Custom(3)


def test_flipped_tensor_bytes_name_the_file_and_the_item(tmp_path):
    _save(tmp_path, _state())
    info = _item(tmp_path, "w")
    data = bytearray((tmp_path / info.relative_path).read_bytes())
    data[info.offset + info.length - 8] ^= 0x40  # inside the tensor's storage bytes
    (tmp_path / info.relative_path).write_bytes(bytes(data))
    with pytest.raises(CheckpointLoadError,
                       match=r"^The checkpoint .*__0_0\.distcp is corrupted: item 'w'.*CRC-32"):
        # (one process, no process group: no "[rank r]" prefix, there is no rank to name)
        load(_empty_like(_state()), tmp_path)


def test_truncated_data_file_names_the_file(tmp_path):
    _save(tmp_path, _state())
    info = _item(tmp_path, "w")
    path = tmp_path / info.relative_path
    path.write_bytes(path.read_bytes()[: info.offset + info.length // 2])
    with pytest.raises(CheckpointLoadError, match=r"__0_0\.distcp is truncated"):
        load(_empty_like(_state()), tmp_path)


def test_deleted_data_file_names_the_file(tmp_path):
    _save(tmp_path, _state())
    os.remove(tmp_path / _item(tmp_path, "w").relative_path)
    with pytest.raises(CheckpointLoadError, match=r"__0_0\.distcp is missing"):
        load(_empty_like(_state()), tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_metadata_names_the_file(tmp_path, damage):
    _save(tmp_path, _state())
    path = tmp_path / ".metadata"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "flip":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    with pytest.raises(CheckpointLoadError, match=r"\.metadata"):
        load(_empty_like(_state()), tmp_path)


def test_damaged_metadata_without_manifest_still_names_the_file(tmp_path):
    _save(tmp_path, _state(), manifest=False)
    path = tmp_path / ".metadata"
    path.write_bytes(path.read_bytes()[:40])
    with pytest.warns(UserWarning, match="cannot be verified"), \
            pytest.raises(CheckpointLoadError, match=r"\.metadata is damaged"):
        load(_empty_like(_state()), tmp_path)


def test_checkpoint_without_manifest_loads_with_a_warning(tmp_path):
    state = _state()
    _save(tmp_path, state, manifest=False)
    out = _empty_like(state)
    with pytest.warns(UserWarning, match=f"no {INTEGRITY_FILENAME}"):
        load(out, tmp_path)
    assert torch.equal(out["w"], state["w"])


def test_damaged_manifest_is_an_error(tmp_path):
    _save(tmp_path, _state())
    (tmp_path / INTEGRITY_FILENAME).write_text("{not json")
    with pytest.raises(CheckpointLoadError, match=r"integrity manifest .* is damaged"):
        load(_empty_like(_state()), tmp_path)


def test_plain_torch_loading_runs_the_payloads(tmp_path):
    """The hole this module closes, shown on torch's own reader (so the tests above can fail)."""
    marker = tmp_path.parent / f"{tmp_path.name}-plain-marker"
    dcp.save({"w": torch.randn(3), "evil": _WritesMarker(marker)}, checkpoint_id=str(tmp_path))
    dcp.load({"w": torch.zeros(3), "evil": None}, checkpoint_id=str(tmp_path))
    assert marker.exists()
