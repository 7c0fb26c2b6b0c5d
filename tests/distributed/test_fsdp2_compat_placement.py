"""FSDP2's ``shard_placement_fn`` and ``dp_mesh_dims`` (issue 33: torchtitan passes both), each
case run on torch's FSDP2 and on ours against a single process (design note
[fsdp-shard-placement]); refusals and the layout they give on our side."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from tests.distributed._fsdp2_compat import (
    IMPLS,
    MLP,
    expect_raises,
    fully_shard_of,
    train_pair,
)


def _xs(d: int):
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2 * world, d, generator=g) for _ in range(3)]
    return lambda s: xs[s]


def _sq(model, x):
    return model(x).square().mean()


def _close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{what} {n}")


def _granularities(model: nn.Module) -> dict[str, int]:
    from lightning_vescale.fsdp import iter_param_groups

    return {f"{prefix}.{n}" if prefix else n: g for prefix, group in iter_param_groups(model)
            for n, g in group.granularity.items()}


# -- FSDP2's test_train_parity_shard_placement_fn_shard_largest_dim -----------------------------
def _largest_dim_body(impl: str, how: str):
    torch.manual_seed(0)
    model = MLP(16, 32, 8)
    ref = copy.deepcopy(model)

    def largest_dim(p: nn.Parameter):
        if how == "none":
            return None
        return Shard(max(range(p.ndim), key=lambda d: p.shape[d]))

    fs = fully_shard_of(impl)
    for m in (model.l1, model.l2, model.l3):
        fs(m, shard_placement_fn=largest_dim)
    fs(model, shard_placement_fn=largest_dim)
    got, want = train_pair(model, ref, 3, _xs(16), _sq)
    return got, want, _granularities(model) if impl == "ours" else None


@pytest.mark.parametrize("how", ["largest_dim", "none"])
@pytest.mark.parametrize("impl", IMPLS)
def test_shard_placement_fn_trains_like_one_process(worlds, impl, how):
    got, want, grans = worlds(2).run(_largest_dim_body, impl, how)[0]
    _close(got, want, f"{impl} {how}")
    if impl == "ours":  # Shard(d) keeps prod(shape[d+1:]) elements whole; None: the default
        expect = {"l1.weight": 16, "l2.weight": 32, "l3.weight": 1} if how == "largest_dim" \
            else {"l1.weight": 1, "l2.weight": 1, "l3.weight": 1}
        assert {n: grans[n] for n in expect} == expect, grans


# -- torchtitan's MoE rule: Shard(1) for an (E, out, in) expert stack with fewer experts than ranks
class _Experts(nn.Module):
    """torchtitan's ``GroupedExperts`` shape: ``(E, out, in)`` stacks, every expert applied."""

    def __init__(self, experts: int = 2, dim: int = 6, hidden: int = 9) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.3)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.3)
        self.router = nn.Linear(dim, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.router(x), dim=-1)
        h = torch.einsum("bd,ehd->beh", x, self.w1).relu()
        return torch.einsum("beh,edh,be->bd", h, self.w2, gate)


def _experts_body(impl: str):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _Experts()
    ref = copy.deepcopy(model)
    expert_params = {model.w1, model.w2}
    num_experts = model.w1.shape[0]

    def placement(p: nn.Parameter):  # torchtitan.distributed.fsdp.apply_fsdp_to_decoder
        if p in expert_params and world > num_experts:
            return Shard(1)
        return None

    fully_shard_of(impl)(model, shard_placement_fn=placement)
    got, want = train_pair(model, ref, 3, _xs(6), _sq)
    return got, want, _granularities(model) if impl == "ours" else None


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_stack_shard1_like_torchtitan(worlds, impl):
    got, want, grans = worlds(3).run(_experts_body, impl)[0]
    _close(got, want, impl)
    if impl == "ours":  # Shard(1) of (E, out, in) keeps each expert's rows (`in` elements) whole
        assert grans["w1"] == 6 and grans["w2"] == 9 and grans["router.weight"] == 1, grans


