"""A sharding group that runs on some ranks only: with the opt-in collective check every rank
raises at once, naming the group's module and the ranks that skipped it (design note
[fsdp-collective-check]), instead of exchanging mismatched buffers and waiting for the gloo
timeout. The world has a 5 s process-group timeout: a hang would fail the test in seconds."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_vescale.fsdp import fully_shard
from lightning_vescale.fsdp._collective_check import ENV
from tests.harness import World


class Net(nn.Module):
    """Three same-sized blocks; block 1 runs on rank 0 only (a data-dependent branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        if dist.get_rank() == 0:
            x = self.blocks[1](x)
        return self.blocks[2](x)


def _skipped_group(check: bool) -> str:
    if check:
        os.environ[ENV] = "1"
    else:
        os.environ.pop(ENV, None)
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    t0 = time.monotonic()
    try:
        model(torch.randn(4, 8)).sum().backward()
    except RuntimeError as e:
        return f"{time.monotonic() - t0:.1f}s {e}"
    finally:
        os.environ.pop(ENV, None)
    return "no error"


def test_a_group_skipped_on_one_rank_is_named_at_once():
    with World(2, pg_timeout_s=5.0, run_timeout_s=60.0) as world:
        out = world.run(_skipped_group, True)
    for msg in out:
        seconds = float(msg.split("s ", 1)[0])
        assert seconds < 4.0, msg  # before the 5 s gloo timeout: the check raised, not gloo
        assert "Ranks [1] skipped 'blocks.1', which ranks [0] ran" in msg, msg
        assert "rank 0: all-gather of 'blocks.1'" in msg and \
            "rank 1: all-gather of 'blocks.2'" in msg, msg


@pytest.mark.parametrize("check", [False])
def test_without_the_check_the_ranks_go_on_with_mismatched_buffers(check):
    """What the check is for: unchecked, the same-sized all-gathers pair up wrongly and the
    ranks fail (or hang) later without naming the group."""
    with World(2, pg_timeout_s=5.0, run_timeout_s=60.0) as world:
        try:
            out = world.run(_skipped_group, check, timeout=30.0)
        except Exception as e:  # noqa: BLE001 - a rank died or hung: what we expect here
            out = [str(e)]
    assert not any("blocks.1" in msg for msg in out), out
