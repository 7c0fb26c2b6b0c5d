"""A LLaMA-style model (RMSNorm, rotary attention with grouped KV heads, SwiGLU) for real runs.

    # 8 GPUs x 4 nodes, LLaMA-3-8B shapes (run on every node; see the config's header)
    torchrun --nnodes 4 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER \\
        --master-port 29500 examples/llama.py fit --config examples/configs/llama_8gpu_multinode.yaml
    # the same code, tiny, on this machine's CPU
    python examples/llama.py fit --config examples/configs/llama_8gpu_multinode.yaml \\
        --trainer.accelerator=cpu --trainer.devices=2 --trainer.num_nodes=1 \\
        --trainer.precision=32-true --trainer.max_steps=4 --model.dim=64 --model.n_layers=2 \\
        --model.n_heads=4 --model.n_kv_heads=2 --model.ffn_dim=128 --model.vocab_size=256 \\
        --data.vocab_size=256 --data.seq_len=32

    # FSDP + tensor parallelism, 2 nodes x 8 GPUs: TP 8 inside each node, FSDP across the nodes
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER \\
        --master-port 29500 examples/llama.py fit --config examples/configs/tp_llama_2x8gpu.yaml

The tensor-parallel size is the strategy's ``tensor_parallel_size`` (config key
``trainer.strategy.init_args.tensor_parallel_size``; on the command line
``--trainer.strategy.init_args.tensor_parallel_size=8``): ``configure_model`` then applies
the TP plan of :func:`parallelize_llama` on ``self.device_mesh["tensor_parallel"]`` and the
strategy shards on the data-parallel dim (see docs/guides/tensor-parallel.md).

Without TP the model is built in ``configure_model`` on the meta device: no rank ever holds the
whole model. The strategy plans the sharding on meta, allocates only each rank's shard and
initialises it with ``reset_parameters()`` (the same values as a full initialisation with that
seed). The optimizer is created in ``configure_optimizers`` (after sharding), which is why the
config has no LightningCLI ``optimizer:`` section: LightningCLI builds that optimizer when it
parses the command line, before ``configure_model`` has created any parameter.

Data: ``TokenDataModule(path=...)`` reads a flat file of token ids (``numpy.memmap``, e.g. what a
tokenizer script wrote; ``dtype`` ``uint16`` or ``uint32``); without a path it makes random tokens,
which is enough to measure speed and memory.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

try:
    import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp")
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_vescale  # noqa: F401
from lightning_vescale.optim import AdamW8bit


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}, and "
                             f"n_heads by n_kv_heads={self.n_kv_heads}")


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``(B, H, T, D)``, computed on the fly (no buffers)."""
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.c, self.head_dim = c, c.dim // c.n_heads
        self.wq = nn.Linear(c.dim, c.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * self.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank computes its own heads only
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = _rope(q, self.c.rope_theta), _rope(k, self.c.rope_theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.c.n_kv_heads != self.c.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One block: the sharding unit (``sharding_units: [TransformerBlock]``)."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(TransformerBlock(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


class LlamaModule(pl.LightningModule):
    """Next-token prediction with :class:`Llama`; built on meta in ``configure_model``."""

    def __init__(self, vocab_size: int = 128256, dim: int = 4096, n_layers: int = 32,
                 n_heads: int = 32, n_kv_heads: int = 8, ffn_dim: int = 14336,
                 rope_theta: float = 500000.0, lr: float = 3e-4, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.95),
                 optimizer: Literal["adamw8bit", "adamw"] = "adamw8bit") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = LlamaConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers,
                                  n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim,
                                  rope_theta=rope_theta)
        self.model: Optional[Llama] = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):  # the strategy allocates and initialises the shards only
            self.model = Llama(self.config)
        tp_mesh = tensor_parallel_mesh(self.device_mesh)
        if tp_mesh is not None:
            # FSDP + TP (the strategy's tensor_parallel_size): the TP plan first, on the tp dim
            # (on meta too), then the strategy shards on the data-parallel dim
            parallelize_llama(self.model, tp_mesh)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        cls = AdamW8bit if hp.optimizer == "adamw8bit" else torch.optim.AdamW
        return cls(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay, betas=hp.betas)


def tensor_parallel_mesh(mesh: object) -> object:
    """The ``"tensor_parallel"`` dim of the strategy's mesh when it has one of size > 1
    (``tensor_parallel_size=``, design note [strategy-tp-mesh]); else ``None``."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tensor_parallel" not in names or mesh["tensor_parallel"].size() == 1:
        return None
    return mesh["tensor_parallel"]


def parallelize_llama(model: Llama, tp_mesh: object) -> Llama:
    """Megatron-style TP of every block: attention ``wq/wk/wv`` and MLP ``w1/w3`` colwise,
    ``wo`` and ``w2`` rowwise (torch's plan; the heads split over the tp ranks, so ``n_kv_heads``
    must be a multiple of the tp size). Embedding, norms and output stay whole on the tp dim."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    if model.config.n_kv_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide n_kv_heads="
                         f"{model.config.n_kv_heads} (each rank computes whole heads).")
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel()}
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
    return model


class TokenDataModule(pl.LightningDataModule):
    """Windows of ``seq_len + 1`` tokens from a flat token file, or random tokens."""

    def __init__(self, path: Optional[str] = None, dtype: Literal["uint16", "uint32"] = "uint32",
                 seq_len: int = 8192, batch_size: int = 1, vocab_size: int = 128256,
                 num_samples: int = 100_000, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        hp = self.hparams
        return torch.utils.data.DataLoader(_Tokens(hp.path, hp.dtype, hp.seq_len, hp.vocab_size,
                                                   hp.num_samples, hp.seed),
                                           batch_size=hp.batch_size, shuffle=True, num_workers=0)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, path: Optional[str], dtype: str, seq_len: int, vocab_size: int,
                 num_samples: int, seed: int) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.data = None
        if path is not None:
            import numpy as np

            self.data = np.memmap(path, dtype=dtype, mode="r")
            num_samples = min(num_samples, (len(self.data) - 1) // seq_len)
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.data is None:  # random tokens, fixed by (seed, i)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            return torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=g)
        start = i * self.seq_len
        return torch.from_numpy(self.data[start:start + self.seq_len + 1].astype("int64"))


def num_params(c: LlamaConfig) -> int:
    """Parameters of ``Llama(c)`` (no allocation)."""
    head = c.dim // c.n_heads
    attn = c.dim * c.n_heads * head * 2 + c.dim * c.n_kv_heads * head * 2
    block = attn + 3 * c.dim * c.ffn_dim + 2 * c.dim
    return 2 * c.vocab_size * c.dim + c.n_layers * block + c.dim


def main(args: Optional[list[str]] = None, run: bool = True):  # noqa: ANN201
    from lightning.pytorch.cli import LightningCLI

    # default_root_dir: Lightning's logs (and checkpoints without a dirpath) go under ./out/,
    # as every example's
    return LightningCLI(LlamaModule, TokenDataModule, args=args, run=run,
                        save_config_callback=None, trainer_defaults={"default_root_dir": "out"})


if __name__ == "__main__":
    main()
