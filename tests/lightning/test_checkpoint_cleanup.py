"""Failed saves leave no hidden temporaries; ``remove_checkpoint`` removes stale siblings too.

A save writes into ``.<name>.tmp-<token>`` and renames it into place (design note
[checkpoint-formats] in ``lightning_vescale.checkpoint``). When the write fails, on one rank or
on all, the temporary must be gone afterwards, the previous checkpoint at that name intact, and
every rank must come out of the save (no rank left waiting in a collective).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.checkpoint import _files as checkpoint_files
from lightning_vescale.mesh import init_mesh

RUN_TIMEOUT_S = 90.0  # a hang becomes a TimeoutError well before the harness' default


def _tensors(value: float) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_mesh("cpu", dist.get_world_size())
    full = torch.arange(96, dtype=torch.float32) + value
    return {"state_dict": {"w": distribute_tensor(full, mesh, [Shard(0)]),
                           "b": torch.full((3,), value)}}


def _hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def _fail_sharded_save(directory: str, how: str, fail_ranks: list[int], name: str):
    """Save ``ckpt`` (good), then save ``name`` with a failure injected on ``fail_ranks``."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    directory = Path(directory)
    good = directory / "ckpt"
    ckpt.save_sharded(good, _tensors(1.0), {"step": 1})
    rank = dist.get_rank()
    real_write, real_replace = _FileSystemWriter.write_data, os.replace
    real_exchange = checkpoint_files.exchange

    def write_data(self, plan, planner):
        raise OSError(f"injected: no space left on device (rank {rank})")

    def replace(src, dst):
        if ".tmp-" in os.fspath(src):  # moving the finished temporary into place fails
            raise OSError("injected: rename failed")
        return real_replace(src, dst)

    def exchange(a, b):  # the atomic swap onto an existing checkpoint fails the same way
        if ".tmp-" in os.fspath(a):
            raise OSError("injected: rename failed")
        return real_exchange(a, b)

    if rank in fail_ranks:
        if how == "write":
            _FileSystemWriter.write_data = write_data
        else:
            os.replace = replace
            checkpoint_files.exchange = exchange
    try:
        ckpt.save_sharded(directory / name, _tensors(2.0), {"step": 2})
    except BaseException as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
    else:
        error = None
    finally:
        _FileSystemWriter.write_data, os.replace = real_write, real_replace
        checkpoint_files.exchange = real_exchange
    dist.barrier()  # every rank came out of the failed save, with no collective left pending
    hidden = _hidden(directory)
    visible = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    # the previous checkpoint still loads, with its values
    target = _tensors(0.0)
    import torch.distributed.checkpoint as dcp

    dcp.load(target, checkpoint_id=good)
    w = target["state_dict"]["w"].full_tensor()
    intact = bool(torch.equal(w, torch.arange(96, dtype=torch.float32) + 1.0)
                  and torch.equal(target["state_dict"]["b"], torch.full((3,), 1.0)))
    # and the world still works: a later save succeeds
    ckpt.save_sharded(directory / "after", _tensors(3.0), {"step": 3})
    dist.barrier()
    return error, hidden, visible, intact, _hidden(directory)


@pytest.mark.parametrize("how,fail_ranks", [("write", [1]), ("write", [0]), ("write", [0, 1]),
                                            ("publish", [0])])
@pytest.mark.parametrize("same_name", [True, False])
def test_failed_sharded_save_leaves_no_temporary(worlds, tmp_path, how, fail_ranks, same_name):
    name = "ckpt" if same_name else "epoch=1-step=20.ckpt"  # ModelCheckpoint: a new name
    results = worlds(2).run(_fail_sharded_save, str(tmp_path), how, fail_ranks, name,
                            timeout=RUN_TIMEOUT_S)
    for rank, (error, hidden, visible, intact, hidden_after) in enumerate(results):
        assert error is not None, rank  # every rank raises, none is left waiting
        if how == "write":
            assert "injected: no space left" in error, error
        else:
            assert "injected: rename failed" in error or "Rank 0 failed to publish" in error
        assert hidden == [], hidden  # the partial write was removed
        assert visible == ["ckpt"], visible  # nothing published under the failed name
        assert intact
        assert hidden_after == []


