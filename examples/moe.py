"""A small mixture-of-experts GPT with stacked expert weights, trained with ``vescale_fsdp``.

The MLP of each block is a top-k routed MoE in the style of DeepSeek-V3 and GPT-OSS, scaled down:
a linear router (softmax over experts, top-k, the k weights renormalised), ``n_expert`` routed
SwiGLU experts stored *stacked* as two ``(E, out, in)`` tensors (``experts.w_in``: gate and up
projections, ``(E, 2 * expert_ffn, n_embd)``; ``experts.w_out``: ``(E, n_embd, expert_ffn)``),
optional shared experts (DeepSeek-V3: one) and optional dense first layers, and the Switch/GShard
load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: fraction of routed slots that chose expert
``e``, ``P_e``: its mean router probability) added to the language-model loss with
``aux_loss_coef``.

Each expert's tokens are gathered and multiplied by its own matrices (``index_add_`` back), so
experts that get no token get zero gradients, as in real MoE kernels.

Sharding: :func:`expert_granularity` keeps every expert's matrix whole on one rank
(``"matrix"`` granularity) and aligns other large tensors to ``AdamW8bit``'s 256-element
blocks; :class:`MoEModule` applies it in ``configure_model`` (one ``fully_shard`` per block on
the strategy's mesh; the strategy adds the root). Muon then orthogonalises each expert on the
rank holding it, without communication, and ``AdamW8bit`` blocks never straddle two experts
whose size is a multiple of 256.

    # CPU, 2 processes, a few steps:
    python examples/moe.py fit --trainer.accelerator=cpu --trainer.devices=2 \\
        --trainer.max_steps=5 --model.optimizer=muon
    # GPUs (8 per node x N nodes): examples/configs/moe_8gpu.yaml
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

try:
    import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp")
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_vescale  # noqa: F401

from lightning_vescale.planner import default_granularity, resolve_granularity

try:
    from examples.gpt import VOCAB, CausalSelfAttention
    from examples.train_gpt import CharDataModule
except ImportError:  # pragma: no cover - run as a script from its own directory
    from gpt import VOCAB, CausalSelfAttention
    from train_gpt import CharDataModule

__all__ = ["MoEConfig", "Experts", "MoE", "MoEGPT", "MoEModule", "expert_granularity"]


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shapes of :class:`MoEGPT` (defaults: a CPU toy; GPT-OSS/DeepSeek-V3 proportions: many
    narrow experts, ``expert_ffn < n_embd``, top-k of them per token)."""

    vocab_size: int = 65
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    n_expert: int = 8
    top_k: int = 2
    expert_ffn: int = 16
    n_shared_expert: int = 1
    first_dense_layers: int = 0
    aux_loss_coef: float = 0.01
    bias: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(f"top_k must be in [1, n_expert={self.n_expert}], got {self.top_k}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.vocab_size < len(VOCAB):
            raise ValueError(f"vocab_size={self.vocab_size} < the text's {len(VOCAB)} characters")


class Experts(nn.Module):
    """``E`` SwiGLU experts as two stacked ``(E, out, in)`` weights."""

    def __init__(self, n_expert: int, dim: int, ffn: int) -> None:
        super().__init__()
        self.ffn = ffn
        self.w_in = nn.Parameter(torch.empty(n_expert, 2 * ffn, dim))
        self.w_out = nn.Parameter(torch.empty(n_expert, dim, ffn))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x``: ``(N, dim)`` tokens; ``idx``/``weight``: ``(N, k)`` chosen experts and their
        weights. Returns ``sum_k weight * expert_k(x)``."""
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            token, slot = (idx == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            h = x[token] @ self.w_in[e].t()
            gate, up = h.split(self.ffn, dim=-1)
            y = (F.silu(gate) * up) @ self.w_out[e].t()
            out = out.index_add(0, token, y * weight[token, slot, None])
        return out


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MoE(nn.Module):
    """Top-k routed experts plus shared experts; ``aux_loss`` holds the last load-balancing loss."""

    def __init__(self, c: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.n_expert = c.top_k, c.n_expert
        self.router = nn.Linear(c.n_embd, c.n_expert, bias=False)
        self.experts = Experts(c.n_expert, c.n_embd, c.expert_ffn)
        self.shared = (SwiGLU(c.n_embd, c.expert_ffn * c.n_shared_expert)
                       if c.n_shared_expert else None)
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        probs = self.router(flat).float().softmax(dim=-1)
        weight, idx = probs.topk(self.top_k, dim=-1)
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        chosen = F.one_hot(idx, self.n_expert).sum(1).float()  # (N, E): 1 where routed
        f = chosen.mean(0) / self.top_k
        self.aux_loss = self.n_expert * (f * probs.mean(0)).sum()
        out = self.experts(flat, idx, weight)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(b, t, d)


class MoEBlock(nn.Module):
    """A pre-norm block whose MLP is a :class:`MoE` (or dense for the first layers)."""

    def __init__(self, c: MoEConfig, dense: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)  # reads n_head, n_embd, bias
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = SwiGLU(c.n_embd, 4 * c.n_embd) if dense else MoE(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MoEGPT(nn.Module):
    """``forward(idx)``: logits; ``forward(idx, targets)``: cross-entropy plus
    ``aux_loss_coef`` times the mean load-balancing loss of the MoE layers."""

    def __init__(self, config: MoEConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or MoEConfig()
        self.tok_emb = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos_emb = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(MoEBlock(c, dense=i < c.first_dense_layers)
                                    for i in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style: normal(0.02) for matrices and stacks, zeros for biases, ones for norms."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith(
                    ("proj.weight", "w_out", "down.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        aux = [b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoE)]
        if aux and self.config.aux_loss_coef:
            loss = loss + self.config.aux_loss_coef * torch.stack(aux).mean()
        return loss


def expert_granularity(name: str, param: torch.Tensor) -> int:
    """``fully_shard``'s granularity callable for MoE: each expert of a stacked (3-D) weight
    whole on one rank (``"matrix"``, rounded up to a multiple of 256 when the stack is large,
    so AdamW8bit's blocks stay inside a rank), every other tensor the strategies' default."""
    shape = tuple(param.shape)
    if len(shape) == 3:
        big = math.prod(shape) >= 4096
        return resolve_granularity("matrix", shape, multiple_of=256 if big else None)
    return default_granularity(shape)


class MoEModule(pl.LightningModule):
    """:class:`MoEGPT` for the Trainer. ``optimizer``: ``"adamw"``, ``"adamw8bit"`` or
    ``"muon"`` (built after sharding, on the sharded parameters). ``matrix_experts``: shard
    with :func:`expert_granularity` (one ``fully_shard`` per block in ``configure_model``)."""

    def __init__(self, n_layer: int = 2, n_head: int = 2, n_embd: int = 32, block_size: int = 32,
                 n_expert: int = 8, top_k: int = 2, expert_ffn: int = 16,
                 n_shared_expert: int = 1, first_dense_layers: int = 0,
                 aux_loss_coef: float = 0.01, vocab_size: int = 65, optimizer: str = "adamw",
                 lr: float = 3e-3, weight_decay: float = 0.1, matrix_experts: bool = True) -> None:
        super().__init__()
        if optimizer not in ("adamw", "adamw8bit", "muon"):
            raise ValueError(f"optimizer must be 'adamw', 'adamw8bit' or 'muon', got {optimizer!r}")
        self.save_hyperparameters()
        self.model = MoEGPT(MoEConfig(
            vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
            n_embd=n_embd, n_expert=n_expert, top_k=top_k, expert_ffn=expert_ffn,
            n_shared_expert=n_shared_expert, first_dense_layers=first_dense_layers,
            aux_loss_coef=aux_loss_coef))

    def configure_model(self) -> None:
        mesh = getattr(self, "device_mesh", None)
        if not self.hparams.matrix_experts or mesh is None:
            return
        from lightning_vescale.fsdp import fully_shard

        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, granularity=expert_granularity)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        loss = self.model(x, y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        if hp.optimizer == "muon":
            from lightning_vescale.optim import Muon

            return Muon(self.named_parameters(), lr=0.02, weight_decay=hp.weight_decay,
                        adamw_lr=hp.lr, adamw_betas=(0.9, 0.95))
        if hp.optimizer == "adamw8bit":
            from lightning_vescale.optim import AdamW8bit

            return AdamW8bit(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)


def main(args: Optional[list[str]] = None, run: bool = True) -> Any:
    from lightning.pytorch.cli import LightningCLI

    # default_root_dir: Lightning's logs and checkpoints go under ./out/, as every example's
    return LightningCLI(MoEModule, CharDataModule, args=args, run=run,
                        save_config_callback=None,
                        trainer_defaults={"strategy": "vescale_fsdp", "default_root_dir": "out"})


if __name__ == "__main__":
    main()
