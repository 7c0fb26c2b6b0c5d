"""FSDP2 behaviours that crashed (issue 15, items 5-7), each on torch's FSDP2 and on ours:
dataclass outputs between sharded modules, ``set_model_state_dict`` from a rank-0 full state
dict, and ordinary DTensor ops on the sharded parameters (random init, ``distribute_tensor``,
reductions with ``dim=``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fsdp2_compat import IMPLS, MLP, full_grads, fully_shard_of, micro


# -- 5. dataclass (and nested dataclass) outputs between sharded modules ---------------------------
@dataclasses.dataclass
class _Aux:
    gate: torch.Tensor
    note: str = "aux"


@dataclasses.dataclass
class _Out:
    h: torch.Tensor
    aux: _Aux
    extra: list


class _DCBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)

    def forward(self, x: torch.Tensor | _Out) -> _Out:
        h = x.h * torch.sigmoid(x.aux.gate) if isinstance(x, _Out) else x
        return _Out(h=torch.tanh(self.lin(h)), aux=_Aux(gate=self.gate(h)),
                    extra=[self.lin.bias.sum()])


class _DCModel(nn.Module):
    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_DCBlock(d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for b in self.blocks:
            out = b(out)
        return out.h.square().mean() + out.aux.gate.mean() + out.extra[0]


def _dataclass_body(impl: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _DCModel()
    ref = copy.deepcopy(model)
    mp = MixedPrecisionPolicy(output_dtype=torch.float32)  # casts walk the dataclasses too
    for b in model.blocks:
        fs(b, mp_policy=mp)
    fs(model)
    x = torch.randn(2 * world, 6)
    for _ in range(2):  # the second iteration runs with prefetching
        model.zero_grad()
        model(micro(x)).backward()
    ref(x).backward()  # the mean over ranks of the per-rank loss's gradient = the global one
    return full_grads(model), {n: p.grad.clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("impl", IMPLS)
def test_dataclass_outputs_between_sharded_modules(worlds, impl):
    got, want = worlds(2).run(_dataclass_body, impl)[0]
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{impl} {n}")


# -- 6. set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True) ----------------------
def _load_full_body(impl: str, broadcast: bool):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from tests.distributed._fsdp2_compat import full_params, shard_mlp

    rank = dist.get_rank()
    torch.manual_seed(1)
    pretrained = MLP()  # the "checkpoint"
    torch.manual_seed(0)
    model = MLP()
    shard_mlp(impl, model)
    if broadcast:  # rank 0 alone holds the full state dict, the others pass an empty one
        full_sd = pretrained.state_dict() if rank == 0 else {}
    else:
        full_sd = pretrained.state_dict()
    set_model_state_dict(model, full_sd, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast))
    loaded = full_params(model)
    back = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return loaded, back, {n: p.detach().clone() for n, p in pretrained.named_parameters()}


@pytest.mark.parametrize("broadcast", [True, False])
@pytest.mark.parametrize("impl", IMPLS)
def test_set_model_state_dict_from_a_full_state_dict(worlds, impl, broadcast):
    for r, (loaded, back, want) in enumerate(worlds(3).run(_load_full_body, impl, broadcast)):
        for n in want:
            assert torch.equal(loaded[n], want[n]), (impl, n)
            if r == 0:  # get_model_state_dict(full_state_dict=True) round-trips on rank 0
                assert torch.equal(back[n], want[n]), (impl, n)


# -- 7a. in-place random init of sharded parameters: FSDP2's meta-device flow ---------------------
class _InitModel(nn.Module):
    """Linears (kaiming_uniform_), an embedding (normal_), a LayerNorm (ones/zeros) and a custom
    init (trunc_normal_, xavier_uniform_, constant_, zeros_)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(13, 8)
        self.l1 = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(24)
        self.l2 = nn.Linear(24, 5)
        self.extra = nn.Parameter(torch.empty(7, 3))

    def init_weights(self) -> None:
        for m in self.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        with torch.no_grad():
            nn.init.trunc_normal_(self.l1.weight, std=0.02, a=-0.04, b=0.04)
            nn.init.xavier_uniform_(self.l2.weight)
            nn.init.constant_(self.l2.bias, 0.1)
            nn.init.normal_(self.extra, mean=1.0, std=2.0)
            self.extra.uniform_(-1, 1, generator=torch.Generator().manual_seed(5))
            self.emb.weight.bernoulli_(0.3)
            self.emb.weight.mul_(torch.rand_like(self.emb.weight))


