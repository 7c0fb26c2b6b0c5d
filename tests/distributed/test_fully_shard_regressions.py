"""Regressions found in review of the fully_shard schedule (each fails without its fix).

* gradients kept from an earlier step survive a reduce-scatter of a buffer in which other
  parameters got new gradients (no zero_grad between two synced backwards);
* a forward whose output never goes through backward leaves nothing stale: the next forward,
  ``state_dict()`` and ``load_state_dict`` see the current shards;
* ``backward(create_graph=True)`` raises instead of silently dropping the gradients;
* backward prefetch never re-gathers a group that already finished its backward;
* argument types of the runtime setters and of a granularity callable are checked.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tests.distributed.test_fully_shard_parity import (
    assemble,
    batches,
    build,
    local_pieces,
    micro,
    shard,
)


class TwoHeads(nn.Module):
    """``head`` selects which head a step uses: the other one gets no gradient that step."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Linear(6, 3)
        self.c = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(x).square().mean()


def _kept_grads_body():
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = TwoHeads()
    ref = copy.deepcopy(model)
    fully_shard(model)  # one group: b and c share one buffer
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    # Two synced backwards, no zero_grad in between. The second one's new gradients (c.*) all
    # belong to parameters without a kept gradient, while b.* keeps step 1's.
    for head in ("b", "c"):
        model(x, head).backward()
        ref(x, head).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    return got, want


def test_gradients_kept_from_an_earlier_step_survive_the_next_reduce(worlds):
    for got, want in worlds(2).run(_kept_grads_body):
        assert set(got) == set(want)
        for n in want:  # b.* holds step 1's gradient, c.* step 2's
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def _forward_without_backward_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    other = build("gpt", seed=5)
    shard(model)
    x, y = batches("gpt", 1, 2 * world)[0]
    model(micro(x, rank, world), micro(y, rank, world))  # grad enabled, never backpropagated
    sd = model.state_dict()
    sd_sharded = all(isinstance(v, DTensor) for k, v in sd.items() if not k.endswith("attn.bias"))
    model.load_state_dict(other.state_dict())  # must land in the shards the next forward uses
    with torch.no_grad():
        got = model(x, y).item()
        want = other(x, y).item()
    return sd_sharded, got, want


def test_forward_without_backward_leaves_nothing_stale(worlds):
    for sd_sharded, got, want in worlds(2).run(_forward_without_backward_body):
        assert sd_sharded
        assert got == pytest.approx(want, rel=1e-5)


def _create_graph_body():
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4))
    loss = model(torch.randn(2, 4)).square().sum()
    try:
        loss.backward(create_graph=True)
    except NotImplementedError as e:
        return str(e)
    return None


def test_create_graph_raises_instead_of_losing_gradients(worlds):
    for msg in worlds(2).run(_create_graph_body):
        assert msg is not None and "create_graph=True" in msg


class InputRoot(nn.Module):
    """The root group owns only the input layer, so all its gradients arrive last."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inp(x))


def _allgathers_per_step_body(steps):
    from lightning_vescale.fsdp import fully_shard
    from lightning_vescale.fsdp._counting import CopyCommCounter

    torch.manual_seed(0)
    model = InputRoot()
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    x = torch.randn(4, 16)
    counts = []
    for _ in range(steps):
        with CopyCommCounter() as c:
            model(x).sum().backward()
        model.zero_grad()
        counts.append(c.by_op.get("c10d._allgather_base_", 0))
    return counts, len(model.blocks)


def test_backward_prefetch_skips_groups_already_done(worlds):
    for counts, n_blocks in worlds(2).run(_allgathers_per_step_body, 3):
        # forward: the root + every block; backward: every block again (the root stays
        # gathered). The root's gradients arrive at the very end of backward; their prefetch
        # must not re-gather a block that already finished its backward.
        assert counts == [1 + 2 * n_blocks] * 3, counts


def _bad_setter_args_body():
    from lightning_vescale.fsdp import fully_shard

    errors = []
    model = fully_shard(nn.Linear(4, 4))
    for call in (lambda: model.set_reshard_after_forward("no"),
                 lambda: model.set_prefetch(1),
                 lambda: fully_shard(nn.Linear(4, 4), granularity=lambda name, p: None)):
        try:
            call()
        except TypeError as e:
            errors.append(str(e))
    return errors


def test_setters_and_granularity_callable_check_types(worlds):
    for errors in worlds(1).run(_bad_setter_args_body):
        assert len(errors) == 3, errors
        assert "reshard_after_forward must be a bool, got 'no'" in errors[0]
        assert "must be a bool, got 1" in errors[1]
        assert "returned None for parameter 'weight'" in errors[2]


def _extra_forward_body():
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = build("gpt"), build("gpt")
    shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches("gpt", 2, 2 * world):
        with torch.no_grad():
            model(micro(x, rank, world), micro(y, rank, world))  # an evaluation in between
        model(micro(x, rank, world), micro(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


def test_parity_still_holds_after_an_extra_forward(worlds):
    """The reshard at the root's pre-forward costs nothing in a normal loop: same parameters."""
    res = worlds(2).run(_extra_forward_body)
    got, want = assemble([r[0] for r in res]), res[0][1]
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5, msg=n)
