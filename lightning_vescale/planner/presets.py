"""Transformer shape presets for the planner's command line and benchmarks (pure, no torch).

Numbers are the public configs (Hugging Face ``config.json``) of the named models; parameter
names and layouts follow the Hugging Face implementations (GPT-OSS stacks its experts into 3-D
tensors, DeepSeek-V3 keeps one module per expert). Only shapes are produced: nothing is
allocated, so a 671B-parameter model costs a few milliseconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = [
    "TransformerConfig", "PRESETS", "get_preset", "transformer_groups", "num_params", "with_overrides",
]

Shape = tuple[int, ...]
Group = list[tuple[str, Shape]]


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Shapes of a decoder-only transformer.

    ``attention="gqa"`` uses ``heads``, ``kv_heads`` and ``head_dim`` (default
    ``hidden // heads``); ``attention="mla"`` (DeepSeek multi-head latent attention) uses the
    ``q_lora_rank``/``kv_lora_rank``/``qk_nope_head_dim``/``qk_rope_head_dim``/``v_head_dim``.
    MoE layers (``experts > 0``, from layer ``first_dense_layers`` on) have a router, ``experts``
    routed experts of width ``moe_ffn`` and ``shared_experts`` shared ones; ``stacked_experts``
    stores the routed experts as 3-D tensors ``(experts, ...)`` instead of one module each.
    """

    hidden: int
    layers: int
    heads: int
    vocab: int
    ffn: int
    kv_heads: int | None = None
    head_dim: int | None = None
    attention: str = "gqa"
    attn_bias: bool = False
    attn_sinks: bool = False
    experts: int = 0
    moe_ffn: int | None = None
    shared_experts: int = 0
    first_dense_layers: int = 0
    stacked_experts: bool = False
    expert_bias: bool = False
    router_bias: bool = False
    router_score_bias: bool = False
    tied_embeddings: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "layers", "heads", "vocab", "ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerConfig.{name} must be an int >= 1, got {value!r}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(
                f"TransformerConfig.attention must be 'gqa' or 'mla', got {self.attention!r}"
            )
        if self.experts < 0 or self.shared_experts < 0 or self.first_dense_layers < 0:
            raise ValueError("TransformerConfig experts/shared_experts/first_dense_layers must be >= 0")


PRESETS: dict[str, TransformerConfig] = {
    # meta-llama/Meta-Llama-3-70B config.json
    "llama3-70b": TransformerConfig(
        hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256,
    ),
    # openai/gpt-oss-120b config.json (experts stacked, biases, attention sinks)
    "gpt-oss-120b": TransformerConfig(
        hidden=2880, layers=36, heads=64, kv_heads=8, head_dim=64, ffn=2880, vocab=201088,
        attn_bias=True, attn_sinks=True, experts=128, moe_ffn=2880, stacked_experts=True,
        expert_bias=True, router_bias=True,
    ),
    # deepseek-ai/DeepSeek-V3 config.json (main model, without the multi-token-prediction layer)
    "deepseek-v3": TransformerConfig(
        hidden=7168, layers=61, heads=128, ffn=18432, vocab=129280, attention="mla",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, experts=256, moe_ffn=2048, shared_experts=1, first_dense_layers=3,
        router_score_bias=True,
    ),
    # DeepSeek-V3's shapes with its 256 routed experts stacked into (E, out, in) tensors, as
    # grouped-GEMM MoE implementations store them (the layout where "matrix" granularity matters)
    "deepseek-v3-stacked": TransformerConfig(
        hidden=7168, layers=61, heads=128, ffn=18432, vocab=129280, attention="mla",
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, experts=256, moe_ffn=2048, shared_experts=1, first_dense_layers=3,
        router_score_bias=True, stacked_experts=True,
    ),
}


