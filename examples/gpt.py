"""A small, self-contained GPT and a character-level data set, for examples, tests and benchmarks.

Nothing here is specific to lightning_vescale: it is a plain ``nn.Module`` so every strategy
(single device, DDP, FSDP2, vescale_fsdp) trains exactly the same model. The data is a short
public-domain text embedded below, so runs need no download.

Contract:
* ``GPT(config)`` has ``tok_emb``, ``pos_emb``, ``blocks`` (an ``nn.ModuleList`` of
  :class:`Block`), ``ln_f`` and ``head``; with ``tie_weights=True`` ``head.weight is
  tok_emb.weight`` (a tied parameter, which sharding engines must handle).
* ``GPT.forward(idx)`` returns logits ``(B, T, vocab)``; ``forward(idx, targets)`` returns the
  mean cross-entropy loss (a scalar).
* ``make_batches(n, batch_size, block_size, seed)`` is deterministic for a given seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "CharDataset", "make_batches", "TEXT", "VOCAB"]

# Public domain (Shakespeare, Sonnet 18 and Hamlet's soliloquy), repeated in the data set.
TEXT = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die -- to sleep,
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to: 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep, perchance to dream -- ay, there's the rub:
For in that sleep of death what dreams may come,
When we have shuffled off this mortal coil,
Must give us pause.
"""

VOCAB = sorted(set(TEXT))


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    tie_weights: bool = True
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if self.vocab_size < len(VOCAB):
            raise ValueError(
                f"vocab_size={self.vocab_size} is smaller than the embedded text's "
                f"{len(VOCAB)} characters; use vocab_size >= {len(VOCAB)}"
            )


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        shape = (b, t, self.n_head, c // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block: the natural sharding unit."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or GPTConfig()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init (also used after meta-device construction + ``to_empty``)."""
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith("proj.weight"):
                    std = 0.02 / math.sqrt(2 * self.config.n_layer)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:  # LayerNorm weights
                nn.init.ones_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.config.block_size:
            raise ValueError(
                f"sequence length {t} exceeds block_size={self.config.block_size}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def encode(text: str = TEXT) -> torch.Tensor:
    """The text as a 1-D LongTensor of character ids (ids index :data:`VOCAB`)."""
    stoi = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([stoi[ch] for ch in text], dtype=torch.long)


class CharDataset(torch.utils.data.Dataset):
    """``length`` random windows of the embedded text, fixed by ``seed``: (x, y=x shifted by 1)."""

    def __init__(self, block_size: int = 32, length: int = 256, seed: int = 0) -> None:
        data = encode()
        if block_size + 1 > data.numel():
            raise ValueError(f"block_size={block_size} is longer than the text ({data.numel()})")
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, data.numel() - block_size - 1, (length,), generator=g)
        windows = torch.stack([data[s : s + block_size + 1] for s in starts.tolist()])
        self.x, self.y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_batches(num_batches: int, batch_size: int, block_size: int,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` deterministic ``(x, y)`` batches of shape ``(batch_size, block_size)``."""
    ds = CharDataset(block_size, num_batches * batch_size, seed)
    return [
        (ds.x[i * batch_size : (i + 1) * batch_size], ds.y[i * batch_size : (i + 1) * batch_size])
        for i in range(num_batches)
    ]
