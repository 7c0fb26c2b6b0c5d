"""The strategies' per-name granularity (design note [granularity-rules]).

``granularity={"*.experts.*": "matrix"}`` keeps each expert of a stacked ``(E, out, in)`` weight
whole on one rank and leaves every other parameter at the default (256-aligned large tensors),
in one model; a pattern that matches nothing, a bad form and a matrix that an 8-bit block would
straddle are errors that name the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.moe import MoEConfig, MoEGPT
from lightning_vescale import VeScaleFSDPStrategy
from lightning_vescale._lightning.granularity_rules import GranularityRules
from lightning_vescale._lightning.sharding import ShardGranularity, parse_granularity, shard_model
from lightning_vescale.fabric import VeScaleFabricStrategy
from lightning_vescale.mesh import init_mesh
from lightning_vescale.optim import AdamW8bit
from lightning_vescale.optim._base import param_layout

# 6 experts of (64, 32) and (32, 32): 2048 and 1024 elements, multiples of the 256 block.
CFG = dict(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=32, n_expert=6, top_k=2,
           expert_ffn=32)


def _policy(granularity, block=256):
    return ShardGranularity(granularity=parse_granularity(granularity), optimizer_block_size=block,
                            min_block_numel=4096)


def test_first_matching_rule_wins_and_unmatched_get_the_default():
    rules = GranularityRules.parse({"*.experts.w_in": "row", "*.experts.*": "matrix"})
    assert rules.form_for("blocks.1.mlp.experts.w_in") == "row"
    assert rules.form_for("blocks.1.mlp.experts.w_out") == "matrix"
    assert rules.form_for("tok_emb.weight") is None
    policy = _policy({"*.experts.*": "matrix"})
    w = torch.empty(6, 64, 32)
    assert policy("blocks.1.mlp.experts.w_in", w) == 64 * 32  # one expert (a multiple of 256)
    assert policy("blocks.0.attn.qkv.weight", torch.empty(128, 32)) == 256  # the default
    assert policy("blocks.0.ln_1.weight", torch.empty(32)) == 1  # small: element-wise
    assert policy.bound("blocks.1.mlp")("experts.w_in", w) == 64 * 32
    assert "'*.experts.*': 'matrix'" in policy.explain()


@pytest.mark.parametrize("bad, error, words", [
    ({}, ValueError, "empty mapping"),
    ({"": "matrix"}, TypeError, "parameter-name patterns"),
    ({3: "matrix"}, TypeError, "parameter-name patterns"),
    ({"*.experts.*": "columns"}, ValueError, "granularity['*.experts.*']"),
    ({"*.experts.*": 100}, ValueError, "not a multiple of optimizer_block_size=256"),
])
def test_bad_rules_fail_at_construction(bad, error, words):
    for cls in (VeScaleFSDPStrategy, VeScaleFabricStrategy):
        with pytest.raises(error) as info:
            cls(granularity=bad)
        assert words in str(info.value)


def test_a_matrix_an_8bit_block_would_straddle_is_refused_with_a_block_that_fits():
    policy = _policy({"*": "matrix"})
    with pytest.raises(ValueError) as info:
        policy("experts.w", torch.empty(4, 18, 96))  # 1728 elements per expert
    msg = str(info.value)
    assert "'experts.w'" in msg and "1728" in msg and "optimizer_block_size=64" in msg
    assert _policy({"*": "matrix"}, block=64)("experts.w", torch.empty(4, 18, 96)) == 1728
    assert _policy({"*": "matrix"}, block=None)("experts.w", torch.empty(4, 18, 96)) == 1728
    assert _policy({"*": "matrix"})("small", torch.empty(2, 18, 6)) == 108  # fp32 states


def _shard(granularity):
    torch.manual_seed(0)
    model = MoEGPT(MoEConfig(**CFG))
    shard_model(model, units=None, mesh=init_mesh("cpu", dist.get_world_size()),
                device=torch.device("cpu"), mp_policy=None, granularity=_policy(granularity),
                reshard_after_forward=True)
    return model


def _rules_shard_experts_whole_rest_aligned():
    model = _shard({"*.experts.*": "matrix"})
    seen_experts = 0
    for name, p in model.named_parameters():
        layout = param_layout(p, where=name)
        bounds = [b for r in layout.ranges for b in r]
        if ".experts." in name:
            seen_experts += 1
            unit = p.shape[-2] * p.shape[-1]
        elif p.numel() >= 4096:
            unit = 256
        else:
            continue
        assert all(b % unit == 0 or b == p.numel() for b in bounds), (name, layout.ranges)
    assert seen_experts == 4  # w_in and w_out of both MoE blocks
    opt = AdamW8bit(model.parameters())  # every quantized shard is block-aligned
    x = torch.randint(0, CFG["vocab_size"], (2, CFG["block_size"]))
    model(x, x).backward()
    opt.step()
    return True


def _typo_names_the_pattern():
    with pytest.raises(ValueError) as info:
        _shard({"*.expert.*": "matrix"})
    return str(info.value)


@pytest.mark.parametrize("world", [3])
def test_rules_shard_a_moe_model(worlds, world):
    assert worlds(world).run(_rules_shard_experts_whole_rest_aligned) == [True] * world
    messages = worlds(world).run(_typo_names_the_pattern)
    assert all("'*.expert.*'" in m and "match no parameter" in m for m in messages)
