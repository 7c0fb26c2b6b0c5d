"""Shared fixtures. ``worlds`` hands out forked gloo worlds (see :mod:`tests.harness`)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import World

# 2 cores on CI: one intra-op thread per process keeps forked ranks from oversubscribing.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


class Worlds:
    """Lazily created worlds, one per world size, shared by the tests of one module."""

    def __init__(self) -> None:
        self._worlds: dict[int, World] = {}

    def __call__(self, world_size: int) -> World:
        if world_size not in self._worlds:
            self._worlds[world_size] = World(world_size)
        return self._worlds[world_size]

    def close(self) -> None:
        for w in self._worlds.values():
            w.close()
        self._worlds.clear()


@pytest.fixture(scope="module")
def worlds():
    """``worlds(n).run(fn, ...)`` runs ``fn`` on ``n`` gloo ranks (forked once per module)."""
    ws = Worlds()
    yield ws
    ws.close()
