"""HSDP: ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh (design note [hsdp] in mesh.py).

The contract checked here, at world 4:

* parameters are DTensors with placements ``(Replicate(), RaggedShard)``; rank ``(i, j)`` holds
  exactly what rank ``j`` of a 1-D run of ``shard_size`` ranks holds (the planner plans for the
  shard dim), and the replicas hold bitwise-equal shards after training;
* training matches single-process training on the global batch (each rank its own micro-batch),
  with torch's AdamW/SGD stepping the DTensors and ``clip_grad_norm_`` (whose norm must equal the
  single-process norm: each element counted once, not once per replica);
* gradient accumulation (``set_requires_gradient_sync``), mixed precision, frozen parameters and
  a tied (list) group work; shapes ``(2, 2)`` and ``(4, 1)`` (replication only) alike;
* bad meshes and unsupported FSDP2 switches fail with clear errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate

from tests.distributed._fully_shard_helpers import (
    OPTS,
    batches,
    build,
    micro,
    train_against_reference,
)


def _mesh(replicas: int):
    from lightning_vescale.mesh import init_mesh

    return init_mesh("cpu", replicas=replicas)


def _shard(model: nn.Module, mesh, **kw) -> nn.Module:
    from lightning_vescale.fsdp import fully_shard

    if hasattr(model, "blocks"):
        for b in model.blocks:
            fully_shard(b, mesh=mesh, **kw)
    else:
        fully_shard(model.l1, mesh=mesh, **kw)
        fully_shard(model.l2, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _full_from_shard_group(per_rank: list[dict], shard_size: int, replica: int) -> dict:
    """Concatenate the locals of one replica's shard group (rank-ordered ragged ranges)."""
    ranks = per_rank[replica * shard_size:(replica + 1) * shard_size]
    return {n: torch.cat([r[n].reshape(-1) for r in ranks]) for n in ranks[0]}


# -- parity with single-process training ---------------------------------------------------------
def _parity_body(kind: str, opt_kind: str, replicas: int, steps: int = 3, clip: float = 0.5):
    mesh = _mesh(replicas)
    model = build(kind)
    ref = copy.deepcopy(model)
    _shard(model, mesh)
    cls, kw = OPTS[opt_kind]
    opt, ref_opt = cls(model.parameters(), **kw), cls(ref.parameters(), **kw)
    losses, ref_losses, norms, ref_norms = train_against_reference(
        model, ref, opt, ref_opt, kind, steps, clip=clip)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
    ref_full = {n: p.detach().reshape(-1).clone() for n, p in ref.named_parameters()}
    return (losses, ref_losses, norms, ref_norms, _locals(model), ref_full, placements,
            mesh.size(1))


def _check_parity(results, *, rtol=1e-4, atol=1e-4) -> None:
    losses, ref_losses, norms, ref_norms, _, ref_full, placements, shard_size = results[0]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
    for a, b in zip(norms, ref_norms):  # each element counted once, not once per replica
        assert abs(a - b) <= 1e-5 * abs(b), (norms, ref_norms)
    per_rank = [r[4] for r in results]
    replicas = len(results) // shard_size
    got = _full_from_shard_group(per_rank, shard_size, 0)
    for n, want in ref_full.items():
        torch.testing.assert_close(got[n], want, rtol=rtol, atol=atol, msg=n)
    for i in range(1, replicas):  # replicas compute the same step on the same shards
        other = _full_from_shard_group(per_rank, shard_size, i)
        for n in got:
            assert torch.equal(got[n], other[n]), (i, n)
    if replicas > 1:
        for n, pl in placements.items():
            assert len(pl) == 2 and pl[0] == Replicate(), (n, pl)
            assert type(pl[1]).__name__ == "RaggedShard", (n, pl)


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("kind,opt_kind", [("gpt", "adamw"), ("mlp", "sgd")])
def test_hsdp_matches_single_process(worlds, replicas, kind, opt_kind):
    results = worlds(4).run(_parity_body, kind, opt_kind, replicas)
    _check_parity(results)


# -- data layout: rank (i, j) holds rank j's part of a 1-D plan for the shard size ----------------
def _layout_body():
    from lightning_vescale.fsdp import param_fqn_map
    from lightning_vescale.placement import local_slice

    mesh = _mesh(2)
    model = build("mlp")
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    _shard(model, mesh)
    j = mesh.get_local_rank(1)
    out = {}
    for fqn, (group, mp) in param_fqn_map(model).items():
        p = dict(model.named_parameters())[fqn]
        ragged = p.placements[1]
        out[fqn] = (mp.buffer.plan.world_size,
                    torch.equal(p.to_local(), local_slice(full[fqn], ragged, j)),
                    group.mesh_info.is_hsdp, group.mesh_info.shard_size)
    return out


