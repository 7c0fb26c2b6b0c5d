"""A single-process reference for quantized communication (issue 25), and small models.

The reference never touches lightning_vescale: before each forward it replaces every quantized
parameter by ``fake_quant`` of it (blocks of ``B`` elements from the tensor's first element,
absmax scale per block: the engine's blocks, design note [quantized-all-gather]), computes each
rank's micro-batch gradient at those values, rounds it to the wire dtype if one is set, averages
over ranks in fp32 and applies it to the full-precision parameters (straight-through).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

QMAX = {"int8": 127.0, "fp8": 448.0}


def fake_quant(t: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """``t`` quantized and dequantized block by block, as the engine's all-gather does."""
    flat = t.detach().reshape(-1).float()
    n = flat.numel()
    x = torch.cat([flat, flat.new_zeros((-n) % block)]).view(-1, block)
    s = x.abs().amax(dim=1) / QMAX[fmt]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = x / safe[:, None]
    if fmt == "int8":
        codes = q.round().to(torch.int8)
        out = codes * s[:, None]
    else:
        out = q.to(torch.float8_e4m3fn).to(torch.float32) * s[:, None]
    return out.reshape(-1)[:n].view(t.shape).to(t.dtype)


def default_quantized(model: nn.Module, min_numel: int = 4096) -> set[str]:
    """The names ``CommPolicy``'s default rule quantizes."""
    return {n for n, p in model.named_parameters()
            if p.is_floating_point() and p.dim() >= 2 and p.numel() >= min_numel}


def reference_step(ref: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                   y: torch.Tensor, *, world: int, fmt: str | None, block: int,
                   quantized: set[str], wire: torch.dtype | None = None,
                   replicas: int = 1) -> float:
    """One step of the reference (see the module docstring); returns the mean loss.

    ``replicas > 1`` (HSDP, consecutive ranks form a shard group) with a ``wire`` dtype: each
    shard group's fp32 sum is rounded to ``wire`` once more before the replicas' fp32 sum, whose
    total is rounded to ``wire`` (the engine's replica all-reduce)."""
    names = [n for n, _ in ref.named_parameters()]
    params = dict(ref.named_parameters())
    used = {n: (fake_quant(p, fmt, block) if fmt and n in quantized else p.detach())
            for n, p in params.items()}
    grads = {n: torch.zeros_like(p) for n, p in params.items()}
    groups = [dict(grads) for _ in range(replicas)]
    b = x.shape[0] // world
    total = 0.0
    for r in range(world):
        grads = groups[r // (world // replicas)]
        leaf = {n: t.clone().requires_grad_() for n, t in used.items()}
        loss = functional_call(ref, leaf, (x[r * b:(r + 1) * b], y[r * b:(r + 1) * b]))
        gs = torch.autograd.grad(loss, [leaf[n] for n in names], allow_unused=True)
        for n, g in zip(names, gs):
            if g is not None:
                grads[n] = grads[n] + (g.to(wire).float() if wire is not None else g)
        total += loss.item()
    for n, p in params.items():
        if replicas > 1 and wire is not None:
            summed = sum(grp[n].to(wire).float() for grp in groups).to(wire).float()
        else:
            summed = sum(grp[n] for grp in groups)
        p.grad = summed / world
    opt.step()
    opt.zero_grad()
    return total / world


class Rows(nn.Module):
    """One ``(rows, cols)`` matrix and a bias: the hard shapes (96 rows over 5 ranks...)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(rows, cols) * 0.1)
        self.b = nn.Parameter(torch.randn(rows) * 0.1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.tanh(x @ self.w.t() + self.b), y)


def rows_batches(rows: int, cols: int, steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, cols, generator=g), torch.randn(batch, rows, generator=g) * 0.5)
            for _ in range(steps)]
