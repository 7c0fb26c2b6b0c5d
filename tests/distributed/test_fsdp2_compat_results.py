"""FSDP2 behaviours whose results were wrong (issue 15, items 1-4): each case runs on torch's
FSDP2 (the reference side) and on ``lightning_vescale.fsdp``, and against a single process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_vescale._gloo_exchange import unfused
from tests.distributed._fsdp2_compat import IMPLS, MLP, full_grads, micro, shard_mlp


# -- 1. gradient accumulation without sync: summed in reduce_dtype (fp32), not in bf16 ------------
def _accumulate_body(impl: str, n_micro: int):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model).to(torch.bfloat16)  # what every rank computes in
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_mlp(impl, model, mp_policy=mp)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4 * world, 16, generator=g) * 3 for _ in range(n_micro)]
    for i, x in enumerate(xs):
        model.set_requires_gradient_sync(i == n_micro - 1)
        model(micro(x)).float().square().mean().backward()
    got = full_grads(model)
    # Single process: every rank's bf16 micro-batch gradient, summed in fp32, averaged over ranks.
    want = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    b = xs[0].shape[0] // world
    for x in xs:
        for r in range(world):
            ref.zero_grad()
            ref(x[r * b:(r + 1) * b].to(torch.bfloat16)).float().square().mean().backward()
            for n, p in ref.named_parameters():
                want[n] += p.grad.float() / world
    return got, want


@pytest.mark.parametrize("impl", IMPLS)
def test_no_sync_accumulation_sums_in_reduce_dtype(worlds, impl):
    got, want = worlds(2).run(_accumulate_body, impl, 8)[0]
    for n in want:
        assert got[n].dtype == torch.float32
        # fp32 summation order differs from the reference: 1e-5; bf16 accumulation: ~1e-3
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{impl} {n}")


# -- 2. tied weights in two sibling groups: a clear ValueError (FSDP2's), or one group (exact) -----
def _tied_siblings_body(impl: str):
    from tests.distributed._fsdp2_compat import TiedLM, expect_raises, fully_shard_of, lm_loss

    fs = fully_shard_of(impl)
    torch.manual_seed(0)
    model = TiedLM()

    def shard_and_train():
        fs(model.emb)
        fs(model.head)  # head.weight is emb.weight: the tie would be split across two groups
        fs(model)
        lm_loss(model, torch.randint(0, 11, (2, 5))).backward()

    # torch's FSDP2 raises at lazy init (first forward), ours already at the fully_shard call
    return expect_raises(shard_and_train, ValueError, "fully_shard([")


@pytest.mark.parametrize("impl", IMPLS)
def test_tied_weights_in_sibling_groups_raise(worlds, impl):
    assert worlds(2).run(_tied_siblings_body, impl)[0] is None


def _tied_siblings_names_body():
    from lightning_vescale.fsdp import fully_shard
    from tests.distributed._fsdp2_compat import TiedLM

    model = TiedLM()
    fully_shard(model.emb)
    try:
        fully_shard(model.head)
    except ValueError as e:
        return str(e)
    return None


def test_tied_sibling_error_names_both_modules(worlds):
    msg = worlds(1).run(_tied_siblings_names_body)[0]
    assert msg is not None and "Linear.weight" in msg and "Embedding.weight" in msg, msg


def _tied_list_group_body(impl: str, steps: int):
    from tests.distributed._fsdp2_compat import TiedLM, full_params, fully_shard_of, lm_loss

    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = TiedLM()
    ref = copy.deepcopy(model)
    fs(model.block)
    fs([model.emb, model.head])  # one group: the tie is kept
    fs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 11, (2 * world, 6), generator=g)
        lm_loss(model, micro(ids)).backward()
        opt.step()
        opt.zero_grad()
        lm_loss(ref, ids).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    tied = model.head.weight is model.emb.weight
    got = full_params(model)
    # a full state dict loads back into the list group under both names of the tied weight
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(7)
    other = TiedLM()
    set_model_state_dict(model, other.state_dict(), options=StateDictOptions(full_state_dict=True))
    reloaded = all(torch.equal(full_params(model)[n], p) for n, p in other.named_parameters())
    return got, {n: p.detach().clone() for n, p in ref.named_parameters()}, tied and reloaded


@pytest.mark.parametrize("impl", IMPLS)
def test_tied_weights_in_one_list_group_train_like_one_process(worlds, impl):
    got, want, tied = worlds(2).run(_tied_list_group_body, impl, 3)[0]
    assert tied
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{impl} {n}")


# -- 4. reshard_after_forward on the root: None keeps, an explicit True reshards ------------------
class _RootOwn(nn.Module):
    """A root that owns parameters (``w``) besides an inner group (``inner``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(x)) @ self.w