def test_hsdp_layout_is_the_shard_groups_1d_layout(worlds):
    for out in worlds(4).run(_layout_body):
        for fqn, (plan_world, same, is_hsdp, shard_size) in out.items():
            assert plan_world == shard_size == 2, fqn
            assert same and is_hsdp, fqn


# -- accumulation, mixed precision, frozen and tied parameters ----------------------------------
class _Tied(nn.Module):
    """An embedding and a head that share one weight (a tied list group), plus a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.l1 = nn.Linear(6, 6)
        self.l2 = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight
        self.l2.requires_grad_(False)

    def forward(self, x, y):
        h = torch.tanh(self.l2(torch.tanh(self.l1(self.emb(x)))))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _tied_data(steps, batch):
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 11, (batch, 5), generator=g),
             torch.randint(0, 11, (batch, 5), generator=g)) for _ in range(steps)]


def _features_body(replicas: int, mixed: bool):
    from lightning_vescale.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = _mesh(replicas)
    torch.manual_seed(0)
    model = _Tied()
    ref = copy.deepcopy(model)
    kw = {}
    if mixed:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    fully_shard(model.l1, mesh=mesh, **kw)
    fully_shard(model.l2, mesh=mesh, **kw)
    fully_shard([model.emb, model.head], mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    losses, ref_losses = [], []
    for x, y in _tied_data(3, 4 * world):
        halves = [(micro(x, rank, world)[:2], micro(y, rank, world)[:2]),
                  (micro(x, rank, world)[2:], micro(y, rank, world)[2:])]
        total = 0.0
        for k, (xb, yb) in enumerate(halves):  # two micro-batches, sync on the last only
            model.set_requires_gradient_sync(k == len(halves) - 1)
            loss = model(xb, yb) / len(halves)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        t = torch.tensor(total)
        dist.all_reduce(t)
        losses.append(t.item() / world)
        rl = ref(x, y)
        rl.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(rl.item())
    tied = model.emb.weight is model.head.weight
    frozen_grad = [p.grad for p in model.l2.parameters()]
    ref_full = {n: p.detach().reshape(-1).clone() for n, p in ref.named_parameters()}
    return (losses, ref_losses, _locals(model), ref_full, tied,
            all(g is None for g in frozen_grad), mesh.size(1))


@pytest.mark.parametrize("mixed", [False, True])
def test_hsdp_accumulation_frozen_tied_and_mixed_precision(worlds, mixed):
    results = worlds(4).run(_features_body, 2, mixed)
    losses, ref_losses, _, ref_full, tied, frozen_ok, shard_size = results[0]
    assert tied and frozen_ok
    tol = 2e-2 if mixed else 1e-5  # bf16 compute against an fp32 reference
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= tol * abs(b), (losses, ref_losses)
    per_rank = [r[2] for r in results]
    got = _full_from_shard_group(per_rank, shard_size, 0)
    other = _full_from_shard_group(per_rank, shard_size, 1)
    for n, want in ref_full.items():
        assert torch.equal(got[n], other[n]), n
        torch.testing.assert_close(got[n], want, rtol=5e-2 if mixed else 1e-4,
                                   atol=5e-3 if mixed else 1e-4, msg=n)


# -- errors ----------------------------------------------------------------------------------
def _errors_body():
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale.fsdp import fully_shard
    from lightning_vescale.mesh import init_mesh

    out = {}
    mesh3 = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c"))
    try:
        fully_shard(nn.Linear(2, 2), mesh=mesh3)
        out["3d"] = "no error"
    except ValueError as e:
        out["3d"] = str(e)
    try:
        init_mesh("cpu", replicas=3)
        out["replicas"] = "no error"
    except ValueError as e:
        out["replicas"] = str(e)
    model = fully_shard(nn.Linear(2, 2), mesh=init_mesh("cpu", replicas=2))
    model.set_requires_all_reduce(False)  # supported since issue 35: accumulation, FSDP2's
    try:
        model.set_requires_all_reduce("no")
        out["all_reduce"] = "no error"
    except TypeError as e:
        out["all_reduce"] = str(e)
    model.set_requires_all_reduce(True)
    return out


def test_hsdp_errors(worlds):
    out = worlds(4).run(_errors_body)[0]
    assert "3-D mesh" in out["3d"] and "dp_replicate" in out["3d"], out["3d"]
    assert "replicas=3" in out["replicas"] and "world size 4" in out["replicas"], out
    assert "requires_all_reduce" in out["all_reduce"], out


# -- room for a tensor-parallel dim: the DP mesh is a sub-mesh, not the whole world -------------
def _tp_room_body():
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale.fsdp import fully_shard

    world_mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard",
                                                                     "tp"))
    dp = world_mesh["dp_replicate", "dp_shard"]  # 2 data-parallel ranks per "tp" coordinate
    dp_rank, dp_size = dp.get_local_rank(1), dp.size(1)
    model = build("mlp")
    ref = copy.deepcopy(model)
    fully_shard(model.l1, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches("mlp", 2, 2 * dp_size):  # data differs along dp only
        model(micro(x, dp_rank, dp_size), micro(y, dp_rank, dp_size)).backward()
        opt.step()
        opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return {n: (p.to_local().detach().clone(), dp_rank,
                q.detach().reshape(-1).clone())
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())}


def test_hsdp_on_a_data_parallel_sub_mesh(worlds):
    """A (dp_replicate, dp_shard, tp) world mesh: fully_shard on the DP sub-mesh trains each tp
    coordinate's copy like single-process training (no collective spans the tp dim)."""
    results = worlds(4).run(_tp_room_body)
    # tp is the last mesh dim, so world ranks 0 and 2 form one DP group (tp=0), 1 and 3 the
    # other (tp=1).
    for group in ((0, 2), (1, 3)):
        for n, (_, _, want) in results[group[0]].items():
            pieces = sorted((results[r][n][1], results[r][n][0]) for r in group)
            got = torch.cat([t.reshape(-1) for _, t in pieces])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=n)


