"""Models, data, optimizers and comparisons shared by the ``fully_shard`` tests.

The references are plain single-process runs that never touch lightning_vescale code: each
rank trains on its own micro-batch (:func:`micro`), the reference on the concatenated global
batch (mean loss). Functions here run on ranks unless said otherwise.
"""

from __future__ import annotations

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


def train_step(loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    loss.backward()
    opt.step()
    opt.zero_grad()


def train_against_reference(model, ref, opt, ref_opt, kind: str, steps: int,
                            clip: float | None = None, per_rank_batch: int = 2):
    """``steps`` steps of the sharded ``model`` (each rank its micro-batch of
    ``per_rank_batch``) and of the plain ``ref`` (the global batch); optionally clipping both.
    Returns the global-mean losses, the reference losses and (with ``clip``) both sides'
    gradient norms."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, ref_losses, norms, ref_norms = [], [], [], []
    for x, y in batches(kind, steps, per_rank_batch * world):
        loss = model(micro(x, rank, world), micro(y, rank, world))
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(g.item() / world)
        rl = ref(x, y)
        rl.backward()
        if clip is not None:
            ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(rl.item())
    return losses, ref_losses, norms, ref_norms


# ------------------------------------------------------------------------------------------------
# gathering and comparing
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


def global_mean(loss: torch.Tensor) -> float:
    g = loss.detach().float().clone()
    dist.all_reduce(g)
    return g.item() / dist.get_world_size()


def assert_params_match_reference(res, *, rtol: float, atol: float) -> None:
    """``res``: per-rank ``(local_pieces(model), reference parameters)`` of one world."""
    got, want = assemble([r[0] for r in res]), res[0][1]
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=n)
