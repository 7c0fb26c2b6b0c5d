"""FSDP2's API on ``lightning_vescale.fsdp`` (issue 15, "Missing FSDP2 API"): each case runs the
same code on torch's FSDP2 (the reference side) and on ours, against a single process where a
result is computed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fsdp2_compat import (
    IMPLS,
    MLP,
    expect_raises,
    full,
    full_grads,
    full_params,
    fully_shard_of,
    micro,
    shard_mlp,
    train_pair,
)


def _grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got: dict, want: dict, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=atol, msg=f"{what} {n}")


def _randn(world: int, d: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2 * world, d, generator=g) for _ in range(4)]
    return lambda s: xs[s]


def _sq(model, x):
    return model(x).square().mean()


# -- isinstance(m, FSDPModule); FSDP2's methods never run on our state ------------------------------
def test_every_fsdpmodule_method_is_overridden():
    from torch.distributed.fsdp import FSDPModule

    from lightning_vescale.fsdp import VeScaleFSDPModule

    assert issubclass(VeScaleFSDPModule, FSDPModule)
    theirs = {n for n, v in vars(FSDPModule).items() if callable(v) and n != "__new__"}
    inherited = sorted(n for n in theirs if n not in vars(VeScaleFSDPModule))
    assert not inherited, f"FSDP2 methods that would run on our state: {inherited}"


def _isinstance_body():
    from torch.distributed.fsdp import FSDPModule

    from lightning_vescale.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    out = {"isinstance": isinstance(model, FSDPModule) and isinstance(model[0], FSDPModule),
           "plain_child": not isinstance(model[1], FSDPModule)}
    out["slice_is_plain"] = type(model[0:2]) is nn.Sequential  # FSDP2's __new__ rule
    out["fsdp2_internals"] = expect_raises(lambda: model._get_fsdp_state()._fsdp_param_groups,
                                           AttributeError, "lightning_vescale")
    for name, call in {
        "custom_all_gather": lambda: model.set_custom_all_gather(None),
        "custom_reduce_scatter": lambda: model.set_custom_reduce_scatter(None),
        "all_reduce_hook": lambda: model.set_all_reduce_hook(lambda t: None),
        "max_input_buffers": lambda: model.set_reduce_scatter_max_input_buffers(2),
        "separate_rs_group": lambda: model.set_separate_reduce_scatter_group(True),
        "pg_memory": lambda: model.set_allocate_memory_from_process_group_for_comm(True),
    }.items():
        out[name] = expect_raises(call, NotImplementedError, "not supported")
    # accepted: every backward already ends like FSDP2's last one; 1-D meshes have no all-reduce;
    # collectives follow stream order (set_reduce_scatter_unused_params: test_fsdp2_compat_results)
    model.set_is_last_backward(False)
    model.set_requires_all_reduce(False)
    model.set_reduce_scatter_unused_params(True)
    model.set_post_optim_event(torch.Event())
    model.set_symm_mem_for_comm()  # no staging buffers here: nothing to allocate (torchtitan)
    out["symm_mem_backend"] = expect_raises(lambda: model.set_symm_mem_for_comm("NVSHMEM"),
                                            ValueError, "NCCL")
    return out


def test_isinstance_fsdpmodule_and_unsupported_methods_raise(worlds):
    out = worlds(2).run(_isinstance_body)[0]
    bad = {k: v for k, v in out.items() if v is not True and v is not None}
    assert not bad, bad


# -- unshard(async_op) / reshard: not recursive, like FSDP2 ----------------------------------------
def _unshard_body(impl: str):
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    root_own = nn.Parameter(torch.randn(8))
    model.register_parameter("scale", root_own)
    ref.register_parameter("scale", nn.Parameter(root_own.detach().clone()))
    shard_mlp(impl, model)
    out = {}
    assert model.unshard() is None
    out["own_unsharded"] = not isinstance(model.scale, DTensor)
    out["inner_still_sharded"] = isinstance(model.l1.weight, DTensor)
    model.reshard()
    out["resharded"] = isinstance(model.scale, DTensor)
    handle = model.l2.unshard(async_op=True)
    handle.wait()
    out["async_unsharded"] = not isinstance(model.l2.weight, DTensor)
    x = torch.randn(2 * world, 16)
    (model(micro(x)) * model.scale).sum().backward()  # the pre-forward accepts the prefetch
    (ref(x) * ref.scale).sum().div(world).backward()
    out["grads"] = (full_grads(model), _grads_of(ref))
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_unshard_and_reshard(worlds, impl):
    out = worlds(2).run(_unshard_body, impl)[0]
    got, want = out.pop("grads")
    assert all(out.values()), (impl, out)
    _close(got, want, impl)


# -- fully_shard([a, b]): a list of modules is one group (chunked loss: head called per chunk) -----
class _ChunkedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.trunk(x)))


def _chunked_loss(model, x):
    h = model(x)
    return sum(model.head(c).square().mean() for c in h.chunk(2, dim=1)) / 2


def _list_group_body(impl: str):
    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _ChunkedLM()
    ref = copy.deepcopy(model)
    fs(model.trunk)
    fs([model.norm, model.head])
    fs(model)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2 * world, 4, 6, generator=g) for _ in range(3)]
    return train_pair(model, ref, 3, lambda s: xs[s], _chunked_loss)


@pytest.mark.parametrize("impl", IMPLS)
def test_list_of_modules_is_one_group(worlds, impl):
    got, want = worlds(2).run(_list_group_body, impl)[0]
    _close(got, want, impl)


# -- fully_shard on modules without parameters of their own -----------------------------------------
def _no_params_body(impl: str):
    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ref = copy.deepcopy(model)
    fs(model[0])
    fs(model[1])  # no parameters at all
    fs(model[2])
    fs(model)  # the root: nothing left to own, it keeps the root hooks
    return train_pair(model, ref, 3, _randn(world, 5), _sq)


@pytest.mark.parametrize("impl", IMPLS)
def test_modules_without_own_parameters(worlds, impl):
    got, want = worlds(2).run(_no_params_body, impl)[0]
    _close(got, want, impl)


# -- reshard_after_forward as an int: reshard to groups of k ranks after forward -------------------
def _raf_int_body(impl: str, k: int):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    shard_mlp(impl, model, reshard_after_forward=k)
    kept = None
    if impl == "ours":
        from lightning_vescale.fsdp import get_state

        x = torch.randn(2 * world, 16)
        out = model(micro(x))
        buf = next(iter(get_state(model.l1).group.buffers.values()))
        kept = (buf.partial.numel() * k == buf.buffer_size, not buf.is_materialized)
        out.sum().backward()
        model.zero_grad()
    got, want = train_pair(model, ref, 3, _randn(world, 16), _sq)
    return got, want, kept


@pytest.mark.parametrize("impl", IMPLS)
def test_reshard_after_forward_int(worlds, impl):
    for got, want, kept in worlds(4).run(_raf_int_body, impl, 2):
        _close(got, want, impl)
        assert kept in (None, (True, True)), kept


def _raf_int_bad_body(impl: str):
    fs = fully_shard_of(impl)
    return expect_raises(lambda: fs(nn.Linear(3, 3), reshard_after_forward=3), ValueError,
                         "reshard_after_forward")


@pytest.mark.parametrize("impl", IMPLS)
def test_reshard_after_forward_int_must_divide_the_group(worlds, impl):
    assert worlds(4).run(_raf_int_bad_body, impl)[0] is None


# -- set_reshard_after_backward: keep parameters unsharded between micro-batches -------------------
def _rab_body(impl: str):
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    shard_mlp(impl, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    make_x = _randn(world, 16)
    kept = []
    for step in range(2):
        for mb in range(2):
            last = mb == 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            x = make_x(2 * step + mb)
            _sq(model, micro(x)).backward()
            kept.append(not isinstance(model.l1.weight, DTensor))  # unsharded iff not last
            (_sq(ref, x) / 2).backward()
        for p in model.parameters():
            p.grad.div_(2)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    return full_params(model), {n: p.detach().clone() for n, p in ref.named_parameters()}, kept


@pytest.mark.parametrize("impl", IMPLS)
def test_reshard_after_backward_false_keeps_parameters_for_the_next_micro_batch(worlds, impl):
    got, want, kept = worlds(2).run(_rab_body, impl)[0]
    assert kept == [True, False, True, False], (impl, kept)
    _close(got, want, impl)


# -- explicit prefetching ------------------------------------------------------------------------
def _explicit_prefetch_body(impl: str):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    shard_mlp(impl, model)
    model.l1.set_modules_to_forward_prefetch([model.l2, model.l3])
    model.l3.set_modules_to_backward_prefetch([model.l2, model.l1])
    calls = []
    if impl == "ours":
        from lightning_vescale.fsdp import get_state

        for name in ("l2", "l3"):
            group = get_state(getattr(model, name)).group
            orig = group.unshard

            def spy(async_op=False, _orig=orig, _name=name):
                calls.append((_name, async_op))
                return _orig(async_op=async_op)
            group.unshard = spy
    got, want = train_pair(model, ref, 3, _randn(world, 16), _sq)
    return got, want, calls


@pytest.mark.parametrize("impl", IMPLS)
def test_explicit_forward_and_backward_prefetch(worlds, impl):
    got, want, calls = worlds(2).run(_explicit_prefetch_body, impl)[0]
    _close(got, want, impl)
    if impl == "ours":  # from the first iteration on, l1's pre-forward prefetches l2 and l3
        assert calls[:2] == [("l2", True), ("l3", True)], calls
        assert ("l2", True) in calls[4:], calls  # and l3's backward prefetches l2


# -- set_gradient_divide_factor / set_force_sum_reduction_for_comms -------------------------------
def _divide_body(impl: str, how: str):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    shard_mlp(impl, model)
    for m in (model, model.l1, model.l2, model.l3):  # not recursive in FSDP2
        if how == "factor":
            m.set_gradient_divide_factor(0.5 * world)
        # (torch's FSDP2 divides by a factor with PREMUL_SUM, which gloo lacks, unless forced
        # to SUM + a separate division)
        m.set_force_sum_reduction_for_comms(True)
    x = torch.randn(2 * world, 16)
    _sq(model, micro(x)).backward()
    _sq(ref, x).backward()  # the mean over ranks; a factor of 0.5 * world makes it 2x that
    scale = 2.0 if how == "factor" else 1.0
    return full_grads(model), {n: g * scale for n, g in _grads_of(ref).items()}


@pytest.mark.parametrize("how", ["factor", "force_sum"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_divide_factor_and_sum_reduction(worlds, impl, how):
    got, want = worlds(3).run(_divide_body, impl, how)[0]
    _close(got, want, f"{impl} {how}")


# -- register_fsdp_forward_method: a method other than forward gathers parameters -----------------
class _Gen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) @ self.w

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) @ self.body.weight.T  # not through forward


def _forward_method_body(impl: str, which: str):
    from torch.distributed.fsdp import register_fsdp_forward_method as theirs

    from lightning_vescale.fsdp import register_fsdp_forward_method as ours

    fs = fully_shard_of(impl)
    torch.manual_seed(0)
    model = _Gen()
    ref = copy.deepcopy(model)
    fs(model)
    (theirs if which == "torch" else ours)(model, "generate")
    x = torch.randn(3, 4)
    with torch.no_grad():
        return full(model.generate(x)), ref.generate(x)


@pytest.mark.parametrize("which", ["torch", "ours"])
@pytest.mark.parametrize("impl", IMPLS)
def test_register_fsdp_forward_method(worlds, impl, which):
    if impl == "torch" and which == "ours":
        pytest.skip("ours is a no-op on modules it did not shard (like FSDP2's on plain ones)")
    got, want = worlds(2).run(_forward_method_body, impl, which)[0]
    torch.testing.assert_close(got, want)


# -- reset_iter_state: recover from an exception in forward --------------------------------------
class _Flaky(MLP):
    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        if self.fail:
            raise RuntimeError("boom")
        return self.l3(torch.relu(self.l2(h)))


def _reset_body(impl: str):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _Flaky()
    ref = copy.deepcopy(model)
    shard_mlp(impl, model)
    model.fail = True
    try:
        _sq(model, micro(torch.randn(2 * world, 16)))
    except RuntimeError:
        pass
    model.fail = False
    model.reset_iter_state()
    return train_pair(model, ref, 2, _randn(world, 16), _sq)


@pytest.mark.parametrize("impl", IMPLS)
def test_reset_iter_state_after_a_failed_forward(worlds, impl):
    got, want = worlds(2).run(_reset_body, impl)[0]
    _close(got, want, impl)


# -- offload_policy=CPUOffloadPolicy: shards, gradients and optimizer states in CPU memory --------
def _offload_body(impl: str):
    from torch.distributed.fsdp import CPUOffloadPolicy

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    shard_mlp(impl, model, offload_policy=CPUOffloadPolicy(pin_memory=True))
    copies = []
    if impl == "ours":
        import lightning_vescale.dbuffer as dbuffer_mod
        from lightning_vescale.fsdp import dbuffers

        shards = {b.shard.data_ptr() for b in dbuffers(model)}
        orig = dbuffer_mod.all_gather_into

        def spy(out, inp, **kw):
            copies.append(inp.data_ptr() not in shards)  # the input is a device copy
            return orig(out, inp, **kw)
        dbuffer_mod.all_gather_into = spy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    make_x = _randn(world, 16)
    for s in range(3):
        x = make_x(s)
        _sq(model, micro(x)).backward()
        opt.step()
        _sq(ref, x).backward()
        ref_opt.step()
        if s < 2:
            opt.zero_grad()
            ref_opt.zero_grad()
    on_cpu = all(p.to_local().device.type == "cpu" and p.grad.to_local().device.type == "cpu"
                 for p in model.parameters())
    states_cpu = all(t.to_local().device.type == "cpu" for st in opt.state.values()
                     for t in st.values() if hasattr(t, "to_local"))
    return (full_params(model), {n: p.detach().clone() for n, p in ref.named_parameters()},
            on_cpu and states_cpu, copies)


@pytest.mark.parametrize("impl", IMPLS)
def test_cpu_offload_policy(worlds, impl):
    if impl == "torch" and not torch.accelerator.is_available():
        pytest.skip("torch's FSDP2 CPU offload needs an accelerator (the reference side)")
    got, want, on_cpu, copies = worlds(2).run(_offload_body, impl)[0]
    _close(got, want, impl)
    assert on_cpu
    assert impl == "torch" or (copies and all(copies)), copies


# -- non-floating parameters (an int64 Parameter with requires_grad=False) ------------------------
class _WithCounts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.index = nn.Parameter(torch.tensor([5, 0, 3, 1, 4, 2, 2]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.index.dtype == torch.int64
        return self.lin(x)[:, self.index]


def _int_param_body(impl: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _WithCounts()
    ref = copy.deepcopy(model)
    fs(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))  # no cast of ints
    ref.double()
    x = torch.randn(2 * world, 4)
    model(micro(x).double()).sum().backward()
    ref(x.double()).sum().div(world).backward()
    from torch.distributed.tensor import distribute_tensor

    sd = model.state_dict()
    index = full(sd["index"])
    new = {k: distribute_tensor(torch.flip(full(v), (0,)) if k == "index" else full(v),
                                v.device_mesh, v.placements) for k, v in sd.items()}
    model.load_state_dict(new)
    return (index, full(model.index), full_grads(model)["lin.weight"],
            ref.lin.weight.grad.float())


@pytest.mark.parametrize("impl", IMPLS)
def test_integer_parameters(worlds, impl):
    index, reloaded, grad, ref_grad = worlds(3).run(_int_param_body, impl)[0]
    want = torch.tensor([5, 0, 3, 1, 4, 2, 2])
    assert index.dtype == torch.int64 and torch.equal(index, want)
    assert torch.equal(reloaded, torch.flip(want, (0,)))
    torch.testing.assert_close(grad, ref_grad)


# -- ignored_params: left alone (not sharded, gradients not reduced) ------------------------------
def _ignored_body(impl: str):
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    torch.manual_seed(0)
    model = MLP()
    shard_mlp(impl, model, ignored_params={model.l3.bias})
    plain = not isinstance(model.l3.bias, DTensor) and isinstance(model.l3.weight, DTensor)
    x = torch.randn(2 * world, 16) * (1 + dist.get_rank())
    _sq(model, micro(x)).backward()
    return plain, model.l3.bias.grad.clone()


@pytest.mark.parametrize("impl", IMPLS)
def test_ignored_params(worlds, impl):
    res = worlds(2).run(_ignored_body, impl)
    assert all(plain for plain, _ in res)
    assert not torch.allclose(res[0][1], res[1][1])  # local gradients, not averaged


# -- set_unshard_in_backward(False): a group whose backward needs no parameter values --------------
def _no_unshard_in_backward_body(impl: str):
    from tests.distributed._fsdp2_compat import TiedLM, lm_loss

    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = TiedLM()
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # untie
    ref = copy.deepcopy(model)
    fs(model.emb)
    model.emb.set_unshard_in_backward(False)  # the embedding's backward reads only indices
    fs(model)
    gathers = []
    if impl == "ours":  # count the embedding group's all-gathers during backward
        from lightning_vescale.fsdp import get_state
        from lightning_vescale.fsdp._training_state import in_backward

        for buf in get_state(model.emb).group.buffers.values():
            orig = buf.all_gather

            def spy(async_op=False, _orig=orig):
                gathers.append(in_backward())
                return _orig(async_op=async_op)
            buf.all_gather = spy
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 11, (2 * world, 6), generator=g) for _ in range(3)]
    return (*train_pair(model, ref, 3, lambda s: ids[s], lm_loss), gathers)


@pytest.mark.parametrize("impl", IMPLS)
def test_unshard_in_backward_false(worlds, impl):
    got, want, gathers = worlds(2).run(_no_unshard_in_backward_body, impl)[0]
    _close(got, want, impl)
    assert impl == "torch" or (gathers and not any(gathers)), gathers  # forward only