def _root_own_body(impl: str, raf):
    from torch.distributed.tensor import DTensor

    from tests.distributed._fsdp2_compat import full_grads, fully_shard_of

    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _RootOwn()
    ref = copy.deepcopy(model)
    kw = {} if raf == "default" else {"reshard_after_forward": raf}
    fs(model.inner, **kw)
    fs(model, **kw)
    x = torch.randn(2 * world, 6)
    out = model(micro(x))
    root_sharded_after_forward = isinstance(model.w, DTensor)
    out.square().mean().backward()
    ref(x).square().mean().backward()
    return (root_sharded_after_forward, full_grads(model),
            {n: p.grad.clone() for n, p in ref.named_parameters()})


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("raf,root_resharded", [("default", False), (None, False), (True, True),
                                                 (False, False)])
def test_root_reshard_after_forward(worlds, impl, raf, root_resharded):
    resharded, grads, ref_grads = worlds(2).run(_root_own_body, impl, raf)[0]
    assert resharded == root_resharded, (impl, raf)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


# -- 3. an optimizer over the parameters before they were sharded: never silent --------------------
def _stale_optimizer_body(impl: str, when: str):
    from tests.distributed._fsdp2_compat import full_params

    world = dist.get_world_size()
    torch.manual_seed(0)
    if when == "before_to_empty":  # FSDP2's meta-device flow, optimizer built before to_empty
        with torch.device("meta"):
            model = MLP()
        shard_mlp(impl, model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(0.5)
    else:
        model = MLP()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built over the unsharded params
        shard_mlp(impl, model)
    before = full_params(model)
    model(micro(torch.randn(2 * world, 16))).square().mean().backward()
    try:
        opt.step()
    except RuntimeError as e:
        return "raised", str(e)
    after = full_params(model)
    return "silent", all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("when", ["before_fully_shard", "before_to_empty"])
def test_optimizer_over_replaced_parameters(worlds, when):
    kind, msg = worlds(2).run(_stale_optimizer_body, "ours", when)[0]
    assert kind == "raised", msg
    assert "is no longer part of the model" in msg and "model.parameters()" in msg, msg
    assert ("before fully_shard" in msg) == (when == "before_fully_shard"), msg
    assert "'Linear.weight'" in msg or "'Linear.bias'" in msg, msg


def test_fsdp2_is_silent_with_an_optimizer_over_replaced_parameters(worlds):
    # the reference side: FSDP2 steps on the orphans, no parameter changes (what we beat above)
    kind, unchanged = worlds(2).run(_stale_optimizer_body, "torch", "before_fully_shard")[0]
    assert kind == "silent" and unchanged


# -- set_reduce_scatter_unused_params: parameters some or all ranks did not use ---------------------
class _Routed(nn.Module):
    """Two "experts" and a third nobody calls: rank r sends its batch through ``experts[r % 2]``
    only. One group holds them all (an MoE block): the group runs on every rank, the parameters
    each rank computes gradients for differ."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts[dist.get_rank() % 2](x)


@unfused()  # counts the flag all-reduce itself (design note [gloo-fused-exchange])
def _unused_params_body(impl: str, on: bool):
    from tests.distributed._fsdp2_compat import fully_shard_of

    shard = fully_shard_of(impl)
    torch.manual_seed(0)
    model = _Routed()
    ref = copy.deepcopy(model)
    shard(model)
    model.set_reduce_scatter_unused_params(on)
    x = torch.randn(4 * dist.get_world_size(), 8, generator=torch.Generator().manual_seed(1))
    calls = []
    real = dist.all_reduce
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1) or real(*a, **k))
        model(micro(x)).square().mean().backward()
    # Single process over the global batch: each expert's loss terms, averaged over the ranks.
    b, world = x.shape[0] // dist.get_world_size(), dist.get_world_size()
    for r in range(world):
        (ref.experts[r % 2](x[r * b:(r + 1) * b]).square().mean() / world).backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    return full_grads(model), want, len(calls)


@pytest.mark.parametrize("impl", IMPLS)
def test_reduce_scatter_unused_params_gives_zeros_and_skips_the_flag_all_reduce(worlds, impl):
    """FSDP2's ``set_reduce_scatter_unused_params(True)``, ported and run on both: every trainable
    parameter gets a gradient (zeros for the expert no rank used), the used ones equal one
    process; ours then runs no gradient-flag all-reduce (no host sync at the end of backward)."""
    for got, want, calls in worlds(2).run(_unused_params_body, impl, True):
        for n, g in got.items():
            expected = want[n] if want[n] is not None else torch.zeros_like(g)
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6, msg=n)
        if impl == "ours":
            assert calls == 0


def test_without_it_a_parameter_no_rank_used_has_no_gradient(worlds):
    """Ours by default (single-process semantics): ``grad=None`` where no rank computed one,
    found by one flag all-reduce; the experts used on one rank only train as in one process.
    (FSDP2 without the setting reduce-scatters a different parameter set on each rank here.)"""
    for got, want, calls in worlds(2).run(_unused_params_body, "ours", False):
        assert got["experts.2.weight"] is None and want["experts.2.weight"] is None
        for n in ("experts.0.weight", "experts.1.bias"):
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
        assert calls == 1
