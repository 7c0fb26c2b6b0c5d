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


def _step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad()


def _assert_params_match_reference(res, *, rtol: float, atol: float) -> None:
    """``res``: per-rank ``(local_pieces(model), reference parameters)`` of one world."""
    got, want = assemble([r[0] for r in res]), res[0][1]
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=n)


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
    from lightning_vescale.testing import CopyCommCounter

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
        _step(model(micro(x, rank, world), micro(y, rank, world)), opt)
        _step(ref(x, y), ref_opt)
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


def test_parity_still_holds_after_an_extra_forward(worlds):
    """The reshard at the root's pre-forward costs nothing in a normal loop: same parameters."""
    res = worlds(2).run(_extra_forward_body)
    _assert_params_match_reference(res, rtol=1e-4, atol=1e-5)


class LoRALinear(nn.Module):
    """A frozen base weight plus a small trainable low-rank update."""

    def __init__(self, d: int = 64, r: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.down = nn.Linear(d, r, bias=False)
        self.up = nn.Linear(r, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _lora_body():
    from lightning_vescale.fsdp import dbuffers, fully_shard
    from lightning_vescale.testing import CopyCommCounter

    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(), LoRALinear())
    ref = copy.deepcopy(model)
    fully_shard(model)  # one group with frozen and trainable parameters
    bufs = dbuffers(model)
    frozen = [b for b in bufs if all(not p.requires_grad for p in _params_of(model, b))]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    grad_allocated = []
    for b in frozen:  # record whether the frozen buffer ever allocates a gradient
        b.materialize_grad = lambda b=b: grad_allocated.append(b.name)
    with CopyCommCounter() as c:
        model(x).square().mean().backward()
    ref(x).square().mean().backward()
    rs_elems = c.by_op.get("c10d._reduce_scatter_base_", 0)
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    for b in frozen:
        del b.materialize_grad
    # unfreeze the base later: its (frozen-built) buffer starts carrying gradients, exactly
    model.zero_grad()
    ref.zero_grad()
    for m in (model, ref):
        m[0].base.requires_grad_(True)
    model(x).square().mean().backward()
    ref(x).square().mean().backward()
    got2 = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    want2 = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    return len(bufs), len(frozen), grad_allocated, rs_elems, got, want, got2, want2


def _params_of(model: nn.Module, buf) -> list[torch.Tensor]:
    from lightning_vescale.fsdp import param_fqn_map

    return [mp.sharded for _, mp in param_fqn_map(model).values() if mp.buffer is buf]


def test_frozen_parameters_get_no_gradient_buffer_and_no_reduce(worlds):
    for n_bufs, n_frozen, allocated, rs_ops, got, want, got2, want2 in worlds(2).run(_lora_body):
        assert (n_bufs, n_frozen) == (2, 1)
        assert allocated == []  # the frozen buffer never materialised a gradient
        assert rs_ops == 1  # one reduce-scatter: the trainable buffer only
        assert set(got) == set(want) and all("base" not in n for n in got)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
        assert set(got2) == set(want2) and "0.base.weight" in got2
        for n in want2:
            torch.testing.assert_close(got2[n], want2[n], rtol=1e-5, atol=1e-6, msg=n)


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
        _step(model(xs[rank], rank % 2), opt)
        _step(sum(ref(x, r % 2) for r, x in enumerate(xs)).div(world), ref_opt)
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("opt_kind", ["adamw", "muon"])
def test_parameters_used_on_some_ranks_only_match_single_process(worlds, world_size, opt_kind):
    res = worlds(world_size).run(_routed_body, opt_kind, 3)
    _assert_params_match_reference(res, rtol=1e-4, atol=1e-5)


class _Checkpointed(nn.Module):
    """Activation checkpointing around a whole sharded block (``checkpoint_wrapper`` style)."""

    def __init__(self, inner: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=self.use_reentrant)


def _checkpointed_blocks_body(use_reentrant: bool):
    from lightning_vescale.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = build("gpt"), build("gpt")
    for i, blk in enumerate(model.blocks):
        fully_shard(blk)
        model.blocks[i] = _Checkpointed(blk, use_reentrant)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches("gpt", 2, 2 * world):
        _step(model(micro(x, rank, world), micro(y, rank, world)), opt)
        _step(ref(x, y), ref_opt)
    got = {n.replace(".inner.", "."): p for n, p in local_pieces(model).items()}
    return got, {n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_around_sharded_blocks(worlds, use_reentrant):
    res = worlds(2).run(_checkpointed_blocks_body, use_reentrant)
    _assert_params_match_reference(res, rtol=1e-4, atol=1e-5)


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


class _SharedTwice(nn.Module):
    """One sharded block applied twice per forward (weight sharing, ALBERT-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.shared = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.shared(self.inp(x)))))
        return self.out(h).square().mean()


def _shared_twice_body():
    from lightning_vescale.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _SharedTwice()
    ref = copy.deepcopy(model)
    fully_shard(model.shared)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        xs = torch.randn(2 * world, 6, generator=g)
        _step(model(xs[2 * rank:2 * rank + 2]), opt)
        _step(ref(xs), ref_opt)
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


def test_a_block_applied_twice_per_forward(worlds):
    res = worlds(2).run(_shared_twice_body)
    _assert_params_match_reference(res, rtol=1e-4, atol=1e-6)
