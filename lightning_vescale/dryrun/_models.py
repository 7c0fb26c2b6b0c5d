"""Models for the dry run: a runnable transformer from a planner preset, a transformers config,
or a user's module; and where to wrap them (the blocks, then the root).

Design note [dryrun-models]
---------------------------
The planner presets are shape lists (``planner/presets.py``); a training step needs a module.
:class:`PresetTransformer` builds one whose parameter names and shapes are exactly
``transformer_groups(config)`` (the tests check it), with a forward that uses every parameter:
pre-norm blocks, GQA attention through ``scaled_dot_product_attention`` (no rotary embedding:
it has no parameters and its activations are a few tensors of the query's size), MLA
(DeepSeek-V3's low-rank query/key-value projections) and SwiGLU MLPs, MoE layers with a router,
routed experts (one module each, or stacked ``(E, ...)`` tensors) and shared experts.

Routing under FakeTensors cannot depend on values (the sizes of per-expert token lists are
data). The MoE forward therefore routes with *balanced capacity*: every expert receives
``ceil(tokens * top_k / experts)`` token slots, filled by a static-shape permutation of the
top-k choices. This is the activation footprint of a perfectly balanced router (what
load-balancing losses aim for); an imbalanced step holds more in its busiest expert.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vescale.planner.presets import TransformerConfig

__all__ = ["PresetTransformer", "blocks_of", "build_hf_model", "build_user_model", "top_k_of"]


def top_k_of(c: TransformerConfig) -> int:
    """Experts per token: the presets' public configs (DeepSeek-V3 8, GPT-OSS 4)."""
    if not c.experts:
        return 0
    return 4 if c.stacked_experts and c.expert_bias else 8


class RMSNorm(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight)


class Linear(nn.Linear):
    """``nn.Linear`` without a bias unless asked (HF naming: ``.weight``/``.bias``)."""

    def __init__(self, i: int, o: int, bias: bool = False) -> None:
        super().__init__(i, o, bias=bias)