# -- a mesh of its own (expert parallelism's ShardPlacementResult; design note [fsdp-param-mesh])
def _own_mesh_body(impl: str):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    other = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"),
                         shard_mesh_dim=0)
    torch.manual_seed(0)
    model = _Experts()
    ref = copy.deepcopy(model)
    experts = {model.w1, model.w2}

    def placement(p: nn.Parameter):  # the experts on their own mesh, FSDP2's per-param mesh
        return ShardPlacementResult(placement=Shard(0), mesh_info=other) if p in experts \
            else None

    fully_shard_of(impl)(model, mesh=mesh, shard_placement_fn=placement)
    on_other = model.w1.device_mesh is other.mesh and model.router.weight.device_mesh is mesh
    got, want = train_pair(model, ref, 3, _xs(6), _sq)
    return got, want, on_other


@pytest.mark.parametrize("impl", IMPLS)
def test_parameters_on_a_mesh_of_their_own_train_like_one_process(worlds, impl):
    """Before design note [fsdp-param-mesh] ours refused the experts' mesh."""
    got, want, on_other = worlds(2).run(_own_mesh_body, impl)[0]
    _close(got, want, impl)
    assert on_other


# -- what cannot be expressed is refused, naming the parameter ----------------------------------
def _refusals_body():
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    from lightning_vescale.fsdp import CommPolicy, fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    other = DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu")  # its own group
    own, foreign = FSDPMeshInfo(mesh, shard_mesh_dim=0), FSDPMeshInfo(other, shard_mesh_dim=0)
    # an HSDP mesh of its own (replicas 2 x shard 1) in a group whose mesh does not replicate
    hsdp = HSDPMeshInfo(init_device_mesh("cpu", (world, 1), mesh_dim_names=("r", "s")),
                        shard_mesh_dim=1, replicate_mesh_dim=0)
    # a 2-D mesh info whose dims are swapped (FSDP2 allows it; ours reads (replicate, shard))
    swapped = HSDPMeshInfo(init_device_mesh("cpu", (1, world), mesh_dim_names=("s2", "r2")),
                           shard_mesh_dim=0, replicate_mesh_dim=1)
    out = {
        "bad_dim": expect_raises(lambda: fully_shard(nn.Linear(4, 4), mesh=mesh,
                                                     shard_placement_fn=lambda p: Shard(2)),
                                 ValueError, "'weight'", "no dim 2"),
        "replicate": expect_raises(lambda: fully_shard(nn.Linear(4, 4), mesh=mesh,
                                                       shard_placement_fn=lambda p: Replicate()),
                                   ValueError, "'weight'", "Replicate"),
        # a mesh of its own (design note [fsdp-param-mesh]): HSDP beside a non-replicating
        # group, a (shard, replicate) layout, and comm_policy refused
        "foreign_hsdp": expect_raises(
            lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p:
                                ShardPlacementResult(placement=Shard(0), mesh_info=hsdp)),
            NotImplementedError, "'weight'", "HSDP mesh of its own", "replicate both"),
        "foreign_swapped": expect_raises(
            lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, shard_placement_fn=lambda p:
                                ShardPlacementResult(placement=Shard(0), mesh_info=swapped)),
            NotImplementedError, "'weight'", "shard_mesh_dim=1, replicate_mesh_dim=0"),
        "foreign_comm": expect_raises(
            lambda: fully_shard(nn.Linear(4, 4), mesh=mesh, comm_policy=CommPolicy(
                all_gather="int8"), shard_placement_fn=lambda p:
                ShardPlacementResult(placement=Shard(0), mesh_info=foreign)),
            NotImplementedError, "'bias'", "comm_policy", "mesh of their own"),
        "ep_on_dense": expect_raises(lambda: _ep_experts_on_dense_mesh(world), ValueError,
                                     "'w'", "shares ranks", "efsdp"),
    }
    lin = nn.Linear(4, 6)
    fully_shard(lin, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(
        placement=Shard(0), mesh_info=foreign if p.ndim == 2 else own))
    from lightning_vescale.fsdp import iter_param_groups

    (_, group), = iter_param_groups(lin)
    out["foreign_mesh"] = (lin.weight.device_mesh is other and lin.bias.device_mesh is mesh
                           and any("mesh" in k for k in group.buffers) and len(group.buffers) == 2
                           or (lin.weight.device_mesh, list(group.buffers)))
    lin = nn.Linear(4, 6)
    fully_shard(lin, mesh=mesh, shard_placement_fn=lambda p:
                ShardPlacementResult(placement=Shard(0) if p.ndim == 2 else None, mesh_info=own))
    out["own_mesh"] = _granularities(lin) == {"weight": 4, "bias": 1} or _granularities(lin)
    return out


