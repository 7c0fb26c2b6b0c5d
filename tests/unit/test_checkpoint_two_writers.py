"""Two live writers saving to one checkpoint name never destroy the published checkpoint.

The case the issue reproduced (4 of 4 runs before the fix): a preempted job still alive while its
restart saves to the same name. Each of two forked processes saves ``ROUNDS`` sharded
checkpoints of a few MiB to the same path, each save filled with a value of its own. After both
finish, and after every save of the checker in between, the path must hold one whole save of one
writer: every element of every tensor one value that some writer saved, the side file agreeing,
and the integrity manifest verifying. Before the fix a writer's clean-up removed the other's live
temporary ``.<name>.tmp-*`` directory while that one was being exchanged into place, emptying the
published checkpoint (only ``.integrity.json`` left) so that every later save failed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
import warnings
from pathlib import Path

import torch

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.checkpoint import _files, _trust

ROUNDS = 30
ELEMENTS = 2 * 1024 * 1024  # 8 MiB of fp32, as in the reproduction: the write overlaps a rival publish


def _state(value: float) -> dict:
    return {"state_dict": {"w": torch.full((ELEMENTS,), value), "b": torch.full((3,), value)}}


def _writer(path: str, base: float, report: str) -> None:
    code = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(ROUNDS):
                ckpt.save_sharded(Path(path), _state(base + i), {"global_step": int(base + i)})
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        Path(report).write_text(traceback.format_exc())
        code = 1
    finally:
        os._exit(code)


def _published_value(path: Path) -> float:
    target = {"state_dict": {"w": torch.zeros(ELEMENTS), "b": torch.zeros(3)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trust.load(target, path, no_dist=True)
        meta = ckpt._sharded.read_side_file(path)
    value = float(target["state_dict"]["w"][0])
    assert torch.equal(target["state_dict"]["w"], torch.full((ELEMENTS,), value)), "mixed save"
    assert torch.equal(target["state_dict"]["b"], torch.full((3,), value)), "mixed save"
    assert meta["global_step"] == int(value), "side file from another save"
    return value


def test_two_live_writers_leave_one_whole_save(tmp_path):
    path = tmp_path / "last.ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.save_sharded(path, _state(0.0), {"global_step": 0})
    ctx = mp.get_context("fork")
    reports = [tmp_path / f"writer{base:.0f}.err" for base in (100., 200.)]
    procs = [ctx.Process(target=_writer, args=(str(path), base, str(report)))
             for base, report in zip((100., 200.), reports)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    value = _published_value(path)
    failures = [r.read_text() for r in reports if r.exists()]
    assert not failures, "\n".join(failures)
    assert [p.exitcode for p in procs] == [0, 0]
    assert value in {100. + ROUNDS - 1, 200. + ROUNDS - 1}, value
    # a further save to the name still works and leaves nothing behind
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.save_sharded(path, _state(7.0), {"global_step": 7})
    assert _published_value(path) == 7.0
    assert not _files._hidden_siblings(path, "tmp") and not _files._hidden_siblings(path, "old")
