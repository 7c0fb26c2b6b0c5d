"""The strategies' per-name granularity (design note [granularity-rules]).

``granularity={"*.experts.*": "matrix"}`` keeps each expert of a stacked ``(E, out, in)`` weight
whole on one rank and leaves every other parameter at the default (256-aligned large tensors),
in one model; a pattern that matches nothing, a bad form and (for AdamW8bit, the optimizer with
blocks) a matrix that an 8-bit block would straddle are errors that name the fix.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.distributed as dist

from examples.moe import MoEConfig, MoEGPT
from lightning_vescale import VeScaleFSDPStrategy
from lightning_vescale._lightning.granularity_rules import GranularityRules, suggest_pattern
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


def test_matrix_with_a_block_resolves_to_whole_matrices_on_block_bounds():
    # the layout never refuses: lcm(matrix, block) keeps matrices whole and bounds on blocks;
    # whether a block may hold two matrices is AdamW8bit's check (below), not the strategy's
    policy = _policy({"*": "matrix"})
    assert policy("experts.w", torch.empty(4, 18, 96)) == 6912  # lcm(1728, 256): 4 experts
    assert policy("tok_emb.weight", torch.empty(65, 64)) == 16640  # lcm(4160, 256): whole
    assert _policy({"*": "matrix"}, block=64)("experts.w", torch.empty(4, 18, 96)) == 1728
    assert _policy({"*": "matrix"}, block=None)("experts.w", torch.empty(4, 18, 96)) == 1728
    assert _policy({"*": "matrix"})("small", torch.empty(2, 18, 6)) == 108  # fp32 states
    model = torch.nn.Linear(3, 3)
    assert [n for n, _ in policy.whole_matrices(model.named_parameters())] == ["weight", "bias"]
    assert _policy({"*.w": "matrix"}).whole_matrices(model.named_parameters()) == []


# experts of (72, 36) and (36, 36): 2592 and 1296 elements, not multiples of the 256 block
ODD = {**CFG, "n_embd": 36, "expert_ffn": 36}


def _matrix_blocks_follow_the_optimizer():
    """Through the Fabric strategy with granularity="matrix" (soap.yaml's setting): SOAP and
    Shampoo train a model whose embedding (65, 64) is no multiple of the 256 block, and a MoE
    model whose experts are not; AdamW8bit trains the first (one matrix per tensor: no block
    can hold two) and refuses the second, naming the parameter and a block size that fits."""
    from lightning.fabric import Fabric

    from examples.gpt import GPT, GPTConfig
    from lightning_vescale.optim import SOAP, Shampoo

    def setup(model, granularity="matrix"):
        fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                        strategy=VeScaleFabricStrategy(granularity=granularity))
        fabric.launch()
        return fabric, fabric.setup_module(model)

    def train(fabric, model, opt, steps=2):
        x = torch.randint(0, 65, (steps, 2, 8), generator=torch.Generator().manual_seed(1))
        for step in range(steps):
            fabric.backward(model(x[step], x[step]))
            opt.step()
            opt.zero_grad()
        return True

    out = {}
    for name, make in [("soap", lambda m: SOAP(m.parameters(), precondition_frequency=1)),
                       ("shampoo", lambda m: Shampoo(m.parameters(), precondition_frequency=1)),
                       ("adamw8bit", lambda m: AdamW8bit(m.parameters()))]:
        torch.manual_seed(0)
        fabric, gpt = setup(GPT(GPTConfig(n_layer=1, n_embd=64, n_head=2, block_size=8)))
        out[f"gpt-{name}"] = train(fabric, gpt, make(gpt))
    for name, make in [("soap", lambda m: SOAP(m.parameters(), precondition_frequency=1))]:
        torch.manual_seed(0)
        fabric, moe = setup(MoEGPT(MoEConfig(**ODD)), {"*.experts.*": "matrix"})
        out[f"moe-{name}"] = train(fabric, moe, make(moe))
    torch.manual_seed(0)
    fabric, moe = setup(MoEGPT(MoEConfig(**ODD)), {"*.experts.*": "matrix"})
    with pytest.raises(ValueError) as info:
        AdamW8bit(moe.parameters())
    out["adamw8bit-moe"] = str(info.value)
    return out


def test_the_matrix_block_check_follows_the_optimizer(worlds):
    for out in worlds(2).run(_matrix_blocks_follow_the_optimizer):
        msg = out.pop("adamw8bit-moe")
        assert out == {"gpt-soap": True, "gpt-shampoo": True, "gpt-adamw8bit": True,
                       "moe-soap": True}
        assert "AdamW8bit(block_size=256)" in msg and ".experts.w_in'" in msg, msg
        assert "2592 elements" in msg and "optimizer_block_size=32" in msg, msg
        assert "two matrices' (experts') moments" in msg, msg


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
    assert all("'*.expert.*' matches no parameter" in m and "did you mean '*.experts.*'" in m
               for m in messages)


def _unused_message(rules, names):
    rules = GranularityRules.parse(rules)
    for n in names:
        rules.form_for(n)
    with pytest.raises(ValueError) as info:
        rules.check_all_used(names)
    return str(info.value)


def test_a_pattern_that_takes_nothing_gets_a_pattern_that_would():
    names = [n for n, _ in MoEGPT(MoEConfig(**CFG)).named_parameters()]
    msg = _unused_message({"*.expert.*": "matrix"}, names)  # the typo
    assert "did you mean '*.experts.*' (it matches 4, e.g. 'blocks.0.mlp.experts.w_in')" in msg
    assert "'*.expert.*' to match" not in msg  # no longer the same pattern back as the fix
    msg = _unused_message({"experts": "matrix"}, names)  # no wildcards
    assert "did you mean '*.experts.*'" in msg
    msg = _unused_message({"model.blocks.*.mlp.expert.*": "matrix"}, names)  # prefix and typo
    assert "did you mean 'blocks.*.mlp.experts.*'" in msg
    msg = _unused_message({"*": None, "*.experts.*": "matrix"}, names)  # shadowed
    assert "matches 4 parameter(s)" in msg and "put '*.experts.*' before '*'" in msg
    msg = _unused_message({"*.zzz": "matrix"}, names)  # nothing close: no suggestion
    assert "'*.zzz' matches no parameter" in msg and "did you mean" not in msg
    for bad in ("*.expert.*", "experts", "*.zzz", "*.experts.w_gate"):  # never itself back
        suggested = suggest_pattern(bad, names)
        assert suggested != bad and (suggested is None or any(
            fnmatch.fnmatchcase(n, suggested) for n in names))
