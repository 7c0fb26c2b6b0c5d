"""The harness itself: results come back in rank order, errors and hangs fail fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import RankError, World, run_distributed


def _rank_and_sum(x: int) -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + x)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits on a dead peer: the harness must not wait for it


def _sleep_forever() -> None:
    time.sleep(3600)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_results_in_rank_order(worlds, n):
    out = worlds(n).run(_rank_and_sum, 10)
    expected_sum = float(sum(range(n)) + 10 * n)
    assert out == [(r, n, expected_sum) for r in range(n)]


def test_rank_error_is_raised_and_world_recovers(worlds):
    world = worlds(2)
    t0 = time.monotonic()
    with pytest.raises(RankError, match="boom on rank one"):
        world.run(_fail_on_rank_one)
    assert time.monotonic() - t0 < 30
    # The world re-forks on the next call.
    assert world.run(_rank_and_sum, 0) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_hang_becomes_timeout():
    with World(2) as world, pytest.raises(TimeoutError, match="did not answer"):
        world.run(_sleep_forever, timeout=2)


def test_run_distributed_one_shot():
    assert run_distributed(_rank_and_sum, 3, 1)[2] == (2, 3, 6.0)


def _mesh_coordinate() -> tuple:
    from lightning_vescale.mesh import init_mesh

    return tuple(init_mesh("cpu").get_coordinate())


def test_a_mesh_built_before_the_fork_is_not_reused_by_a_forked_rank(worlds):
    """A DeviceMesh keeps the coordinate of the rank that built it. ``init_mesh`` caches meshes;
    a forked child inherited the parent's cache and a rank 1 got rank 0's mesh (coordinate
    ``(0,)``), so full state dicts gathered to the wrong rank (an internal assertion in
    ``_gather_to_rank0``), depending on which test had built a mesh in the parent before."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_vescale.mesh import init_mesh

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        assert tuple(init_mesh("cpu").get_coordinate()) == (0,)  # cached in this process
    finally:
        dist.destroy_process_group()
    assert worlds(2).run(_mesh_coordinate) == [(0,), (1,)]
