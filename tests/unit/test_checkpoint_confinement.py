"""Loading stays inside the checkpoint directory (design note [checkpoint-confinement]) and the
integrity manifest is validated before use (``checkpoint/_manifest.py``). Single process.

Each crafted checkpoint is what an attacker (or a broken copy) could hand over: storage paths in
``.metadata`` that leave the directory, shards that are links out of it, to ``/dev/zero`` or
FIFOs, and manifests with the right JSON but the wrong types. Every case must end in a
``CheckpointLoadError`` naming the file, never read outside, never hang (an alarm bounds each
load), never surface a raw ``AttributeError``/``KeyError``/``RecursionError``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import warnings
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

DATA = "__0_0.distcp"


@contextlib.contextmanager
def _deadline(seconds: int = 20):
    """Turn a hang (a FIFO open waits for a writer forever) into a test failure."""
    def fail(*_):
        raise TimeoutError(f"the load did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _state() -> dict:
    torch.manual_seed(0)
    return {"w": torch.randn(64, 32), "lr": 0.1}


def _load(root: Path) -> dict:
    out = {"w": torch.zeros(64, 32), "lr": None}
    with _deadline(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no .integrity.json" in the cases that remove it
        load(out, root)
    return out


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    root = tmp_path / "ckpt"
    dcp.save(_state(), checkpoint_id=str(root))
    write_integrity_manifest(root)
    return root


def _point_storage_at(root: Path, target: str) -> None:
    """Rewrite ``.metadata`` so every item is read from ``target``, and re-sign the manifest
    (an attacker can rewrite both; the manifest keys items by name, not by file)."""
    metadata = read_metadata(root)
    for info in metadata.storage_data.values():
        info.relative_path = target
    (root / ".metadata").write_bytes(pickle.dumps(metadata))
    os.remove(root / INTEGRITY_FILENAME)
    write_integrity_manifest(root)


def test_an_intact_checkpoint_loads(checkpoint):
    out = _load(checkpoint)
    assert torch.equal(out["w"], _state()["w"]) and out["lr"] == 0.1


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_storage_paths_outside_the_directory_are_refused(checkpoint, how):
    outside = checkpoint.parent / "outside.distcp"
    shutil.copy(checkpoint / DATA, outside)  # a readable file with exactly the right bytes
    _point_storage_at(checkpoint, "../outside.distcp" if how == "dotdot" else str(outside))
    os.remove(checkpoint / DATA)
    with pytest.raises(CheckpointLoadError, match="outside the checkpoint directory") as err:
        _load(checkpoint)
    assert "outside.distcp" in str(err.value)


def test_a_shard_linked_outside_is_refused(checkpoint):
    outside = checkpoint.parent / "outside.distcp"
    shutil.move(checkpoint / DATA, outside)
    os.symlink(outside, checkpoint / DATA)
    with pytest.raises(CheckpointLoadError, match=r"__0_0\.distcp.* is a link to .*outside"):
        _load(checkpoint)


def test_a_link_inside_the_directory_and_a_linked_directory_load(checkpoint, tmp_path):
    shutil.move(checkpoint / DATA, checkpoint / "real.distcp")
    os.symlink("real.distcp", checkpoint / DATA)  # stays inside: fine
    link = tmp_path / "last.ckpt"
    os.symlink(checkpoint, link)  # Lightning's save_last="link" makes such names
    assert torch.equal(_load(link)["w"], _state()["w"])


@pytest.mark.parametrize("name", [DATA, ".metadata", INTEGRITY_FILENAME])
def test_a_link_to_dev_zero_is_refused(checkpoint, name):
    os.remove(checkpoint / name)
    os.symlink("/dev/zero", checkpoint / name)
    with pytest.raises(CheckpointLoadError, match="outside the checkpoint directory"):
        _load(checkpoint)


@pytest.mark.parametrize("name", [DATA, ".metadata", INTEGRITY_FILENAME])
def test_a_fifo_is_refused_without_hanging(checkpoint, name):
    os.remove(checkpoint / name)
    os.mkfifo(checkpoint / name)
    with pytest.raises(CheckpointLoadError, match=rf"{name.replace('.', '[.]')}.* is not a "
                                                  r"regular file \(a FIFO\)"):
        _load(checkpoint)


def test_an_item_range_past_the_end_is_not_read(checkpoint):
    metadata = read_metadata(checkpoint)
    for info in metadata.storage_data.values():
        info.length = 1 << 40  # a terabyte: must be refused from the file size, not allocated
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    os.remove(checkpoint / INTEGRITY_FILENAME)
    with pytest.raises(CheckpointLoadError, match=r"__0_0\.distcp is truncated"):
        _load(checkpoint)


# -- the manifest ---------------------------------------------------------------------------------
def _rewrite_manifest(root: Path, change) -> None:
    manifest = json.loads((root / INTEGRITY_FILENAME).read_text())
    new = change(manifest)  # edits in place, or returns a replacement (a list or raw text)
    text = new if isinstance(new, str) else json.dumps(new if isinstance(new, list) else manifest)
    (root / INTEGRITY_FILENAME).write_text(text)


@pytest.mark.parametrize("change,expected", [
    (lambda m: [], "a JSON list, not an object"),
    (lambda m: m.update(version="1"), "unknown format version '1'"),
    (lambda m: m.update(files=[]), "'files' is a list"),
    (lambda m: m.update(items="x"), "'items' is a str"),
    (lambda m: m["files"].update({".metadata": {"size": "12"}}), "entry of file '.metadata'"),
    (lambda m: m["files"][".metadata"].pop("crc32"), "entry of file '.metadata'"),
    (lambda m: m["files"][".metadata"].update(crc32=-1), "entry of file '.metadata'"),
    (lambda m: m["items"].update({next(iter(m["items"])): "0x1"}), "not a 32-bit integer"),
    (lambda m: m["items"].update({next(iter(m["items"])): 1 << 40}), "not a 32-bit integer"),
    (lambda m: m["files"].pop(".metadata"), "no entry for '.metadata'"),
    (lambda m: "[" * 100_000 + "]" * 100_000, "RecursionError"),
    (lambda m: '{"version": 1,', "is damaged: JSONDecodeError"),
])
def test_a_malformed_manifest_is_a_load_error(checkpoint, change, expected):
    _rewrite_manifest(checkpoint, change)
    with pytest.raises(CheckpointLoadError, match=r"\.integrity\.json is damaged") as err:
        _load(checkpoint)
    assert expected in str(err.value)


def test_an_oversized_manifest_is_not_read(checkpoint):
    metadata_size = (checkpoint / ".metadata").stat().st_size
    with open(checkpoint / INTEGRITY_FILENAME, "ab") as f:
        f.truncate((1 << 20) + 16 * metadata_size + 1)  # sparse: nothing is written
    with pytest.raises(CheckpointLoadError, match=r"\.integrity\.json.* more than the"):
        _load(checkpoint)
