"""Single-process Muon: equals torch.optim.Muon (+ torch.optim.AdamW), routing, planning, errors."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from lightning_vescale.optim import (
    DEFAULT_NS_COEFFICIENTS,
    Muon,
    assign_owners,
    newton_schulz,
    newton_schulz_flops,
    newton_schulz_reference,
    plan_buckets,
)


# -- Newton–Schulz -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32), (1, 7), (7, 1), (5, 9)])
def test_newton_schulz_bitwise_equals_torch(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    for steps in (0, 1, 5):
        ours = newton_schulz(g, DEFAULT_NS_COEFFICIENTS, steps, 1e-7)
        want = torch_ns(g, DEFAULT_NS_COEFFICIENTS, steps, 1e-7)
        assert ours.dtype == torch.bfloat16 and ours.shape == g.shape
        assert torch.equal(ours, want)


def test_newton_schulz_batched_equals_one_by_one():
    g = torch.randn(5, 24, 40, generator=torch.Generator().manual_seed(2))
    for x in (g, g.mT.contiguous()):  # wide and tall
        batched = newton_schulz(x)
        single = torch.stack([newton_schulz(m) for m in x])
        torch.testing.assert_close(batched.float(), single.float(), rtol=0, atol=1e-2)
        if x.device.type == "cpu":  # CPU baddbmm and addmm agree bitwise (see module note)
            assert torch.equal(batched, single)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_newton_schulz_close_to_reference_math(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    fast = newton_schulz(g).float()
    ref = newton_schulz_reference(g, dtype=torch.float64).float()
    assert (fast - ref).norm() / ref.norm() < 0.03  # bf16 vs fp64
    # the quintic maps all but the tiniest singular values into ~[0.7, 1.2]
    sv = torch.linalg.svdvals(ref)
    assert sv.median() > 0.6 and sv.max() < 1.3


def test_newton_schulz_does_not_touch_a_bf16_input():
    g = torch.randn(8, 12).bfloat16()
    before = g.clone()
    newton_schulz(g)
    assert torch.equal(g, before)


def test_newton_schulz_flops():
    assert newton_schulz_flops(4, 8, 1) == 4 * 16 * 8 + 2 * 64
    assert newton_schulz_flops(8, 4, 5) == newton_schulz_flops(4, 8, 5)


# -- single-process equality with torch ------------------------------------------------------------
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(13, 8)
        self.fc1 = nn.Linear(8, 24)
        self.fc2 = nn.Linear(24, 8)
        self.conv = nn.Conv1d(8, 6, 3, padding=1)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 13, bias=False)

    def forward(self, idx):
        x = self.tok_emb(idx)  # (B, T, 8)
        x = self.fc2(torch.relu(self.fc1(x)))
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.head(self.ln(x))


def _torch_reference(model, muon_kw, adamw_kw):
    """torch.optim.Muon on 2-D views of the hidden weights, AdamW on the rest."""
    muon_p, adamw_p, views = [], [], {}
    for name, p in model.named_parameters():
        if p.ndim >= 2 and not name.startswith(("tok_emb", "head")):
            v = nn.Parameter(p.detach().reshape(p.shape[0], -1).clone())
            views[name] = v
            muon_p.append(v)
        else:
            adamw_p.append(p)
    return [torch.optim.Muon(muon_p, **muon_kw), torch.optim.AdamW(adamw_p, **adamw_kw)], views


def _train(model, opts, steps, views=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 13, (3, 5), generator=g)
        if views:  # reference: run forward with the 2-D views copied back
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in views:
                        p.copy_(views[name].reshape(p.shape))
        model(idx).square().mean().backward()
        if views:
            for name, p in model.named_parameters():
                if name in views:
                    views[name].grad = p.grad.reshape(views[name].shape).clone()
                    p.grad = None
        for o in opts:
            o.step()
            o.zero_grad()
    if views:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in views:
                    p.copy_(views[name].reshape(p.shape))


@pytest.mark.parametrize("adjust_lr_fn,nesterov,wd", [
    (None, True, 0.1), ("original", False, 0.0), ("match_rms_adamw", True, 0.3)])
def test_single_process_bitwise_equals_torch(adjust_lr_fn, nesterov, wd):
    torch.manual_seed(0)
    ours = Tiny()
    ref = copy.deepcopy(ours)
    muon_kw = dict(lr=0.02, weight_decay=wd, momentum=0.9, nesterov=nesterov,
                   adjust_lr_fn=adjust_lr_fn)
    adamw_kw = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.02)
    # A Conv1d weight is 3-D, which Muon reads as a stack of matrices by default (design note
    # [muon-stacked-experts]); its group asks for the conv's flattened (out, in * k) matrix.
    named = list(ours.named_parameters())
    opt = Muon([{"params": [x for x in named if x[0] != "conv.weight"]},
                {"params": [x for x in named if x[0] == "conv.weight"], "matrix_view": "flatten"}],
               **muon_kw, **{f"adamw_{k}": v for k, v in adamw_kw.items()})
    ref_opts, views = _torch_reference(ref, muon_kw, adamw_kw)
    _train(ours, [opt], 4)
    _train(ref, ref_opts, 4, views)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(a, b), name


def test_batching_off_gives_same_result():
    torch.manual_seed(0)
    a = Tiny()
    b = copy.deepcopy(a)
    _train(a, [Muon(a.named_parameters(), lr=0.02)], 3)
    _train(b, [Muon(b.named_parameters(), lr=0.02, batch_newton_schulz=False)], 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_state_dict_round_trip_and_scheduler():
    torch.manual_seed(0)
    a = Tiny()
    b = copy.deepcopy(a)
    opt_a = Muon(a.named_parameters(), lr=0.02)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, 1, gamma=0.5)
    _train(a, [opt_a], 2)
    sched_a.step()
    opt_b = Muon(b.named_parameters(), lr=0.02)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b, 1, gamma=0.5)
    _train(b, [opt_b], 2)
    sched_b.step()
    sd = copy.deepcopy(opt_b.state_dict())
    opt_b2 = Muon(b.named_parameters(), lr=0.02)
    opt_b2.load_state_dict(sd)
    assert [g["lr"] for g in opt_b2.param_groups] == [0.01, 0.0005]  # both kinds scheduled
    _train(a, [opt_a], 2, seed=1)
    _train(b, [opt_b2], 2, seed=1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_closure_and_params_without_grad():
    m = nn.Linear(4, 4)
    opt = Muon(m.parameters())
    before = m.weight.detach().clone()
    assert opt.step() is None  # no grads: nothing happens
    assert torch.equal(m.weight, before)
    loss = opt.step(lambda: m(torch.ones(2, 4)).sum().backward() or torch.tensor(1.0))
    assert loss == 1.0 and not torch.equal(m.weight, before)


# -- routing ---------------------------------------------------------------------------------------
def _routes(opt):
    return {n: g["use_muon"] for g in opt.param_groups for n in g.get("param_names", [])}


def test_default_routing_by_name_and_shape():
    r = _routes(Muon(Tiny().named_parameters()))
    assert r == {"tok_emb.weight": False, "fc1.weight": True, "fc1.bias": False,
                 "fc2.weight": True, "fc2.bias": False, "conv.weight": True,
                 "conv.bias": False, "ln.weight": False, "ln.bias": False, "head.weight": False}


def test_routing_overrides_patterns_and_groups():
    m = Tiny()
    r = _routes(Muon(m.named_parameters(), muon_patterns=[r"^head\."],
                     adamw_patterns=[r"conv", r"emb"]))
    assert r["head.weight"] and not r["conv.weight"] and not r["tok_emb.weight"]
    # explicit groups
    named = dict(m.named_parameters())
    opt = Muon([
        {"params": [("fc1.weight", named["fc1.weight"])], "use_muon": True, "lr": 0.05},
        {"params": [("head.weight", named["head.weight"])], "use_muon": False, "lr": 1e-4,
         "betas": (0.5, 0.6)},
        {"params": [(n, named[n]) for n in ("fc2.weight", "fc2.bias")], "lr": 0.03,
         "adamw_lr": 7e-4},
    ], adamw_lr=2e-3)
    g = opt.param_groups
    assert [(x["use_muon"], x["param_names"], x["lr"]) for x in g] == [
        (True, ["fc1.weight"], 0.05), (False, ["head.weight"], 1e-4),
        (True, ["fc2.weight"], 0.03), (False, ["fc2.bias"], 7e-4)]
    assert g[1]["betas"] == (0.5, 0.6) and g[3]["betas"] == (0.9, 0.999)
    assert "momentum" not in g[1] and "betas" not in g[0]
    # bare tensors: shape rule only
    opt = Muon(m.parameters())
    assert sum(len(x["params"]) for x in opt.param_groups if x["use_muon"]) == 5


# Hidden matrices whose names contain "output", "head" or "emb" as part of another word: Muon.
MUST_BE_MUON = [
    "bert.encoder.layer.0.attention.output.dense.weight",
    "bert.encoder.layer.0.output.dense.weight",
    "bert.encoder.layer.0.intermediate.dense.weight",
    "blocks.0.attn.output.weight",
    "model.blocks.0.attn.output.weight",
    "model.ensemble.0.weight",
    "assembler.proj.weight",
    "membrane.linear.weight",
    "decoder.output_proj.weight",
    "transformer.h.0.mlp.c_proj.weight",
    "blocks.0.attn.heads.weight",
    "layers.3.head.weight",  # a per-layer "head" module, not the model's output head
    "model.layers.0.mlp.down_proj.weight",
]
# Embeddings and the model's output head: AdamW.
MUST_BE_ADAMW = [
    "tok_emb.weight", "pos_emb.weight", "model.tok_emb.weight", "model.pos_emb.weight",
    "tok_embeddings.weight", "model.embed_tokens.weight", "embedding.weight",
    "bert.embeddings.word_embeddings.weight", "bert.embeddings.position_embeddings.weight",
    "transformer.wte.weight", "transformer.wpe.weight",
    "lm_head.weight", "model.lm_head.weight", "classifier.weight", "bert.classifier.weight",
    "head.weight", "model.head.weight", "_orig_mod.head.weight", "module.model.head.weight",
    "output.weight", "fc_out.weight",
]


def test_default_routing_of_common_names():
    ps = [(n, nn.Parameter(torch.zeros(4, 4))) for n in MUST_BE_MUON + MUST_BE_ADAMW]
    r = _routes(Muon(ps))
    assert [n for n in MUST_BE_MUON if not r[n]] == []
    assert [n for n in MUST_BE_ADAMW if r[n]] == []


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("prefix", ["", "model."])
def test_default_routing_of_the_example_gpt(tie, prefix):
    """examples/gpt.py (as is, and as a LightningModule's ``self.model``): embeddings and head on
    AdamW, every other matrix on Muon."""
    from examples.gpt import GPT, GPTConfig

    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, tie_weights=tie))
    named = [(prefix + n, p) for n, p in gpt.named_parameters()]
    r = _routes(Muon(named))
    adamw = {n for n, p in named if p.ndim < 2} | {prefix + "tok_emb.weight",
                                                   prefix + "pos_emb.weight"}
    if not tie:
        adamw.add(prefix + "head.weight")
    assert {n for n, muon in r.items() if not muon} == adamw
    assert all(r[n] for n, p in named if n not in adamw)


def test_load_state_dict_of_another_shape_is_named():
    torch.manual_seed(0)
    a, b = nn.Linear(6, 4), nn.Linear(6, 5)
    opt_a = Muon([("fc.weight", a.weight), ("fc.bias", a.bias)])
    a(torch.randn(2, 6)).sum().backward()
    opt_a.step()
    opt_b = Muon([("fc.weight", b.weight), ("fc.bias", b.bias)])
    before = copy.deepcopy(opt_b.state_dict())
    with pytest.raises(ValueError, match=r"'momentum_buffer' of parameter 'fc.weight'.*\(4, 6\)"
                                         r".*\(5, 6\)"):
        opt_b.load_state_dict(opt_a.state_dict())
    assert opt_b.state_dict() == before  # nothing was loaded


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr must be >= 0"),
    (dict(momentum=-0.1), "momentum"),
    (dict(weight_decay=-1.0), "weight_decay"),
    (dict(adjust_lr_fn="fancy"), "adjust_lr_fn"),
    (dict(ns_steps=100), "ns_steps"),
    (dict(ns_coefficients=(1.0, 2.0)), "ns_coefficients"),
    (dict(eps=-1.0), "eps"),
    (dict(adamw_lr=-1.0), "adamw_lr"),
    (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"),
    (dict(adamw_eps=-1.0), "adamw_eps"),
    (dict(adamw_weight_decay=-1.0), "adamw_weight_decay"),
    (dict(bucket_cap_mb=0), "bucket_cap_mb"),
    (dict(adamw_patterns=["("]), "adamw_patterns"),
    (dict(muon_patterns=[r"bias"]), "muon_patterns matched parameter 'fc1.bias'"),
])
def test_bad_hyperparameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon(Tiny().named_parameters(), **kwargs)


def test_bad_groups_are_named():
    m = Tiny()
    with pytest.raises(ValueError, match="'fc1.bias'.*use_muon=True"):
        Muon([{"params": [("fc1.bias", m.fc1.bias)], "use_muon": True}])
    with pytest.raises(ValueError, match=r"unknown AdamW param-group option\(s\) \['momentum'\]"):
        Muon([{"params": [m.fc1.bias], "use_muon": False, "momentum": 0.9}])
    with pytest.raises(TypeError, match="use_muon"):
        Muon([{"params": [m.fc1.weight], "use_muon": "yes"}])
    with pytest.raises(TypeError, match="sequences of regex"):
        Muon(m.named_parameters(), adamw_patterns="head")


# -- planning --------------------------------------------------------------------------------------
def _makespan(costs, owners, world):
    load = [0] * world
    for c, o in zip(costs, owners):
        load[o] += c
    return max(load)


def test_assign_owners_lpt_bound_and_determinism():
    rng = random.Random(0)
    for _ in range(60):
        world = rng.randint(1, 4)
        costs = [rng.randint(1, 50) for _ in range(rng.randint(0, 7))]
        owners = assign_owners(costs, world)
        assert owners == assign_owners(list(costs), world)
        best = min((_makespan(costs, o, world)
                    for o in itertools.product(range(world), repeat=len(costs))), default=0)
        assert _makespan(costs, owners, world) <= 4 / 3 * best + 1e-9


def test_assign_owners_tie_breaks():
    # equal loads: prefer the rank holding most of the matrix, then the lowest rank
    assert assign_owners([5], 3, holdings=[[1, 9, 9]]) == [1]
    assert assign_owners([5, 5], 2) == [0, 1]
    # base_load (earlier buckets) breaks ties between equally loaded ranks in this bucket
    assert assign_owners([5], 2, base_load=[10, 0]) == [1]
    # more ranks than matrices: one matrix per rank, the rest idle
    assert sorted(assign_owners([3, 2], 4)) == [0, 1]


def test_plan_buckets():
    assert plan_buckets([], 10) == []
    assert plan_buckets([4, 4, 4, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert plan_buckets([4, 4, 4], 100) == [[0, 1, 2]]


def test_assign_owners_locality_pass_moves_less_without_losing_balance():
    # LPT alone alternates ranks and moves half the elements; the locality pass keeps every
    # matrix where it lives at the same makespan.
    hold = [[1, 0], [1, 0], [0, 1], [0, 1]]
    assert assign_owners([1, 1, 1, 1], 2, holdings=hold) == [0, 0, 1, 1]
    # never at the price of balance: everything lives on rank 0, work still splits
    assert sorted(assign_owners([1, 1], 2, holdings=[[1, 0], [1, 0]])) == [0, 1]
    rng = random.Random(1)
    for _ in range(60):
        world = rng.randint(1, 4)
        n = rng.randint(0, 6)
        costs = [rng.randint(1, 50) for _ in range(n)]
        holds = [[rng.randint(0, 3) for _ in range(world)] for _ in range(n)]
        with_h = assign_owners(costs, world, holdings=holds)
        best = min((_makespan(costs, o, world)
                    for o in itertools.product(range(world), repeat=n)), default=0)
        assert _makespan(costs, with_h, world) <= 4 / 3 * best + 1e-9


def test_init_state_is_the_fresh_state():
    torch.manual_seed(0)
    a = Tiny()
    b = copy.deepcopy(a)
    opt_b = Muon(b.named_parameters(), lr=0.02)
    opt_b.init_state()
    assert len(opt_b.state) == len(list(b.parameters()))
    assert all(float(s["step"]) == 0 for s in opt_b.state.values() if "step" in s)
    _train(a, [Muon(a.named_parameters(), lr=0.02)], 2)
    _train(b, [opt_b], 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
