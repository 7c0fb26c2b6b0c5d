"""``contiguous_runs`` / ``compact_`` / ``run_view`` (layer 0 helpers of the flat step)."""

from __future__ import annotations

import pytest
import torch

from lightning_vescale.placement import compact_, contiguous_runs, run_view


def test_runs_follow_memory_in_every_list():
    buf = torch.arange(20.0)
    a = [buf[0:3], buf[3:7], buf[8:10], buf[10:10], buf[10:12]]  # a gap after item 1
    other = torch.zeros(20)
    b = [other[0:3], other[3:7], other[7:9], other[9:9], other[9:11]]  # no gap
    assert contiguous_runs(a) == [(0, 2), (2, 3), (4, 5)]  # the empty item ends a run
    assert contiguous_runs(a, b) == [(0, 2), (2, 3), (4, 5)]
    assert contiguous_runs(b) == [(0, 3), (4, 5)]
    v = run_view(a, 0, 2)
    assert v.data_ptr() == buf.data_ptr() and v.numel() == 7
    v.add_(100)
    assert torch.equal(buf[:7], torch.arange(7.0) + 100) and buf[7] == 7  # the gap untouched


def test_separate_storages_never_join():
    x, y = torch.zeros(4), torch.zeros(4)
    assert contiguous_runs([x, y]) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="different lengths"):
        contiguous_runs([x], [x, y])


def test_compact_moves_sole_owners_and_keeps_objects():
    ts = [torch.full((n,), float(n)) for n in (3, 1, 5)]
    ids = [id(t) for t in ts]
    assert compact_(ts)
    assert [id(t) for t in ts] == ids
    assert contiguous_runs(ts) == [(0, 3)]
    assert [t.tolist() for t in ts] == [[3.0] * 3, [1.0], [5.0] * 5]
    assert not compact_(ts)  # already sharing one storage: not sole owners any more


def test_compact_refuses_shared_storage():
    base = torch.zeros(8)
    views = [base[:4], torch.zeros(4)]
    assert not compact_(views)  # a view of another tensor: moving it would detach it from base
    t = torch.zeros(3)
    alias = t.view(3)  # noqa: F841 - a second tensor on the storage
    assert not compact_([t, torch.zeros(2)])