def _fail_full_save(path: str):
    good = {"state_dict": {"w": torch.ones(4)}, "step": 1}
    ckpt.save_full(Path(path), good)
    real_replace = os.replace

    def replace(src, dst):
        if ".tmp-" in os.fspath(src):
            raise OSError("injected: rename failed")
        return real_replace(src, dst)

    if dist.get_rank() == 0:
        os.replace = replace
    try:
        ckpt.save_full(Path(path), {"state_dict": {"w": torch.zeros(4)}, "step": 2})
    except BaseException as e:  # noqa: BLE001
        error = str(e)
    else:
        error = None
    finally:
        os.replace = real_replace
    dist.barrier()
    return error, _hidden(Path(path).parent), torch.load(path, weights_only=True)["step"]


def test_failed_full_save_leaves_no_temporary(worlds, tmp_path):
    results = worlds(2).run(_fail_full_save, str(tmp_path / "last.ckpt"), timeout=RUN_TIMEOUT_S)
    for error, hidden, step in results:
        assert error is not None and ("injected: rename failed" in error
                                      or "Rank 0 failed to write" in error), error
        assert hidden == []
        assert step == 1  # the previous file is untouched


def test_failed_save_without_process_group_leaves_no_temporary(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    def write_data(self, plan, planner):
        raise OSError("injected ENOSPC")

    monkeypatch.setattr(_FileSystemWriter, "write_data", write_data)
    with pytest.raises(RuntimeError, match="injected ENOSPC"):
        ckpt.save_sharded(tmp_path / "epoch=0-step=10.ckpt", {"state_dict": {"w": torch.ones(8)}},
                          {"step": 1})
    assert list(tmp_path.iterdir()) == []


# -- remove_checkpoint ----------------------------------------------------------------------------
def _make(path: Path, as_dir: bool) -> Path:
    if as_dir:
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"x")
    else:
        path.write_bytes(b"x")
    return path


def _dead_owner() -> str:
    """A sibling-token owner (``<pid>@<host>``) whose process is gone: a reaped child's pid."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return f"{int(proc.stdout)}@{socket.gethostname()}"


def _age(path: Path, seconds: float) -> Path:
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)
    return path


@pytest.mark.parametrize("as_dir", [True, False])
def test_remove_checkpoint_removes_stale_siblings(tmp_path, as_dir):
    name = "epoch=1-step=[20].ckpt"  # glob characters in the name are taken literally
    dead, alive = _dead_owner(), f"{os.getppid()}@{socket.gethostname()}"
    old = checkpoint_files.STALE_AFTER_S + 60
    _make(tmp_path / name, as_dir)
    _make(tmp_path / f".{name}.tmp-0123456789.{dead}", True)  # its save was killed
    _make(tmp_path / f".{name}.tmp-abcdefabcd.{dead}", False)
    _age(_make(tmp_path / f".{name}.old-0123456789", True), old)  # no owner recorded, old
    _age(_make(tmp_path / f".{name}.tmp-0123456789.1@another-host", True), old)
    keep = [_make(tmp_path / "epoch=1-step=2.ckpt", as_dir),
            _make(tmp_path / f".epoch=1-step=2.ckpt.tmp-0123456789.{dead}", True),
            _make(tmp_path / f".{name}2.tmp-0123456789.{dead}", True),  # another name's
            _make(tmp_path / f"{name}.tmp-0123456789", False),  # not hidden: not ours
            # a live writer's temporary (another job saving to the same name) is never removed,
            # nor one whose owner cannot be checked and that is recent
            _make(tmp_path / f".{name}.tmp-fedcba9876.{alive}", True),
            _make(tmp_path / f".{name}.tmp-0123456789.1@another-host-2", True),
            _make(tmp_path / f".{name}.tmp-0123456788", True)]
    ckpt.remove_checkpoint(tmp_path / name)
    assert sorted(tmp_path.iterdir()) == sorted(keep)
    ckpt.remove_checkpoint(str(tmp_path / name))  # missing: nothing to do, no error
    ckpt.remove_checkpoint(tmp_path / "missing_dir" / "x.ckpt")
    assert sorted(tmp_path.iterdir()) == sorted(keep)


def test_strategy_remove_checkpoint_takes_hidden_leftovers_along(tmp_path):
    """What ``ModelCheckpoint`` rotation calls: the leftovers of killed saves go too."""
    from lightning_vescale import VeScaleFSDPStrategy

    dead = _dead_owner()
    (tmp_path / "epoch=0.ckpt").mkdir()
    (tmp_path / f".epoch=0.ckpt.tmp-0123456789.{dead}").mkdir()
    (tmp_path / f".epoch=0.ckpt.old-0123456789.{dead}").mkdir()
    (tmp_path / "epoch=1.ckpt").mkdir()  # another checkpoint: untouched
    VeScaleFSDPStrategy().remove_checkpoint(tmp_path / "epoch=0.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1.ckpt"]
