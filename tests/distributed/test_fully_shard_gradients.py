"""Gradient semantics: what the sharded ``.grad``s hold after backward, as in single-process
training.

* gradient accumulation with sync off (no reduce-scatter until the synced backward);
* gradients kept from an earlier step (no ``zero_grad``) survive a reduce-scatter of a buffer in
  which other parameters got new gradients;
* a second backward through a retained graph is reduced too;
* parameters used on some ranks only (data-dependent routing) get the global gradient, and
  ``grad=None`` where no rank used them;
* ``backward(create_graph=True)`` raises instead of silently dropping the gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fully_shard_helpers import (
    OPTS,
    assemble,
    assert_params_match_reference,
    batches,
    build,
    local_pieces,
    make_opt,
    micro,
    shard,
    train_step,
)


# -- gradient accumulation without sync -------------------------------------------------------
def _accum_body(micro_steps):
    from lightning_vescale.testing import CopyCommCounter

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    ref = copy.deepcopy(model)
    shard(model)
    opt = make_opt(model.parameters(), "sgd")
    ref_opt = OPTS["sgd"][0](ref.parameters(), **OPTS["sgd"][1])
    data = batches("gpt", 2 * micro_steps, 2 * world)
    no_sync_comms = []
    for step in range(2):
        chunk = data[step * micro_steps:(step + 1) * micro_steps]
        for i, (x, y) in enumerate(chunk):
            last = i == micro_steps - 1
            model.set_requires_gradient_sync(last)
            loss = model(micro(x, rank, world), micro(y, rank, world)) / micro_steps
            if last:
                loss.backward()
            else:
                with CopyCommCounter() as c:
                    loss.backward()
                # no reduce-scatter (gloo-native, or on gloo an all-to-all: [dbuffer-collectives])
                no_sync_comms.append(c.by_op.get("c10d._reduce_scatter_base_", 0)
                                     + c.by_op.get("c10d.alltoall_base_", 0))
            (ref(x, y) / micro_steps).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}, \
        no_sync_comms


@pytest.mark.parametrize("world_size", [2, 3])
def test_grad_accumulation_without_sync(worlds, world_size):
    res = worlds(world_size).run(_accum_body, 3)
    got, ref, no_sync = assemble([r[0] for r in res]), res[0][1], res[0][2]
    assert no_sync == [0, 0, 0, 0]  # no reduce-scatter while sync is off
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-5, msg=n)


# -- gradients kept from an earlier step -------------------------------------------------------


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


# -- a second backward through a retained graph ------------------------------------------------


def _two_backwards_body():
    """Two losses from one forward, backpropagated separately through the retained graph."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = build("gpt"), build("gpt")
    shard(model)
    x, y = batches("gpt", 1, 2 * world)[0]
    first = model(micro(x, rank, world), micro(y, rank, world))
    first.backward(retain_graph=True)
    (0.5 * first).backward()
    ref_first = ref(x, y)
    ref_first.backward(retain_graph=True)
    (0.5 * ref_first).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return got, {n: p.grad.clone() for n, p in ref.named_parameters()}


def test_second_backward_through_a_retained_graph_is_reduced(worlds):
    for got, want in worlds(2).run(_two_backwards_body):
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6, msg=n)


# -- parameters used on some ranks only --------------------------------------------------------


class RoutedBlock(nn.Module):
    """A trunk and three experts; ``route`` picks the expert (data-dependent, per rank)."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.trunk = nn.Linear(d, d)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(3))

    def forward(self, x: torch.Tensor, route: int) -> torch.Tensor:
        return x + self.experts[route](torch.tanh(self.trunk(x)))


class Routed(nn.Module):
    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(RoutedBlock(d) for _ in range(3))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, route: int) -> torch.Tensor:
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h, route)
        return self.out(h).square().mean()


def _routed_body(opt_kind: str, steps: int):
    from lightning_vescale.fsdp import fully_shard
    from lightning_vescale.optim import Muon

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Routed()
    ref = copy.deepcopy(model)
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)

    def make(params):
        if opt_kind == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        return Muon(params, lr=2e-2, adamw_lr=1e-2)

    opt, ref_opt = make(model.named_parameters()), make(ref.named_parameters())
    if opt_kind == "adamw":
        opt, ref_opt = make(model.parameters()), make(ref.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        xs = [torch.randn(4, 5, generator=g) for _ in range(world)]
        # Rank r routes to expert r % 2: on 3 ranks expert 0 is used by ranks 0 and 2 only;
        # expert 2 is used by no rank (its parameters must keep grad=None and stay untouched).
        train_step(model(xs[rank], rank % 2), opt)
        train_step(sum(ref(x, r % 2) for r, x in enumerate(xs)).div(world), ref_opt)
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_kind", ["adamw", "muon"])
def test_parameters_used_on_some_ranks_only_match_single_process(worlds, world_size, opt_kind):
    res = worlds(world_size).run(_routed_body, opt_kind, 3)
    assert_params_match_reference(res, rtol=1e-4, atol=1e-5)


# -- higher-order gradients --------------------------------------------------------------------


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