def _meta_init_body(impl: str):
    from tests.distributed._fsdp2_compat import full_params

    fs = fully_shard_of(impl)
    torch.manual_seed(0)
    ref = _InitModel()
    torch.manual_seed(123)
    ref.init_weights()
    ref_state = torch.get_rng_state()
    with torch.device("meta"):
        model = _InitModel()
    fs(model.l1)
    fs(model.l2)
    fs(model)
    model.to_empty(device="cpu")
    torch.manual_seed(123)
    model.init_weights()
    same_rng = torch.equal(torch.get_rng_state(), ref_state)
    got = full_params(model)
    return ({n: torch.equal(got[n], p) for n, p in ref.named_parameters()}, same_rng)


def test_meta_init_gives_single_device_values(worlds):
    for equal, same_rng in worlds(3).run(_meta_init_body, "ours"):
        assert all(equal.values()), equal
        assert same_rng  # the generator advanced exactly as on one device


def test_fsdp2_meta_init_on_cpu_differs_from_single_device(worlds):
    # The reference side, measured: torch's FSDP2 runs the same flow on CPU, but without an RNG
    # tracker each rank draws its local numel from the same stream (design note [ragged-random]).
    for equal, same_rng in worlds(3).run(_meta_init_body, "torch"):
        assert not all(equal.values()) and not same_rng


# -- 7b. distribute_tensor(full, mesh, param.placements) -------------------------------------------
def _distribute_body(impl: str):
    from torch.distributed.tensor import distribute_tensor

    from tests.distributed._fsdp2_compat import shard_mlp

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = shard_mlp(impl, MLP())
    out = {}
    for n, p in model.named_parameters():
        full = torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) + 100 * rank
        dt = distribute_tensor(full, p.device_mesh, p.placements)  # rank 0's data (src)
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        with torch.no_grad():
            p.copy_(dt)  # the FSDP2 way to load one full tensor into a sharded parameter
        out[n] = (dt.placements == p.placements, dt.full_tensor(), p.full_tensor(),
                  torch.equal(local.to_local(), p.to_local() + 100 * rank),
                  torch.equal(full, torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape)
                              + 100 * rank))
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_distribute_tensor_with_the_parameters_placements(worlds, impl):
    for res in worlds(3).run(_distribute_body, impl):
        for n, (same_placement, dt_full, p_full, local_ok, input_kept) in res.items():
            want = torch.arange(dt_full.numel(), dtype=dt_full.dtype).reshape(dt_full.shape)
            assert same_placement and local_ok and input_kept, (impl, n)
            assert torch.equal(dt_full, want) and torch.equal(p_full, want), (impl, n)


# -- 7c. reductions with dim= ---------------------------------------------------------------------
def _dim_reductions_body(impl: str):
    from tests.distributed._fsdp2_compat import full, shard_mlp

    torch.manual_seed(0)
    model = shard_mlp(impl, MLP(d_in=5, d_hidden=7, d_out=3))
    w = model.l2.weight  # 7 x 7: rows straddle ranks
    b = model.l2.bias
    cases = {
        "norm_dim1": lambda t: torch.linalg.vector_norm(t, dim=1),
        "norm_dim0_keep": lambda t: torch.linalg.vector_norm(t, 3.0, dim=0, keepdim=True),
        "norm_inf_dim1": lambda t: torch.linalg.vector_norm(t, float("inf"), dim=1),
        "norm_l1_dim0": lambda t: torch.linalg.vector_norm(t, 1, dim=0),
        "norm_dim1_f64": lambda t: torch.linalg.vector_norm(t, dim=1, dtype=torch.float64),
        "sum_dim0": lambda t: t.sum(dim=0),
        "mean_dim1_keep": lambda t: t.mean(dim=1, keepdim=True),
        "amax_dim1": lambda t: t.amax(dim=1),
        "amin_dim0": lambda t: t.amin(dim=0),
        "norm_all_dims": lambda t: torch.linalg.vector_norm(t, dim=(0, 1)),
        "torch_norm_dim1": lambda t: torch.norm(t, dim=1),
    }
    with torch.no_grad():
        dense = w.full_tensor()
        out = {k: (full(f(w)), f(dense)) for k, f in cases.items()}
        out["bias_norm_dim0"] = (full(torch.linalg.vector_norm(b, dim=0)),
                                 torch.linalg.vector_norm(b.full_tensor(), dim=0))
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_reductions_with_dim(worlds, impl):
    for res in worlds(3).run(_dim_reductions_body, impl):
        for k, (got, want) in res.items():
            assert got.shape == want.shape and got.dtype == want.dtype, (impl, k)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{impl} {k}")
