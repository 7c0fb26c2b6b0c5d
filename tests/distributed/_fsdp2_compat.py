"""Run one case on torch's FSDP2 (the reference side) and on ``lightning_vescale.fsdp``.

The FSDP2-compatibility tests (``test_fsdp2_compat_*.py``) port behaviours of torch's own FSDP2
tests: each case is a function taking ``impl`` (``"torch"`` or ``"ours"``) that uses
:func:`fully_shard_of` and torch's policy classes (``lightning_vescale`` accepts them), so the
very same code runs on both and a failure on our side is known to be ours. Functions here run on
ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

IMPLS = ("torch", "ours")


def fully_shard_of(impl: str) -> Callable[..., nn.Module]:
    """``fully_shard`` of ``impl``: torch's FSDP2 or ours."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        return fully_shard
    from lightning_vescale.fsdp import fully_shard
    return fully_shard


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of a (possibly DTensor) value, detached (``None`` stays ``None``)."""
    if t is None:
        return None
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().clone()


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


def micro(x: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = x.shape[0] // world
    return x[rank * b:(rank + 1) * b]


class MLP(nn.Module):
    """Three linears; ``shard_mlp`` makes each its own group, then the root."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8) -> None:
        super().__init__()
        self.l1 = nn.Linear(d_in, d_hidden)
        self.l2 = nn.Linear(d_hidden, d_hidden)
        self.l3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def shard_mlp(impl: str, model: MLP, **kw) -> MLP:
    fs = fully_shard_of(impl)
    for m in (model.l1, model.l2, model.l3):
        fs(m, **kw)
    fs(model, **kw)
    return model


def train_pair(model: nn.Module, ref: nn.Module, steps: int, make_x: Callable, loss_fn: Callable,
               lr: float = 0.1) -> tuple[dict, dict]:
    """``steps`` SGD steps of the sharded ``model`` (this rank's micro-batch) and of the dense
    ``ref`` (the global batch); returns both models' full parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for s in range(steps):
        x = make_x(s)
        loss_fn(model, micro(x)).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return full_params(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


def copy_model(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class TiedLM(nn.Module):
    """Embedding, a block, an output head tied to the embedding (``head.weight is emb.weight``)."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(ids)))


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1))


def expect_raises(fn: Callable[[], object], exc: type, *words: str) -> str | None:
    """``None`` if ``fn()`` raises ``exc`` whose message has every word, else what happened."""
    try:
        fn()
    except exc as e:
        missing = [w for w in words if w not in str(e)]
        return None if not missing else f"{exc.__name__} lacks {missing}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    return f"expected {exc.__name__}, nothing raised"
