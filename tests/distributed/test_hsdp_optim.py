"""Optimizers on HSDP meshes: ``(Replicate(), RaggedShard)`` parameters step like 1-D ones.

On a 2-D ``(replicate, shard)`` mesh (design note [hsdp] in ``lightning_vescale.mesh``) rank
``(i, j)`` holds the data of rank ``j`` of a 1-D run with ``shard_size`` ranks, and after the
engine's cross-replica all-reduce every replica has the same gradient shards. So an optimizer
step must (a) give each rank exactly the slice a single process computes, (b) keep the replicas
identical, and (c) for Muon, gather each matrix to an owner *inside the shard group* (each
replica runs all Newton–Schulz work once; nothing crosses replicas).

Every rank builds the same full parameters and per-step full gradients from a seed (the
gradients an all-reduce over the whole data-parallel world would give), shards them on the mesh
under test, steps, and compares its local slices with a single-process run of the same optimizer
on the full tensors (computed on the same rank). The meshes: HSDP ``(2, 2)``, pure replication
``(4, 1)``, a 2-D mesh with one replica ``(1, 4)``, and the 1-D mesh of the same world size.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from lightning_vescale.mesh import MeshInfo
from lightning_vescale.optim import AdamW8bit, Muon, newton_schulz_flops
from lightning_vescale.placement import RaggedShard, local_slice, ragged_from_local

B = 256  # AdamW8bit's default block size: element cuts fall on multiples of it
# quantized (>= 4096 elements): a Muon matrix too; fp32-state 1-D; a small Muon matrix; quantized
SHAPES = {"a.weight": (64, 64), "b.bias": (300,), "c.weight": (16, 24), "d.weight": (8, 1024)}
MESHES = [(2, 2), (4, 1), (1, 4), (4,)]
MESH_IDS = ["hsdp-2x2", "replicate-4x1", "2d-1x4", "fsdp-1d-4"]


def _placement(shape: tuple[int, ...], shard_size: int, seed: int) -> RaggedShard:
    """Uneven element cuts on multiples of ``B`` (the tensor's end last; some ranks may be
    empty), the same on every rank and every replica."""
    numel = math.prod(shape)
    g = torch.Generator().manual_seed(seed)
    inner = sorted(int(x) * B for x in torch.randint(0, numel // B + 1, (shard_size - 1,),
                                                       generator=g))
    cuts = [0, *inner, numel]
    return RaggedShard(tuple(range(len(shape))), [b - a for a, b in zip(cuts, cuts[1:])])


def _mesh(shape: tuple[int, ...]):
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp_shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _full_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _full_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _make_opt(kind: str, params: list[tuple[str, torch.Tensor]]):
    tensors = [p for _, p in params]
    if kind == "adamw8bit":
        return AdamW8bit(tensors, lr=1e-2, weight_decay=0.1)
    if kind == "muon":
        return Muon(params, lr=0.02, weight_decay=0.1, adamw_lr=3e-3)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(tensors, lr=1e-2, weight_decay=0.1, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(tensors, lr=1e-2, weight_decay=0.1, fused=True)
    raise AssertionError(kind)


def _run(kind: str, mesh_shape: tuple[int, ...] | None, steps: int):
    """``steps`` steps of ``kind``; returns ({name: this rank's flat slice}, optimizer, layouts).

    ``mesh_shape=None``: single process on the full tensors (the reference)."""
    full = _full_params()
    info = None if mesh_shape is None else MeshInfo.from_mesh(_mesh(mesh_shape))
    layouts = {n: _placement(s, info.shard_size, i) for i, (n, s) in enumerate(SHAPES.items())
               } if info is not None else {}

    def shard(n: str, t: torch.Tensor) -> torch.Tensor:
        if info is None:
            return t.clone()
        local = local_slice(t, layouts[n], info.shard_rank).clone()
        return ragged_from_local(local, info.mesh, info.placements(layouts[n]), SHAPES[n])

    params = {n: torch.nn.Parameter(shard(n, t)) for n, t in full.items()}
    opt = _make_opt(kind, list(params.items()))
    for step in range(steps):
        for n, g in _full_grads(step).items():
            params[n].grad = shard(n, g)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = {n: (p.detach().to_local() if info is not None else p.detach()).reshape(-1).clone()
           for n, p in params.items()}
    return out, opt, layouts, info


def _body(kind: str, steps: int):
    """Per mesh: does every local slice equal the reference's, bitwise; the local slices (for
    the replica comparison); Muon's NS FLOPs and bytes sent on this rank."""
    ref, _, _, _ = _run(kind, None, steps)
    results = {}
    for shape in MESHES:
        got, opt, layouts, info = _run(kind, shape, steps)
        equal = {}
        for n, s in SHAPES.items():
            a, b = layouts[n].local_range(s, info.shard_rank)
            equal[n] = bool(torch.equal(got[n], ref[n][a:b]))
        results[shape] = dict(equal=equal, local=got, coords=(info.replicate_rank,
                                                              info.shard_rank),
                              flops=getattr(opt, "ns_flops", 0),
                              comm=getattr(opt, "comm_bytes", 0))
    return results


@pytest.mark.parametrize("kind", ["adamw8bit", "muon", "adamw-foreach", "adamw-fused"])
def test_hsdp_step_equals_single_process_and_replicas_agree(worlds, kind):
    outs = worlds(4).run(_body, kind, 3)
    for shape in MESHES:
        per_rank = [o[shape] for o in outs]
        for rank, r in enumerate(per_rank):
            bad = [n for n, ok in r["equal"].items() if not ok]
            assert not bad, f"{kind} on mesh {shape}, rank {rank}: {bad} differ from 1 process"
        # replicas of one shard rank hold the same bytes
        by_coord = {}
        for r in per_rank:
            by_coord.setdefault(r["coords"][1], []).append(r["local"])
        for j, copies in by_coord.items():
            for other in copies[1:]:
                assert all(torch.equal(copies[0][n], other[n]) for n in SHAPES), (shape, j)


def test_muon_owners_are_chosen_inside_the_shard_group(worlds):
    """Each replica runs every matrix's Newton–Schulz exactly once (owners inside the shard
    group): total FLOPs = replicas x one run's, replicas do the same work and send the same
    bytes; a shard size of 1 moves nothing."""
    steps = 3
    outs = worlds(4).run(_body, "muon", steps)
    muon = [(s[0], math.prod(s[1:])) for n, s in SHAPES.items() if len(s) >= 2]
    once = steps * sum(newton_schulz_flops(r, c) for r, c in muon)
    for shape in MESHES:
        replicas = shape[0] if len(shape) == 2 else 1
        per_rank = [o[shape] for o in outs]
        assert sum(r["flops"] for r in per_rank) == replicas * once, shape
        by_shard_rank = {}
        for r in per_rank:
            by_shard_rank.setdefault(r["coords"][1], set()).add((r["flops"], r["comm"]))
        assert all(len(v) == 1 for v in by_shard_rank.values()), (shape, by_shard_rank)
        if shape == (4, 1):
            assert all(r["comm"] == 0 for r in per_rank)
        else:
            assert sum(r["comm"] for r in per_rank) > 0


def _process_group_rank_body():
    """The shard group's process-group ranks are the mesh's shard coordinates (Muon's all-to-all
    split sizes are indexed by them)."""
    info = MeshInfo.from_mesh(_mesh((2, 2)))
    return dist.get_rank(info.shard_group), info.shard_rank, dist.get_rank(info.replicate_group)


def test_hsdp_groups_are_what_muon_assumes(worlds):
    outs = worlds(4).run(_process_group_rank_body)
    assert [o[:2] for o in outs] == [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert [o[2] for o in outs] == [0, 0, 1, 1]


# -- through fully_shard: HSDP vs the 1-D mesh of the same world size vs one process --------------
def _engine_opt(kind: str, model: torch.nn.Module):
    if kind == "adamw8bit":
        return AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=1024)
    return Muon(model.named_parameters(), lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


def _engine_body(kind: str, replicas: int | None, steps: int, same_data: bool):
    """GPT under ``fully_shard`` on ``init_mesh(replicas=...)`` (``None``: one process on the
    global batch), ``steps`` steps of ``kind``: this rank's flat local parameters and losses.
    ``same_data``: every rank trains on the whole global batch (the averaged gradient is then
    exact), else each rank on its slice of it."""
    from lightning_vescale.fsdp import fully_shard
    from lightning_vescale.mesh import init_mesh
    from tests.distributed._fully_shard_helpers import batches, build, micro

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    if replicas is not None:
        mesh = init_mesh("cpu", replicas=replicas)
        for block in model.blocks:  # granularity = the 8-bit block size: blocks stay on a rank
            fully_shard(block, mesh=mesh, granularity=B)
        fully_shard(model, mesh=mesh, granularity=B)
    opt = _engine_opt(kind, model)
    losses = []
    for x, y in batches("gpt", steps, 8):  # the global batch, whatever the world size
        if replicas is not None and not same_data:
            x, y = micro(x, rank, world), micro(y, rank, world)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1).clone()
              for n, p in model.named_parameters()}
    return params, torch.stack(losses)


