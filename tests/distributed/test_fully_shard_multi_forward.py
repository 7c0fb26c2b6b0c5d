"""Several forwards before one backward (the DPO pattern), with nested groups and activation
checkpointing: a port of FSDP2's ``test_double_forward_with_nested_fsdp_and_checkpoint``
(torch ``test/distributed/_composable/fsdp/test_fully_shard_training.py``,
``TestFullyShard1DTrainingCompose``). Each case runs on torch's FSDP2 (the reference side) and
on ours, and both are compared with a single process. Design note [fsdp-multi-forward]."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_vescale._gloo_exchange import unfused
from tests.distributed._fsdp2_compat import IMPLS, full_grads, fully_shard_of

VOCAB, DIM = 32, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM)
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.tanh(self.wq(x)))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Upstream's ``TransformerBlock`` shape: a norm of its own plus two nested groups."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attention = Attention()
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.norm(x))
        return h + self.feed_forward(h)


class Transformer(nn.Module):
    """``checkpoint_activations``: ``torch.utils.checkpoint`` around each block (upstream's
    ``ModelArgs(checkpoint_activations=True)``, the ``"utils"`` case)."""

    def __init__(self, n_layers: int = 2, checkpoint_activations: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.out = nn.Linear(DIM, VOCAB)
        self.checkpoint_activations = checkpoint_activations

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.tok(tokens)
        for layer in self.layers:
            if self.checkpoint_activations:
                h = checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.out(h)


def _dpo_loss(model: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out1 = model(a)
    out2 = model(b)  # a second forward before any backward
    return (out1.sum() - out2.sum()).pow(2) / 1e4


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(42 + rank)
    return (torch.randint(0, VOCAB, (2, 6), generator=g),
            torch.randint(0, VOCAB, (2, 6), generator=g))


def _double_forward_body(impl: str, checkpoint_impl: str, reshard_after_forward: bool):
    from torch.distributed._composable import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model = Transformer(checkpoint_activations=checkpoint_impl == "utils")
    ref = copy.deepcopy(model)
    ref.checkpoint_activations = False
    if checkpoint_impl == "composable":
        for layer in model.layers:
            checkpoint(layer)
    fs = fully_shard_of(impl)
    for layer in model.layers:
        fs(layer.attention, reshard_after_forward=reshard_after_forward)
        fs(layer.feed_forward, reshard_after_forward=reshard_after_forward)
        fs(layer, reshard_after_forward=reshard_after_forward)
    fs(model, reshard_after_forward=reshard_after_forward)
    losses, grads = [], []
    for step in range(2):  # the second iteration follows the recorded orders (prefetch)
        loss = _dpo_loss(model, *_inputs(rank + 10 * step))
        loss.backward()
        losses.append(loss.detach())
        grads.append(full_grads(model))
        model.zero_grad()
    # The reference: every rank's loss on one process, gradients averaged over ranks.
    want_losses, want_grads = [], []
    for step in range(2):
        want = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        for r in range(world):
            ref.zero_grad()
            loss = _dpo_loss(ref, *_inputs(r + 10 * step))
            loss.backward()
            if r == rank:
                want_losses.append(loss.detach())
            for n, p in ref.named_parameters():
                want[n] += p.grad / world
        want_grads.append(want)
    return losses, grads, want_losses, want_grads


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("checkpoint_impl", ["composable", "utils", "none"])
@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_double_forward_with_nested_groups_and_checkpoint(worlds, impl, checkpoint_impl,
                                                          reshard_after_forward):
    res = worlds(2).run(_double_forward_body, impl, checkpoint_impl, reshard_after_forward)
    for losses, grads, want_losses, want_grads in res:
        for step in range(2):
            torch.testing.assert_close(losses[step], want_losses[step], rtol=1e-5, atol=1e-6)
            for n, w in want_grads[step].items():
                assert grads[step][n] is not None, f"{impl}: {n} has no gradient"
                # fp32, two ranks summed in another order than the reference: 1e-5
                torch.testing.assert_close(grads[step][n], w, rtol=1e-5, atol=1e-6,
                                           msg=f"{impl} step {step} {n}")


@unfused()  # on gloo a small model's blocks stay gathered into backward ([fsdp-gloo-fusion])
def _reshard_between_uses_body():
    """Ours: between the backward of the second forward and that of the first, a group is
    resharded (its gathered parameters freed), so two forwards do not keep every group gathered
    for the whole backward; the next use's pre-backward gathers it again."""
    from lightning_vescale.fsdp import fully_shard, get_state

    rank = dist.get_rank()
    torch.manual_seed(42)
    model = Transformer()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    group = get_state(model.layers[0]).group
    seen: list[bool] = []
    # a tensor hook on the first layer's input gradient of each forward: runs once that use's
    # backward passed the layer
    a, b = _inputs(rank)
    h1 = model(a)
    h2 = model(b)
    loss = (h1.sum() - h2.sum()).pow(2)
    gathers = []
    real_unshard = type(group).unshard

    def counting_unshard(self, async_op=False):
        if self is group and not self.is_unsharded:
            gathers.append(async_op)
        return real_unshard(self, async_op)

    type(group).unshard = counting_unshard
    try:
        loss.backward()
    finally:
        type(group).unshard = real_unshard
    seen.append(not group.is_unsharded)
    return len(gathers), seen


def test_group_is_resharded_between_its_uses(worlds):
    for n_gathers, seen in worlds(2).run(_reshard_between_uses_body):
        # one all-gather per use in backward (with reshard_after_forward: once per forward too)
        assert n_gathers == 2, n_gathers
        assert seen == [True]


def _dropped_forward_body(impl: str):
    """A forward with grad whose output is dropped (no backward), then forward + backward:
    the dropped use never completes, so the final callback completes the groups (ours)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(42)
    model = Transformer()
    ref = copy.deepcopy(model)
    fs = fully_shard_of(impl)
    for layer in model.layers:
        fs(layer.feed_forward)
        fs(layer)
    fs(model)
    grads = []
    for step in range(2):
        a, b = _inputs(rank + 10 * step)
        model(a).sum()  # dropped: e.g. a metric computed with grad on
        model(b).square().mean().backward()
        grads.append(full_grads(model))
        model.zero_grad()
    want = []
    for step in range(2):
        acc = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
        for r in range(world):
            ref.zero_grad()
            ref(_inputs(r + 10 * step)[1]).square().mean().backward()
            for n, p in ref.named_parameters():
                acc[n] += p.grad / world
        want.append(acc)
    return grads, want


@pytest.mark.parametrize("impl", IMPLS)
def test_a_dropped_forward_before_the_trained_one(worlds, impl):
    for grads, want in worlds(2).run(_dropped_forward_body, impl):
        for step in range(2):
            for n, w in want[step].items():
                torch.testing.assert_close(grads[step][n], w, rtol=1e-5, atol=1e-6,
                                           msg=f"{impl} step {step} {n}")
