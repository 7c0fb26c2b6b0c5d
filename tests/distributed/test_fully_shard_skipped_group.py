"""A sharding group that runs on some ranks only: with the opt-in collective check every rank
raises at once, naming the groups' modules and the ranks at each (design note
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
from lightning_vescale.fsdp._collective_check import ENV, _divergence_message
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


class ExpertFirst(nn.Module):
    """``expert`` is registered after ``a`` but called before it, on rank 0 only: the group
    indices (registration order) are not the order the groups run in."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.expert = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 0:
            x = self.expert(x)
        return self.a(x)


def _skipped_group(check: bool, net: str = "blocks") -> str:
    if check:
        os.environ[ENV] = "1"
    else:
        os.environ.pop(ENV, None)
    torch.manual_seed(0)
    model = Net() if net == "blocks" else ExpertFirst()
    for block in (model.blocks if net == "blocks" else [model.a, model.expert]):
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
    for msg in out:  # our check's message, not gloo's 5 s timeout (no duration asserted)
        assert "rank 0: all-gather of 'blocks.1'" in msg and \
            "rank 1: all-gather of 'blocks.2'" in msg, msg
        assert "One of 'blocks.1' and 'blocks.2' runs on some ranks only" in msg, msg
        assert "ranks [0] at 'blocks.1', ranks [1] at 'blocks.2'" in msg, msg


def test_a_group_run_before_one_registered_earlier_is_not_blamed_on_the_wrong_ranks():
    """The issue's case: ``expert`` on rank 0 only, called before ``a`` (registered first). The
    check used to take the lowest index as the group some ranks skipped and said "Ranks [0]
    skipped 'a', which ranks [1] ran": the wrong group and the wrong ranks."""
    with World(2, pg_timeout_s=5.0, run_timeout_s=60.0) as world:
        out = world.run(_skipped_group, True, "expert_first")
    for msg in out:
        assert "skipped 'a'" not in msg, msg
        assert "rank 0: all-gather of 'expert'" in msg and "rank 1: all-gather of 'a'" in msg
        assert "One of 'expert' and 'a' runs on some ranks only" in msg, msg
        assert "ranks [0] at 'expert', ranks [1] at 'a'" in msg, msg


def test_ranks_that_finished_backward_are_named_as_going_without_the_group():
    names = {0: "a", 1: "expert"}.__getitem__
    ag, rs, flag = 0, 1, 2  # KINDS' indices
    msg = _divergence_message([(rs, 1, 1), (flag, -1, 0), (rs, 1, 1)], [0, 1, 2], names)
    assert "Ranks [1] finished their backward (at the gradient-flag all-reduce) without " \
        "'expert', which ranks [0, 2] are about to run" in msg, msg
    msg = _divergence_message([(ag, 0, 1), (rs, 0, 0)], [0, 1], names)
    assert "The ranks run 'a' a different number of times (ranks [0] at its all-gather of " \
        "'a' (its collective #1), ranks [1] at its reduce-scatter of 'a'" in msg, msg


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