def get_preset(name: str) -> TransformerConfig:
    """The preset ``name`` (one of :data:`PRESETS`)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown preset {name!r}; choose one of {sorted(PRESETS)}"
        ) from None


def _attention(c: TransformerConfig, p: str) -> Group:
    h = c.hidden
    if c.attention == "mla":
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        out: Group = []
        if c.q_lora_rank:
            out += [
                (f"{p}q_a_proj.weight", (c.q_lora_rank, h)),
                (f"{p}q_a_layernorm.weight", (c.q_lora_rank,)),
                (f"{p}q_b_proj.weight", (c.heads * qk, c.q_lora_rank)),
            ]
        else:
            out.append((f"{p}q_proj.weight", (c.heads * qk, h)))
        out += [
            (f"{p}kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h)),
            (f"{p}kv_a_layernorm.weight", (c.kv_lora_rank,)),
            (f"{p}kv_b_proj.weight",
             (c.heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)),
            (f"{p}o_proj.weight", (h, c.heads * c.v_head_dim)),
        ]
        return out
    hd = c.head_dim or h // c.heads
    kv = c.kv_heads or c.heads
    out = []
    for proj, rows in (("q_proj", c.heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)):
        out.append((f"{p}{proj}.weight", (rows, h)))
        if c.attn_bias:
            out.append((f"{p}{proj}.bias", (rows,)))
    out.append((f"{p}o_proj.weight", (h, c.heads * hd)))
    if c.attn_bias:
        out.append((f"{p}o_proj.bias", (h,)))
    if c.attn_sinks:
        out.append((f"{p}sinks", (c.heads,)))
    return out


def _mlp(p: str, h: int, f: int) -> Group:
    return [
        (f"{p}gate_proj.weight", (f, h)),
        (f"{p}up_proj.weight", (f, h)),
        (f"{p}down_proj.weight", (h, f)),
    ]


def _moe(c: TransformerConfig, p: str) -> Group:
    h, f, e = c.hidden, c.moe_ffn or c.ffn, c.experts
    out: Group = [(f"{p}gate.weight", (e, h))]
    if c.router_bias:
        out.append((f"{p}gate.bias", (e,)))
    if c.router_score_bias:
        out.append((f"{p}gate.e_score_correction_bias", (e,)))
    if c.stacked_experts:
        out.append((f"{p}experts.gate_up_proj", (e, h, 2 * f)))
        if c.expert_bias:
            out.append((f"{p}experts.gate_up_proj_bias", (e, 2 * f)))
        out.append((f"{p}experts.down_proj", (e, f, h)))
        if c.expert_bias:
            out.append((f"{p}experts.down_proj_bias", (e, h)))
    else:
        for i in range(e):
            out += _mlp(f"{p}experts.{i}.", h, f)
    if c.shared_experts:
        out += _mlp(f"{p}shared_experts.", h, f * c.shared_experts)
    return out


def transformer_groups(c: TransformerConfig, grouping: str = "block") -> list[tuple[str, Group]]:
    """Parameter shapes as sharding groups: ``[(group_name, [(param_name, shape), ...]), ...]``.

    ``grouping="block"``: one group per transformer block, then a root group (embedding, final
    norm, head), as with ``fully_shard`` on each block and then the root. ``"model"``: one group.
    """
    if grouping not in ("block", "model"):
        raise ValueError(f"grouping must be 'block' or 'model', got {grouping!r}")
    h = c.hidden
    blocks: list[tuple[str, Group]] = []
    for i in range(c.layers):
        p = f"model.layers.{i}."
        params: Group = [(f"{p}input_layernorm.weight", (h,))]
        params += _attention(c, f"{p}self_attn.")
        params.append((f"{p}post_attention_layernorm.weight", (h,)))
        if c.experts and i >= c.first_dense_layers:
            params += _moe(c, f"{p}mlp.")
        else:
            params += _mlp(f"{p}mlp.", h, c.ffn)
        blocks.append((f"layers.{i}", params))
    root: Group = [("model.embed_tokens.weight", (c.vocab, h)), ("model.norm.weight", (h,))]
    if not c.tied_embeddings:
        root.append(("lm_head.weight", (c.vocab, h)))
    if grouping == "model":
        return [("model", [t for _, g in blocks for t in g] + root)]
    return blocks + [("root", root)]


def num_params(c: TransformerConfig) -> int:
    """Total parameters of the config."""
    return sum(math.prod(s) for _, g in transformer_groups(c, "model") for _, s in g)


def with_overrides(c: TransformerConfig, **overrides) -> TransformerConfig:
    """A copy of ``c`` with fields replaced (unknown fields raise ``ValueError``)."""
    names = {f.name for f in dataclasses.fields(c)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown TransformerConfig fields {unknown}; known: {sorted(names)}")
    return dataclasses.replace(c, **overrides)
