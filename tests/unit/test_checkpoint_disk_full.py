"""A full disk is reported as "No space left on <dir>" first, for both checkpoint formats.

Before: the sharded format's error read ``CheckpointException ranks:dict_keys([0, 1])`` (the
``ENOSPC`` only deep in a rank's traceback) and the full format's torch's ``unexpected pos 832 vs
726`` with no path at all. The real case runs on a 1 MiB tmpfs where the machine allows mounting
one (root on Linux, as on CI); the simulated cases run everywhere.
"""

from __future__ import annotations

import errno
import subprocess
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.checkpoint import _files


def _state(n: int = 1024 * 1024) -> dict:
    return {"state_dict": {"w": torch.zeros(n)}}


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MiB tmpfs, or a skip where this machine cannot mount one."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _save_error(save) -> BaseException:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OSError) as info:
            save()
    return info.value


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_full_disk_is_named_first(tiny_fs, fmt):
    path = tiny_fs / "last.ckpt"
    save = (lambda: ckpt.save_sharded(path, _state(), {"step": 1})) if fmt == "sharded" else (
        lambda: ckpt._full.save_full(path, _state()))
    err = _save_error(save)
    assert err.errno == errno.ENOSPC
    assert str(err).startswith(f"[Errno 28] No space left on {str(tiny_fs)!r}"), str(err)
    assert str(path) in str(err)
    assert list(tiny_fs.iterdir()) == []  # the partial write was removed


def test_sharded_simulated_rank_failure_is_named_first(tmp_path, monkeypatch):
    def dcp_save(*args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            failure = (e, traceback.extract_tb(e.__traceback__))
        raise CheckpointException("CheckpointException ranks:dict_keys([1])", {1: failure})

    monkeypatch.setattr(ckpt._sharded.dcp, "save", dcp_save)
    path = tmp_path / "last.ckpt"
    err = _save_error(lambda: ckpt.save_sharded(path, _state(8), {"step": 1}))
    assert str(err).startswith(f"[Errno 28] No space left on {str(tmp_path)!r}")
    assert "untouched" in str(err) and not list(tmp_path.iterdir())


def test_full_simulated_writer_error_is_named_first(tmp_path, monkeypatch):
    def torch_save(obj, f, *args, **kwargs):
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8 vs 6")

    monkeypatch.setattr(ckpt._full.torch, "save", torch_save)
    path = tmp_path / "model.ckpt"
    err = _save_error(lambda: ckpt._full.save_full(path, _state(8)))
    assert err.errno == errno.EDQUOT and "No space left on" in str(err) and str(path) in str(err)


def test_other_errors_are_not_called_a_full_disk():
    assert _files.find_no_space(RuntimeError("unexpected pos 8 vs 6")) is None
    assert _files.find_no_space(OSError(errno.EACCES, "Permission denied")) is None
    _files.raise_if_no_space(RuntimeError("x"), Path("/x/y"), "saving", "nothing changed")


def _hf_model(n: int):
    from torch import nn

    model = nn.Linear(n, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    return model


def test_safetensors_full_disk_is_named_and_the_previous_save_kept(tiny_fs):
    """Issue 34: ``save_safetensors`` raised a bare ``OSError: [Errno 28]`` with no path and
    left its full-size temporaries. Now: the directory, the free space and what is left; the
    previous save in the directory still loads, no temporary is left."""
    pytest.importorskip("safetensors")
    from lightning_vescale.checkpoint import load_safetensors, save_safetensors

    directory = tiny_fs / "hf"
    save_safetensors(_hf_model(1024), directory)  # 4 KiB: fits
    before = sorted(p.name for p in directory.iterdir())
    err = _save_error(lambda: save_safetensors(_hf_model(1024 * 1024), directory))  # 4 MiB
    assert err.errno == errno.ENOSPC
    assert str(err).startswith(f"[Errno 28] No space left on {str(directory)!r}"), str(err)
    assert "MiB free now" in str(err) and "previous save in that directory" in str(err)
    assert sorted(p.name for p in directory.iterdir()) == before  # no temporaries left
    model = _hf_model(1024)
    torch.nn.init.zeros_(model.weight)
    load_safetensors(model, directory, verify=True)
    assert bool((model.weight == 1).all())


def test_safetensors_simulated_full_disk_is_named(tmp_path, monkeypatch):
    pytest.importorskip("safetensors")
    from lightning_vescale.checkpoint import _hf_save, save_safetensors

    def pwrite(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_hf_save.os, "pwrite", pwrite)
    err = _save_error(lambda: save_safetensors(_hf_model(8), tmp_path / "hf"))
    assert str(err).startswith(f"[Errno 28] No space left on {str(tmp_path / 'hf')!r}")
    assert "nothing was published" in str(err)
    assert list((tmp_path / "hf").iterdir()) == []