# -- meta-device init -----------------------------------------------------------------------
def _meta_body():
    from lightning_vescale.fsdp import materialize

    mesh = _mesh(2)
    with torch.device("meta"):
        meta = build("gpt")
    _shard(meta, mesh)
    torch.manual_seed(0)
    materialize(meta, torch.device("cpu"))  # default init: reset_parameters(), group by group
    ref = build("gpt")
    torch.manual_seed(0)
    for m in ref.modules():  # the same calls in the same order on a plain model
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    ref_full = {n: p.detach().reshape(-1).clone() for n, p in ref.named_parameters()}
    return _locals(meta), ref_full, mesh.size(1)


def test_hsdp_meta_device_init_is_exact_on_every_replica(worlds):
    results = worlds(4).run(_meta_body)
    _, ref_full, shard_size = results[0]
    per_rank = [r[0] for r in results]
    for replica in (0, 1):
        got = _full_from_shard_group(per_rank, shard_size, replica)
        assert set(got) == set(ref_full)
        for n, want in ref_full.items():
            assert torch.equal(got[n], want), (replica, n)


# -- FSDP2 options on HSDP: CPU offload, divide factor, no reshard, compiled blocks ---------------
def _options_body(variant: str):
    from lightning_vescale.fsdp import CPUOffloadPolicy, fully_shard
    from lightning_vescale.sharding_summary import sharding_summary

    world = dist.get_world_size()
    mesh = _mesh(2)
    model = build("gpt")
    ref = copy.deepcopy(model)
    kw = {"offload_policy": CPUOffloadPolicy()} if variant == "offload" else {}
    if variant == "no_reshard":
        kw["reshard_after_forward"] = False
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
        if variant == "compile":
            b.compile()
    fully_shard(model, mesh=mesh, **kw)
    if variant == "divide":  # a sum over all 4 data-parallel ranks, divided by 4: the mean
        model.set_gradient_divide_factor(float(world))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses, ref_losses, _, _ = train_against_reference(model, ref, opt, ref_opt, "gpt", 2)
    ref_full = {n: p.detach().reshape(-1).clone() for n, p in ref.named_parameters()}
    return losses, ref_losses, _locals(model), ref_full, str(sharding_summary(model))


@pytest.mark.parametrize("variant", ["offload", "divide", "no_reshard",
                                     pytest.param("compile", marks=pytest.mark.slow)])
def test_hsdp_with_fsdp2_options(worlds, variant):
    results = worlds(4).run(_options_body, variant)
    losses, ref_losses, _, ref_full, summary = results[0]
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (variant, losses, ref_losses)
    got = _full_from_shard_group([r[2] for r in results], 2, 0)
    for n, want in ref_full.items():
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-4, msg=n)
    assert "per shard-group rank, x2 replicas (r0 | r1)" in summary, summary