def _full_params_of(per_rank: list[dict], first: int, count: int) -> dict:
    """The full flat parameters of the shard group of ranks ``first .. first + count - 1``."""
    ranks = per_rank[first:first + count]
    return {n: torch.cat([r[n] for r in ranks]) for n in ranks[0]}


def _engine_runs(worlds, kind: str, same_data: bool):
    steps = 3
    hsdp = worlds(4).run(_engine_body, kind, 2, steps, same_data)
    fsdp = worlds(4).run(_engine_body, kind, 1, steps, same_data)
    single, single_losses = worlds(1).run(_engine_body, kind, None, steps, same_data)[0]
    hsdp_params = [p for p, _ in hsdp]
    h0, h1 = _full_params_of(hsdp_params, 0, 2), _full_params_of(hsdp_params, 2, 2)
    for n in h0:
        assert torch.equal(h0[n], h1[n]), f"replicas differ on {n}"
    f = _full_params_of([p for p, _ in fsdp], 0, 4)
    losses = (torch.stack([loss for _, loss in hsdp]).mean(0),
              torch.stack([loss for _, loss in fsdp]).mean(0), single_losses)
    return h0, f, single, losses


@pytest.mark.parametrize("kind", ["adamw8bit", "muon"])
def test_fully_shard_hsdp_same_data_is_bitwise_1d_and_single_process(worlds, kind):
    """Every rank on the whole batch: the averaged gradient is exact, so HSDP (2, 2), the 1-D
    mesh of 4 and one process must agree bit for bit (Muon's owners, AdamW8bit's blocks)."""
    hsdp, fsdp, single, _ = _engine_runs(worlds, kind, same_data=True)
    for n, want in single.items():
        assert torch.equal(hsdp[n], want), f"HSDP vs one process: {n}"
        assert torch.equal(fsdp[n], want), f"1-D vs one process: {n}"


@pytest.mark.parametrize("kind", ["adamw8bit", "muon"])
def test_fully_shard_hsdp_per_rank_data_matches_1d_and_single_process(worlds, kind):
    """Each rank on its quarter of the global batch: the three runs sum gradients in different
    orders (~1e-7 apart). AdamW8bit stays within ~1e-5 except where such a difference flips an
    8-bit code (one element here moves by 2e-4); Muon's bf16 Newton-Schulz amplifies them to
    ~1e-3 after a few steps (single-process torch.optim.Muon does the same for a 1e-7 gradient
    perturbation; see test_muon_dist). HSDP and the 1-D mesh, whose sums differ least, stay
    within 1e-4 (measured: 4e-6); the losses within 1e-5 relative."""
    hsdp, fsdp, single, losses = _engine_runs(worlds, kind, same_data=False)
    vs_single = 1e-3 if kind == "adamw8bit" else 5e-3
    for n, want in single.items():
        torch.testing.assert_close(hsdp[n], fsdp[n], rtol=0, atol=1e-4)
        torch.testing.assert_close(hsdp[n], want, rtol=0, atol=vs_single)
    for got in losses[:2]:
        torch.testing.assert_close(got, losses[2], rtol=1e-5, atol=0)