def _ep_experts_on_dense_mesh(world: int) -> None:
    """Expert DTensors on "ep" handed to fully_shard on the dense mesh, which holds the same
    ranks (torchtitan's flow without its shard_placement_fn)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from lightning_vescale.fsdp import fully_shard

    root = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
    dense = root._unflatten(0, (world,), ("fsdp",))
    sparse = root._unflatten(0, (1, world), ("efsdp", "ep"))
    m = nn.Module()
    m.w = nn.Parameter(distribute_tensor(torch.randn(2 * world, 3), sparse["ep"], [Shard(0)]))
    m.forward = lambda x: x
    fully_shard(m, mesh=dense["fsdp"])


def test_shard_placement_refusals_name_the_parameter(worlds):
    out = worlds(2).run(_refusals_body)[0]
    bad = {k: v for k, v in out.items() if v is not None and v is not True}
    assert not bad, bad


# -- dp_mesh_dims: the full SPMD mesh, its data-parallel dims named -------------------------------
def _dp_mesh_dims_body(impl: str, dims: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    if dims == "flatten":  # torchtitan's full_dtensor: dp_shard and cp flattened into one
        mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("dp_shard", "cp", "tp"))
        dp = DataParallelMeshDims(shard=("dp_shard", "cp"))
    else:
        mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("rep", "dp", "tp"))
        dp = DataParallelMeshDims(shard="dp", replicate="rep")
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    for m in model.modules():  # FSDP2's contract: DTensors on the SPMD mesh, Replicate on DP
        for name, p in list(m._parameters.items()):
            m._parameters[name] = nn.Parameter(
                DTensor.from_local(p.detach(), mesh, [Replicate()] * mesh.ndim))
    fs = fully_shard_of(impl)
    for m in (model.l1, model.l2, model.l3):
        fs(m, mesh=mesh, dp_mesh_dims=dp)
    fs(model, mesh=mesh, dp_mesh_dims=dp)
    if impl == "ours":  # the unsharded parameters are plain tensors (the other dims have size 1)
        return train_pair(model, ref, 3, _xs(16), _sq)
    # FSDP2 computes on DTensors of the SPMD mesh: the batch is Shard(0) on the DP dims
    batch = [Shard(0) if n in ("dp_shard", "dp") else Replicate() for n in mesh.mesh_dim_names]

    def dtensor_sq(m, x):
        if m is ref:
            return _sq(m, x)
        return m(DTensor.from_local(x, mesh, batch)).to_local().square().mean()

    return train_pair(model, ref, 3, _xs(16), dtensor_sq)


@pytest.mark.parametrize("dims", ["flatten", "hsdp"])
@pytest.mark.parametrize("impl", IMPLS)
def test_dp_mesh_dims_like_fsdp2(worlds, impl, dims):
    got, want = worlds(2).run(_dp_mesh_dims_body, impl, dims)[0]
    _close(got, want, f"{impl} {dims}")


def _dp_mesh_dims_refusals_body():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims

    from lightning_vescale.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    return {
        "wide_tp": expect_raises(
            lambda: fully_shard(nn.Linear(4, 4), mesh=mesh,
                                dp_mesh_dims=DataParallelMeshDims(shard="dp")),
            ValueError, "('tp', 2)"),
        "ddp_only": expect_raises(
            lambda: fully_shard(nn.Linear(4, 4), mesh=mesh,
                                dp_mesh_dims=DataParallelMeshDims(replicate="tp")),
            NotImplementedError, "no shard dim"),
        "unknown": expect_raises(
            lambda: fully_shard(nn.Linear(4, 4), mesh=mesh,
                                dp_mesh_dims=DataParallelMeshDims(shard="fsdp")),
            ValueError, "['fsdp']"),
    }


def test_dp_mesh_dims_refusals(worlds):
    out = worlds(2).run(_dp_mesh_dims_refusals_body)[0]
    bad = {k: v for k, v in out.items() if v is not None}
    assert not bad, bad
