"""Parity of ``fully_shard`` training with single-process training (world sizes 1-4).

Each rank trains on its own micro-batch; the reference trains one model in the same process on
the concatenated global batch (mean loss). Losses must agree to 1e-5 relative and parameters
after the last step must be allclose. The reference never touches lightning_vescale code.

The helpers here (models, optimizers, gathering) are reused by the other fully_shard tests.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from examples.gpt import GPT, GPTConfig, make_batches


# ------------------------------------------------------------------------------------------------
# models and data
# ------------------------------------------------------------------------------------------------
class AwkwardMLP(nn.Module):
    """Prime dims, a layer with fewer rows than ranks, a 0-d parameter and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(7, 13)
        self.l2 = nn.Linear(13, 5)
        self.l3 = nn.Linear(5, 3)
        self.l4 = nn.Linear(3, 2)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("shift", torch.tensor([0.25, -0.5]))  # left alone (replicated)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.l1(x))
        h = F.gelu(self.l2(h))
        h = torch.tanh(self.l3(h))
        return F.mse_loss(self.l4(h) * self.scale + self.shift, y)


def build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(GPTConfig())
    if kind == "mlp":
        return AwkwardMLP()
    raise ValueError(kind)


def batches(kind: str, steps: int, global_batch: int, seed: int = 0):
    if kind == "gpt":
        return make_batches(steps, global_batch, 32, seed=seed)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, 7, generator=g), torch.randn(global_batch, 2, generator=g))
            for _ in range(steps)]


def shard(model: nn.Module, **kw) -> nn.Module:
    from lightning_vescale.fsdp import fully_shard

    if isinstance(model, GPT):
        for b in model.blocks:
            fully_shard(b, **kw)
    else:
        fully_shard(model.l1, **kw)
        fully_shard(model.l2, **kw)
    return fully_shard(model, **kw)


# ------------------------------------------------------------------------------------------------
# optimizers
# ------------------------------------------------------------------------------------------------
class LocalOpt:
    """A torch optimizer stepping on each DTensor parameter's local shard view.

    Element-wise optimizers (SGD, AdamW) give exactly the full-tensor update on every element,
    so this checks the engine without DTensor operator support.
    """

    def __init__(self, params, cls, **kw) -> None:
        self.params = list(params)
        with torch.no_grad():
            self.locals = [p.to_local() for p in self.params]
        self.opt = cls(self.locals, **kw)

    def step(self) -> None:
        for p, loc in zip(self.params, self.locals):
            loc.grad = None if p.grad is None else p.grad.to_local()
        self.opt.step()

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


OPTS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def make_opt(params, kind: str, dtensor: bool = False):
    cls, kw = OPTS[kind]
    if dtensor:  # RaggedShard DTensor ops are installed with lightning_vescale.placement
        return cls(params, **kw)
    return LocalOpt(params, cls, **kw)


# ------------------------------------------------------------------------------------------------
# helpers run on ranks
# ------------------------------------------------------------------------------------------------
def local_pieces(model: nn.Module) -> dict:
    """name -> (local 1-D copy, global shape): the parent concatenates ranks in order."""
    out = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            out[n] = (p.to_local().detach().clone(), tuple(p.shape))
    return out


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate every rank's local part (RaggedShard ranges are contiguous, rank-ordered)."""
    out = {}
    for n, (_, shape) in per_rank[0].items():
        out[n] = torch.cat([r[n][0].reshape(-1) for r in per_rank]).view(shape)
    return out


def micro(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = x.shape[0] // world
    return x[rank * b:(rank + 1) * b]


def train_pair(kind: str, opt_kind: str, steps: int, dtensor_opt: bool = False,
               per_rank_batch: int = 2, shard_kw: dict | None = None,
               clip: float | None = None):
    """Train fully_shard + reference; return (fsdp losses, ref losses, pieces, ref params).

    ``clip``: also clip gradients with ``torch.nn.utils.clip_grad_norm_`` on both sides
    (needs DTensor ops, i.e. ``dtensor_opt=True``).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(kind)
    ref = copy.deepcopy(model)
    shard(model, **(shard_kw or {}))
    opt = make_opt(model.parameters(), opt_kind, dtensor_opt)
    ref_opt = OPTS[opt_kind][0](ref.parameters(), **OPTS[opt_kind][1])
    losses, ref_losses = [], []
    for x, y in batches(kind, steps, per_rank_batch * world):
        loss = model(micro(x, rank, world), micro(y, rank, world))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
        rl = ref(x, y)
        rl.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(rl.item())
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return losses, ref_losses, local_pieces(model), ref_params


def _parity_body(combos, dtensor_opt):
    clip = 0.5 if dtensor_opt else None
    return [train_pair(k, o, steps=4, dtensor_opt=dtensor_opt, clip=clip) for k, o in combos]


def check_parity(results_per_rank, combos, loss_rtol=1e-5, rtol=1e-4, atol=1e-4):
    """Losses within ``loss_rtol`` (relative) and final parameters allclose.

    Parameter tolerance: AdamW divides by sqrt(v), so gradients that are mathematically zero
    but carry fp32 rounding noise (the attention key bias of a GPT, whose gradient cancels in
    the softmax) move by up to ~1e-5 differently on a different reduction order. ``atol=1e-4``
    is 1% of one lr=1e-2 step; a wrong gradient moves parameters by ~lr.
    """
    for i, combo in enumerate(combos):
        per_rank = [r[i] for r in results_per_rank]
        losses, ref_losses, _, ref_params = per_rank[0]
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        assert rel <= loss_rtol, (combo, losses, ref_losses, rel)
        got = assemble([r[2] for r in per_rank])
        assert set(got) == set(ref_params), combo
        for n, p in ref_params.items():
            torch.testing.assert_close(got[n], p, rtol=rtol, atol=atol,
                                       msg=lambda m, n=n: f"{combo} {n}: {m}")


COMBOS = [("gpt", "adamw"), ("gpt", "sgd"), ("mlp", "adamw"), ("mlp", "sgd")]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_fp32_local_optimizer(worlds, world_size):
    results = worlds(world_size).run(_parity_body, COMBOS, False)
    check_parity(results, COMBOS)


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_fp32_torch_optimizer_on_dtensors(worlds, world_size):
    """Real torch.optim.AdamW/SGD and clip_grad_norm_ stepping the RaggedShard DTensors."""
    results = worlds(world_size).run(_parity_body, COMBOS, True)
    check_parity(results, COMBOS)