class MLP(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = Linear(h, f), Linear(h, f), Linear(f, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.c = c
        h = c.hidden
        if c.attention == "mla":
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            if c.q_lora_rank:
                self.q_a_proj = Linear(h, c.q_lora_rank)
                self.q_a_layernorm = RMSNorm(c.q_lora_rank)
                self.q_b_proj = Linear(c.q_lora_rank, c.heads * qk)
            else:
                self.q_proj = Linear(h, c.heads * qk)
            self.kv_a_proj_with_mqa = Linear(h, c.kv_lora_rank + c.qk_rope_head_dim)
            self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
            self.kv_b_proj = Linear(c.kv_lora_rank,
                                    c.heads * (c.qk_nope_head_dim + c.v_head_dim))
            self.o_proj = Linear(c.heads * c.v_head_dim, h)
            return
        hd = c.head_dim or h // c.heads
        kv = c.kv_heads or c.heads
        self.q_proj = Linear(h, c.heads * hd, c.attn_bias)
        self.k_proj = Linear(h, kv * hd, c.attn_bias)
        self.v_proj = Linear(h, kv * hd, c.attn_bias)
        self.o_proj = Linear(c.heads * hd, h, c.attn_bias)
        if c.attn_sinks:
            self.sinks = nn.Parameter(torch.zeros(c.heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, s, _ = x.shape
        if c.attention == "mla":
            qk = c.qk_nope_head_dim + c.qk_rope_head_dim
            q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if c.q_lora_rank
                 else self.q_proj(x)).view(b, s, c.heads, qk).transpose(1, 2)
            kv_a = self.kv_a_proj_with_mqa(x)
            latent, k_rope = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
            kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(
                b, s, c.heads, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
            k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
            k_rope = k_rope.view(b, 1, s, c.qk_rope_head_dim).expand(b, c.heads, s, -1)
            k = torch.cat([k_nope, k_rope], dim=-1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(b, s, c.heads * c.v_head_dim))
        hd = c.head_dim or c.hidden // c.heads
        kv = c.kv_heads or c.heads
        q = self.q_proj(x).view(b, s, c.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, kv, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, kv, hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != c.heads)
        if c.attn_sinks:  # a per-head gate standing in for the sink logit (same parameter use)
            o = o * torch.sigmoid(self.sinks).view(1, -1, 1, 1)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, c.heads * hd))


class Experts(nn.Module):
    """GPT-OSS's stacked experts: ``gate_up_proj (E, h, 2f)``, ``down_proj (E, f, h)``."""

    def __init__(self, c: TransformerConfig, f: int) -> None:
        super().__init__()
        e, h = c.experts, c.hidden
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(e, f, h))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        if c.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * f))
            self.down_proj_bias = nn.Parameter(torch.zeros(e, h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (E, C, h)
        gu = torch.bmm(x, self.gate_up_proj)
        if hasattr(self, "gate_up_proj_bias"):
            gu = gu + self.gate_up_proj_bias.unsqueeze(1)
        g, u = gu.chunk(2, dim=-1)
        y = torch.bmm(F.silu(g) * u, self.down_proj)
        if hasattr(self, "down_proj_bias"):
            y = y + self.down_proj_bias.unsqueeze(1)
        return y


class Router(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(c.experts, c.hidden))
        nn.init.normal_(self.weight, std=0.02)
        if c.router_bias:
            self.bias = nn.Parameter(torch.zeros(c.experts))
        if c.router_score_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(c.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight, getattr(self, "bias", None))
        if hasattr(self, "e_score_correction_bias"):
            logits = logits + self.e_score_correction_bias
        return logits


class MoE(nn.Module):
    """Router, routed experts with balanced capacity (design note [dryrun-models]), shared."""

    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.c = c
        f = c.moe_ffn or c.ffn
        self.gate = Router(c)
        if c.stacked_experts:
            self.experts: nn.Module = Experts(c, f)
        else:
            self.experts = nn.ModuleList(MLP(c.hidden, f) for _ in range(c.experts))
        if c.shared_experts:
            self.shared_experts = MLP(c.hidden, f * c.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        t, k, e = b * s, top_k_of(c), c.experts
        weights, chosen = torch.softmax(self.gate(tokens).float(), dim=-1).topk(k, dim=-1)
        cap = math.ceil(t * k / e)
        order = chosen.reshape(-1).argsort()  # slots grouped by expert (static shape t*k)
        slots = torch.cat([order, order[: e * cap - t * k]]) if e * cap > t * k else order
        token_of = slots // k
        routed = tokens.index_select(0, token_of).view(e, cap, h)
        if isinstance(self.experts, nn.ModuleList):
            out = torch.cat([ex(routed[i]) for i, ex in enumerate(self.experts)])
        else:
            out = self.experts(routed).reshape(e * cap, h)
        w = weights.reshape(-1).index_select(0, slots).to(out.dtype).unsqueeze(-1)
        y = torch.zeros_like(tokens).index_add(0, token_of, out * w)
        if c.shared_experts:
            y = y + self.shared_experts(tokens)
        return y.view(b, s, h)


class Block(nn.Module):
    def __init__(self, c: TransformerConfig, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden)
        self.mlp: nn.Module = MoE(c) if moe else MLP(c.hidden, c.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _Decoder(nn.Module):
    def __init__(self, c: TransformerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(
            Block(c, bool(c.experts) and i >= c.first_dense_layers) for i in range(c.layers))
        self.norm = RMSNorm(c.hidden)


class PresetTransformer(nn.Module):
    """A runnable decoder with exactly the parameters of ``transformer_groups(config)``."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Decoder(config)
        if not config.tied_embeddings:
            self.lm_head = Linear(config.hidden, config.vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        x = self.model.norm(x)
        head = self.lm_head.weight if hasattr(self, "lm_head") else self.model.embed_tokens.weight
        return F.linear(x, head)


def blocks_of(module: nn.Module) -> list[nn.Module]:
    """The modules to ``fully_shard`` before the root: the children of the ``ModuleList``
    holding the most parameters (the planner's block grouping), or none."""
    best, count = None, 0
    for sub in module.modules():
        if isinstance(sub, nn.ModuleList):
            n = sum(p.numel() for p in sub.parameters())
            if n > count:
                best, count = sub, n
    return list(best) if best is not None else []


def build_hf_model(config: Any) -> nn.Module:
    """A transformers causal LM from a config object, a ``config.json`` path/dir or a model id
    whose config is in the local cache (nothing is downloaded)."""
    import transformers

    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        config = transformers.AutoConfig.from_pretrained(str(config), local_files_only=True)
    return transformers.AutoModelForCausalLM.from_config(config)


def build_user_model(path: str, init_args: dict[str, Any] | None = None) -> nn.Module:
    """``package.module:Class`` called with ``init_args`` (``configure_model()`` run when
    present), as the planner's ``--model`` does. A LightningModule without a forward of its
    own is run through its ``model`` submodule."""
    from lightning_vescale.planner.cli import _instantiate

    if ":" not in path:
        raise ValueError(f"model must look like 'package.module:ClassName', got {path!r}")
    importlib.import_module(path.split(":", 1)[0])
    module = _instantiate(path, dict(init_args or {}))
    if type(module).forward is nn.Module.forward or _is_lightning_forward(module):
        inner = getattr(module, "model", None)  # the usual configure_model() layout
        if not isinstance(inner, nn.Module):
            raise ValueError(f"model {path!r}: {type(module).__name__} defines no forward and "
                             "has no .model submodule to run; give a module whose forward "
                             "takes token ids")
        return inner
    return module


def _is_lightning_forward(module: nn.Module) -> bool:
    """A LightningModule that does not override ``forward`` (Lightning's raises)."""
    for cls in type(module).__mro__:
        if "forward" in vars(cls):
            return cls.__module__.startswith(("lightning.", "pytorch_lightning."))
    return False
