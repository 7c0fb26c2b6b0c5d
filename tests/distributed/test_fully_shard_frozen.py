"""Frozen and partially frozen parameters: frozen parameters get no gradient, a group's frozen
parameters get a DBuffer of their own that never allocates gradients and is never
reduce-scattered, unfreezing later works; inference (``no_grad`` + ``eval``) leaves nothing
unsharded."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vescale._gloo_exchange import unfused
from tests.distributed._fully_shard_helpers import (
    OPTS,
    assemble,
    batches,
    build,
    local_pieces,
    make_opt,
    micro,
    shard,
)


# -- frozen parameters, inference, reshard_after_forward=False ---------------------------------
def _frozen_body(reshard_after_forward):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    for p in (model.pos_emb.weight, model.blocks[0].ln_1.weight, model.blocks[1].mlp.fc.bias):
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    shard(model, reshard_after_forward=reshard_after_forward)
    opt = make_opt([p for p in model.parameters() if p.requires_grad], "adamw")
    ref_opt = OPTS["adamw"][0]([p for p in ref.parameters() if p.requires_grad],
                               **OPTS["adamw"][1])
    for x, y in batches("gpt", 3, 2 * world):
        model(micro(x, rank, world), micro(y, rank, world)).backward()
        frozen_grads = [n for n, p in model.named_parameters()
                        if not p.requires_grad and p.grad is not None]
        opt.step()
        opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # inference: no_grad + eval leaves every parameter sharded and nothing unsharded alive
    from lightning_vescale.fsdp import memory_bytes

    model.eval()
    ref.eval()
    x, _ = batches("gpt", 1, 2 * world, seed=5)[0]
    with torch.no_grad():
        logits = model(x)
        ref_logits = ref(x)
    at_rest = all(isinstance(p, DTensor) for p in model.parameters())
    mem = memory_bytes(model)
    return (local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()},
            frozen_grads, logits, ref_logits, at_rest, mem)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_frozen_params_and_inference(worlds, reshard_after_forward):
    res = worlds(2).run(_frozen_body, reshard_after_forward)
    got, ref = assemble([r[0] for r in res]), res[0][1]
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-4, msg=n)
    for _, _, frozen_grads, logits, ref_logits, at_rest, mem in res:
        assert frozen_grads == []
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert at_rest
        assert mem["param_unsharded"] == 0 and mem["grad_unsharded"] == 0


# -- LoRA: frozen base, trainable low-rank update, in one group --------------------------------


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


@unfused()  # counts reduce-scatters by kind (design note [gloo-fused-exchange])
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
    # a reduce-scatter is gloo-native or, on gloo, an all-to-all (design note
    # [dbuffer-collectives]); either counts
    rs_elems = c.by_op.get("c10d._reduce_scatter_base_", 0) + c.by_op.get("c10d.alltoall_base_", 0)
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
