"""Optimizer in backward: ``register_post_accumulate_grad_hook`` on sharded parameters (issue 34).

Ported from torch's ``test/distributed/_composable/fsdp/test_fully_shard_autograd.py``
(``TestFullyShardPostAccGradHookMultiThread.test_post_acc_grad_hook_runs``,
``TestFullyShardPostAccGradHookMultiProcess.test_post_acc_grad_hook_optim_parity``, with and
without CPU offload): each case runs on torch's FSDP2 (the reference side) and on ours. FSDP2
calls the hooks of a sharded parameter on its reduced sharded gradient from its post-reduce;
so do we (design note [fsdp-post-acc-grad-hooks]).
"""

from __future__ import annotations

import collections
import copy
import functools
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fsdp2_compat import IMPLS, MLP, fully_shard_of, micro, shard_mlp


def _hook_runs_body(impl: str) -> dict[str, int]:
    counts: dict[str, int] = collections.defaultdict(int)

    def hook(name: str, param: torch.Tensor) -> None:
        assert param.grad is not None, name  # the reduced sharded gradient is there
        counts[name] += 1

    torch.manual_seed(0)
    model = shard_mlp(impl, MLP(8, 16, 8))
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(functools.partial(hook, name))
    model(torch.randn(2, 8)).sum().backward()
    return dict(counts)


@pytest.mark.parametrize("impl", IMPLS)
def test_post_acc_grad_hook_runs(worlds, impl):
    """Upstream's ``test_post_acc_grad_hook_runs``: every parameter's hook once per backward
    (before the fix: 0 of 6 with ours)."""
    for counts in worlds(2).run(_hook_runs_body, impl):
        names = {f"{m}.{p}" for m in ("l1", "l2", "l3") for p in ("weight", "bias")}
        assert counts == {n: 1 for n in names}, (impl, counts)


def _optim_parity_body(impl: str, offload: bool, steps: int) -> list[str]:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        ModelArgs,
        Transformer,
    )

    fs = fully_shard_of(impl)
    policy = CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()
    torch.manual_seed(42)
    model_args = ModelArgs(dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    for module in itertools.chain(ref_model.layers, [ref_model]):
        fs(module, offload_policy=policy)
    optim_kwargs = {"lr": 1e-2, "foreach": False}
    ref_optim = torch.optim.AdamW(ref_model.parameters(), **optim_kwargs)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_optim, step_size=5)

    for module in itertools.chain(model.layers, [model]):
        fs(module, offload_policy=policy)
    param_to_optim, param_to_sched = {}, {}
    for param in model.parameters():
        param_to_optim[param] = torch.optim.AdamW([param], **optim_kwargs)
        param_to_sched[param] = torch.optim.lr_scheduler.StepLR(param_to_optim[param], 5)

    def optim_hook(param: nn.Parameter) -> None:
        param_to_optim[param].step()
        param_to_optim[param].zero_grad()
        param_to_sched[param].step()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(optim_hook)

    torch.manual_seed(42 + dist.get_rank())
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    bad = []
    for step in range(steps):
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        ref_sched.step()
        loss = model(inp).sum()
        loss.backward()
        if not torch.equal(ref_loss, loss):
            bad.append(f"step {step}: loss {loss.item()} != {ref_loss.item()}")
        for (name, ref_p), p in zip(ref_model.named_parameters(), model.parameters()):
            if not torch.equal(ref_p.to_local(), p.to_local()):
                bad.append(f"step {step}: {name}")
            if p.grad is not None:
                bad.append(f"step {step}: {name} kept a gradient after its hook's zero_grad")
    return bad


@pytest.mark.parametrize("offload", [False, True], ids=["device", "cpu_offload"])
@pytest.mark.parametrize("impl", IMPLS)
def test_post_acc_grad_hook_optim_parity(worlds, impl, offload):
    """Upstream's ``test_post_acc_grad_hook_optim_parity``: AdamW + StepLR per parameter from
    the hooks equals the usual step after backward, bit for bit, over 10 steps (before the fix
    ours never stepped: the parameters kept their initial values)."""
    for bad in worlds(2).run(_optim_parity_body, impl, offload, 10):
        assert not bad, (impl, bad[:5])


