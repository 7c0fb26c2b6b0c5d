"""``benchmarks/_gpu_launch.py``: a GPU check run reports row by row and never outlives its time.

A first run on a new GPU is where a collective may hang; the device time is minutes. Rank 0
prints each verdict when it has it and keeps the rows so far on disk; a world past its deadline
is killed, and what it finished is still read back.
"""

from __future__ import annotations

import json
import time

import pytest

from benchmarks._gpu_launch import read_rows, row_reporter, spawn_within


def test_rank_0_prints_each_row_at_once_and_keeps_the_rows_so_far(tmp_path, capsys):
    report = row_reporter(str(tmp_path), rank=0, world=2)
    report({"check": "fp32 parity", "status": "PASS", "detail": "max rel 1e-7"})
    assert "PASS fp32 parity: max rel 1e-7" in capsys.readouterr().out
    report({"check": "hsdp", "status": "FAIL", "detail": "Traceback\n  boom"})
    assert "FAIL hsdp: Traceback boom" in capsys.readouterr().out
    assert [r["check"] for r in read_rows(tmp_path)["rows"]] == ["fp32 parity", "hsdp"]
    quiet = row_reporter(str(tmp_path / "other"), rank=1, world=2)
    quiet({"check": "x", "status": "PASS", "detail": ""})  # only rank 0 speaks and writes
    assert capsys.readouterr().out == "" and not (tmp_path / "other").exists()


def test_the_final_results_win_over_the_partial_rows(tmp_path):
    assert read_rows(tmp_path) == {"rows": [], "perf": []}  # nothing finished at all
    (tmp_path / "rank0.partial.json").write_text(json.dumps([{"check": "a"}]))
    (tmp_path / "rank0.json").write_text(json.dumps({"rows": [{"check": "b"}], "perf": [1]}))
    assert read_rows(tmp_path) == {"rows": [{"check": "b"}], "perf": [1]}


def _sleeps(rank: int, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.slow  # spawns fresh interpreters
def test_a_world_past_its_deadline_is_killed():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still running after 3 s"):
        spawn_within(2, _sleeps, (600.0,), seconds=3.0)
    assert time.monotonic() - start < 60
    spawn_within(1, _sleeps, (0.0,), seconds=60.0)  # one that finishes in time returns
