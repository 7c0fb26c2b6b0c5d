"""``save_safetensors`` publishes a save as one unit (issue 34, design note [hf-publish]).

Before: the shards were renamed onto fixed names one by one, so a save killed after 2 of 4
renames left shards 1-2 new and 3-4 old, and two saves into one directory at once (the first
publishing slowly) both returned success and left shards of both under one index; the default
``load_safetensors``, ``pretrained_weights=`` and ``safetensors.load_file`` over the index loaded
the mix. Here a forked child is killed (SIGKILL) right after each of its file-system changes in
turn (the audit hook of ``test_checkpoint_publish_kill``), for every step until a save
completes, over the three transitions (several shards -> several, one file -> several, several
-> one file); and two writers save into one directory at once while the parent reads. Every read
must be the complete old save or the complete new one (or a load error naming the mix), for our
loader and for a reader that does what ``transformers`` does (``model.safetensors`` first, else
the index's shards through ``safetensors.load_file``); the next save cleans up what the killed
one left.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("safetensors")

from safetensors.torch import load_file  # noqa: E402

from lightning_vescale.checkpoint import load_safetensors, save_safetensors  # noqa: E402
from lightning_vescale.checkpoint._errors import CheckpointLoadError  # noqa: E402
from lightning_vescale.checkpoint._hf_publish import LOCK_NAME  # noqa: E402
from tests.unit.test_checkpoint_publish_kill import kill_after_changes  # noqa: E402

SHARDED, SINGLE = 1200, "1MB"  # max_shard_size: 4 files of one 16x16 fp32 weight, or one file


def _model(value: float) -> nn.Module:
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4)])
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _value(tensors: dict[str, torch.Tensor]) -> float:
    """The one value every element of every tensor has; fails on a mix."""
    assert sorted(tensors) == [f"{i}.weight" for i in range(4)], sorted(tensors)
    values = {float(v) for t in tensors.values() for v in t.unique()}
    assert len(values) == 1, f"a mix of saves was loaded: {sorted(values)}"
    return values.pop()


def _ours(directory: Path) -> float | str:
    """What ``load_safetensors`` (default: no CRC check) reads, or "mix-error"."""
    model = _model(0.0)
    try:
        load_safetensors(model, directory)
    except CheckpointLoadError as err:
        assert "mixes files of" in str(err), err
        return "mix-error"
    return _value(model.state_dict())


def _as_transformers_reads(directory: Path) -> float:
    """``model.safetensors`` if there is one, else every shard the index names (as
    ``from_pretrained`` picks its files), read by the safetensors library itself."""
    if (directory / "model.safetensors").is_file():
        return _value(load_file(directory / "model.safetensors"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(directory / name))
    return _value(tensors)


def _published(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} - {LOCK_NAME, "config.json"}


def _save(directory: Path, value: float, size) -> None:
    save_safetensors(_model(value), directory, max_shard_size=size)


@pytest.mark.parametrize("old_size,new_size", [(SHARDED, SHARDED), (SINGLE, SHARDED),
                                               (SHARDED, SINGLE)],
                         ids=["shards-to-shards", "one-file-to-shards", "shards-to-one-file"])
def test_sigkill_at_every_step_leaves_one_whole_save(tmp_path, old_size, new_size):
    seen: set = set()
    for k in range(1, 100):
        directory = tmp_path / f"k{k}"
        _save(directory, 1.0, old_size)
        (directory / "config.json").write_text("{}")  # the user's files are kept
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                kill_after_changes(directory, k)
                _save(directory, 2.0, new_size)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        ours, theirs = _ours(directory), _as_transformers_reads(directory)
        assert ours == theirs, (k, ours, theirs, sorted(os.listdir(directory)))
        seen.add(ours)
        if not killed:
            assert ours == 2.0
            load_safetensors(_model(0.0), directory, verify=True)  # the manifest is the new one
        # the next save succeeds and removes what the killed one left (its pid is gone)
        _save(directory, 3.0, SHARDED)
        assert _ours(directory) == _as_transformers_reads(directory) == 3.0
        load_safetensors(_model(0.0), directory, verify=True)
        names = _published(directory)
        assert not [n for n in names if n.startswith(".") and n != ".integrity.json"], names
        assert len([n for n in names if n.endswith(".safetensors")]) == 4, names
        assert (directory / "config.json").read_text() == "{}"
        if not killed:
            break
    else:
        pytest.fail("the save never completed")
    assert k > 4, k  # the hook did count the save's steps
    assert seen == {1.0, 2.0}, seen  # kills before and after the commit; never a mix


def test_a_killed_save_leaves_no_temporaries_forever(tmp_path):
    """Issue 34: each killed save left a full-size ``.model-*.safetensors.tmp-<token>`` set that
    nothing removed. Three kills while writing, then one save: none is left."""
    directory = tmp_path / "hf"
    _save(directory, 1.0, SHARDED)
    for _ in range(3):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: killed after creating its temporaries
            try:
                kill_after_changes(directory, 6)
                _save(directory, 2.0, SHARDED)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    assert len([n for n in os.listdir(directory) if ".tmp-" in n]) >= 3
    # temporaries of the earlier naming record no owner: removed once older than a day only
    old, fresh = (directory / f".model-0000{i}-of-00004.safetensors.tmp-43f42f4{i}"
                  for i in (1, 2))
    for p in (old, fresh):
        p.write_bytes(b"\0" * 64)
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    _save(directory, 3.0, SHARDED)
    assert [n for n in os.listdir(directory) if ".tmp-" in n] == [fresh.name]
    assert _ours(directory) == 3.0


ROUNDS = 6
SLOW_RENAME_S = 0.03


def _writer(directory: str, base: float, slow: bool, report: str) -> None:
    code = 0
    try:
        if slow:  # this writer publishes slowly: each rename into the directory waits first
            def hook(event: str, args: tuple) -> None:
                if event == "os.rename" and str(args[1]).startswith(directory):
                    time.sleep(SLOW_RENAME_S)
            sys.addaudithook(hook)
        for i in range(ROUNDS):
            _save(Path(directory), base + i, SHARDED)
    except BaseException:  # noqa: BLE001 - reported to the parent through the file
        Path(report).write_text(traceback.format_exc())
        code = 1
    finally:
        os._exit(code)


def test_two_writers_at_once_leave_one_whole_save(tmp_path):
    directory = tmp_path / "hf"
    _save(directory, 0.0, SHARDED)
    ctx = mp.get_context("fork")
    reports = [tmp_path / "a.err", tmp_path / "b.err"]
    procs = [ctx.Process(target=_writer, args=(str(directory), base, slow, str(report)))
             for base, slow, report in zip((100.0, 200.0), (True, False), reports)]
    for p in procs:
        p.start()
    reads: set = set()
    while any(p.is_alive() for p in procs):  # read while both write: never a silent mix
        try:
            reads.add(_ours(directory))
        except (FileNotFoundError, CheckpointLoadError):
            pass  # a shard removed between reading the index and opening it: an error, fine
    for p in procs:
        p.join(timeout=120)
    failures = [r.read_text() for r in reports if r.exists()]
    assert not failures, "\n".join(failures)
    assert [p.exitcode for p in procs] == [0, 0]
    final = _ours(directory)
    assert final == _as_transformers_reads(directory)
    assert final in {100.0 + ROUNDS - 1, 200.0 + ROUNDS - 1}, final
    load_safetensors(_model(0.0), directory, verify=True)
    names = _published(directory)
    assert len([n for n in names if n.endswith(".safetensors")]) == 4, names
    assert not [n for n in names if ".tmp-" in n], names
    assert "mix-error" not in reads, reads


def test_a_mix_of_two_saves_is_named_on_load(tmp_path):
    """A shard of another save copied over one of this save's (same name, same size: what the
    old fixed names allowed) is refused by the default load, naming both saves."""
    a, b = tmp_path / "a", tmp_path / "b"
    _save(a, 1.0, SHARDED)
    _save(b, 2.0, SHARDED)
    shards_a = json.loads((a / "model.safetensors.index.json").read_text())["weight_map"]
    shards_b = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"]
    (a / shards_a["3.weight"]).write_bytes((b / shards_b["3.weight"]).read_bytes())
    (a / ".integrity.json").unlink()  # the size would match anyway; the CRC is not checked
    with pytest.raises(CheckpointLoadError, match=r"mixes files of 2 different saves.*"
                       r"model-[0-9a-f]+-00004-of-00004\.safetensors: save [0-9a-f]+"):
        load_safetensors(_model(0.0), a)