# -- beyond upstream: what only a sharded engine can get wrong ---------------------------------
class _Routed(nn.Module):
    """Two experts; ``expert`` says which one's output counts on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        y = self.inp(x)
        # every expert runs (the same collectives on every rank); only the routed one's output
        # reaches the loss, so only its parameters get a gradient on this rank
        outs = [e(y) for e in self.experts]
        return outs[expert]


def _routed_body() -> dict[str, int]:
    """Rank 0 routes to expert 0, the others to expert 1: each expert has a gradient on some
    rank, so it has one on every rank (as in one process over the global batch) and its hook
    runs everywhere. (Ours only: torch's FSDP2 skips the reduce-scatter of a group without a
    local gradient, so its ranks' collectives would not pair.)"""
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Routed()
    fully_shard(model.experts[0])
    fully_shard(model.experts[1])
    fully_shard(model)
    counts: dict[str, int] = collections.defaultdict(int)

    def hook(name: str, param: torch.Tensor) -> None:
        assert param.grad is not None, name
        counts[name] += 1

    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(functools.partial(hook, name))
    model(torch.randn(4, 8), 0 if dist.get_rank() == 0 else 1).sum().backward()
    return dict(counts)


def test_hooks_follow_the_global_gradient_set(worlds):
    """Every rank calls the hook of every parameter some rank computed a gradient for."""
    names = {f"{m}.{p}" for m in ("inp", "experts.0", "experts.1") for p in ("weight", "bias")}
    for counts in worlds(2).run(_routed_body):
        assert counts == {n: 1 for n in names}, counts


def _no_sync_body(impl: str) -> list[int]:
    torch.manual_seed(0)
    model = shard_mlp(impl, MLP(8, 16, 8))
    calls = [0]
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(0, calls[0] + 1))
    seen = []
    for i in range(3):
        model.set_requires_gradient_sync(i == 2)
        model(torch.randn(2, 8)).sum().backward()
        seen.append(calls[0])
    return seen


@pytest.mark.parametrize("impl", IMPLS)
def test_hooks_wait_for_the_synced_backward(worlds, impl):
    """Without gradient sync there is no reduced gradient: the hooks run at the synced
    backward only (FSDP2's behaviour)."""
    for seen in worlds(2).run(_no_sync_body, impl):
        assert seen == [0, 0, 6], (impl, seen)


def _split_batch_parity_body(world_batch: int, steps: int) -> list[str]:
    """Ours, SGD with momentum per parameter in the hooks vs one optimizer after backward,
    on split batches (the data-parallel average) at this world size."""
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    base = MLP(8, 16, 8)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    for m in models:
        shard_mlp("ours", m)
    normal, hooked = models
    opt = torch.optim.SGD(normal.parameters(), lr=0.1, momentum=0.9)
    per_param = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in hooked.parameters()}

    def step_hook(p: torch.Tensor) -> None:
        per_param[p].step()
        per_param[p].zero_grad()

    for p in hooked.parameters():
        p.register_post_accumulate_grad_hook(step_hook)
    assert fully_shard  # imported for the ranks' module cache only
    g = torch.Generator().manual_seed(1)
    bad = []
    for step in range(steps):
        x = torch.randn(world_batch, 8, generator=g)
        normal(micro(x)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        hooked(micro(x)).square().mean().backward()
        for (n, a), b in zip(normal.named_parameters(), hooked.parameters()):
            if not torch.equal(a.to_local(), b.to_local()):
                bad.append(f"step {step}: {n}")
    return bad


def test_optimizer_in_backward_equals_normal_training(worlds):
    """Parity at 3 ranks (uneven shards, split batches): optimizer in backward == normal
    training, bit for bit (SGD with momentum per parameter in the hooks)."""
    world = 3
    for bad in worlds(world).run(_split_batch_parity_body, 6 * world, 4):
        assert not bad, bad[:5]


def _async_body(offload: bool) -> list[str]:
    """The accelerator path on gloo: reduce-scatters left in flight and waited at the next
    group's (their hooks run then), the last one at the final callback."""
    from lightning_vescale.fsdp import CPUOffloadPolicy
    from lightning_vescale.fsdp._root import RootContext

    original = RootContext.reduce_async
    RootContext.reduce_async = staticmethod(lambda group: True)
    try:
        kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if offload else {}
        torch.manual_seed(0)
        base = MLP(8, 16, 8)
        normal, hooked = shard_mlp("ours", copy.deepcopy(base), **kw), shard_mlp(
            "ours", copy.deepcopy(base), **kw)
        opt = torch.optim.AdamW(normal.parameters(), lr=1e-2)
        per_param = {p: torch.optim.AdamW([p], lr=1e-2) for p in hooked.parameters()}
        order: list[int] = []

        def step_hook(p: torch.Tensor) -> None:
            order.append(id(p))
            per_param[p].step()
            per_param[p].zero_grad()

        for p in hooked.parameters():
            p.register_post_accumulate_grad_hook(step_hook)
        g = torch.Generator().manual_seed(1)
        bad = []
        for step in range(3):
            x = torch.randn(4 * dist.get_world_size(), 8, generator=g)
            normal(micro(x)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            order.clear()
            hooked(micro(x)).square().mean().backward()
            if len(order) != 6:
                bad.append(f"step {step}: {len(order)} hooks ran")
            for (n, a), b in zip(normal.named_parameters(), hooked.parameters()):
                if not torch.equal(a.to_local(), b.to_local()):
                    bad.append(f"step {step}: {n}")
        return bad
    finally:
        RootContext.reduce_async = original


@pytest.mark.parametrize("offload", [False, True], ids=["device", "cpu_offload"])
def test_hooks_after_asynchronous_reduce_scatters(worlds, offload):
    """With reduce-scatters in flight (the accelerator path), each group's hooks run after its
    reduce-scatter was waited: the same bits as stepping after backward."""
    for bad in worlds(2).run(_async_body, offload):
        assert not bad, bad[:5]
