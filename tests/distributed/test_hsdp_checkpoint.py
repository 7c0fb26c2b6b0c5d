"""Sharded (DCP) checkpoints across HSDP and 1-D meshes and world sizes, model and optimizers.

A tiny model's parameters are sharded by hand on the mesh under test (``(RaggedShard,)`` on a
1-D mesh, ``(Replicate(), RaggedShard)`` on a 2-D ``(replicate, shard)`` mesh; uneven,
block-aligned cuts that depend on the shard size only), trained a few steps with gradients from a
seed (what the engine's all-reduce over the whole data-parallel world gives every rank), saved
with the strategies' sharded format (``checkpoint.save_sharded``: DCP + ``meta.pt`` + the
integrity manifest), loaded into a fresh model and optimizer on another mesh / world size with
``checkpoint.load_sharded``, and trained on. The parameters must equal, bitwise, a single-process
run of the same optimizer for all the steps: that checks the model and every optimizer state
(AdamW8bit's codes and per-block scales, Muon's momentum and its AdamW fallback's moments,
torch AdamW's moments) went to the right place.

Also: replicas write no duplicate bytes (DCP's dedup of identical chunks), and every stored item
is covered by ``.integrity.json`` and verified on load.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_vescale import checkpoint as ckpt
from lightning_vescale.checkpoint._trust import load_manifest, read_metadata
from lightning_vescale.mesh import MeshInfo
from lightning_vescale.optim import AdamW8bit, Muon
from lightning_vescale.placement import RaggedShard, local_slice, ragged_from_local

B = 256  # AdamW8bit's block size: cuts of quantized tensors fall on multiples of it
MIN_8BIT = 1024
STEPS_BEFORE, STEPS_AFTER = 2, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)  # 4096: quantized (AdamW8bit), Muon
        self.fc2 = nn.Linear(64, 32)  # 2048: quantized, Muon
        self.head = nn.Linear(32, 5)  # fp32 states; Muon's AdamW fallback (by name)


def _placement(shape: tuple[int, ...], shard_size: int, seed: int) -> RaggedShard:
    """Uneven element cuts (some ranks may be empty) on multiples of ``B`` for quantized
    tensors, of 4 elements otherwise; a function of the shard size only."""
    numel = math.prod(shape)
    unit = B if numel >= MIN_8BIT else 4
    g = torch.Generator().manual_seed(seed)
    inner = sorted(int(x) * unit for x in torch.randint(0, numel // unit + 1,
                                                          (shard_size - 1,), generator=g))
    cuts = [0, *inner, numel]
    return RaggedShard(tuple(range(len(shape))), [b - a for a, b in zip(cuts, cuts[1:])])


def _mesh(shape: tuple[int, ...]):
    names = ("dp_replicate", "dp_shard") if len(shape) == 2 else ("dp_shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _model(info: MeshInfo | None) -> Net:
    """The seeded model; with ``info``, every parameter sharded on its mesh (in place)."""
    torch.manual_seed(0)
    net = Net()
    if info is None:
        return net
    for i, (name, p) in enumerate(list(net.named_parameters())):
        mod_name, _, attr = name.rpartition(".")
        placement = _placement(tuple(p.shape), info.shard_size, i)
        local = local_slice(p.detach(), placement, info.shard_rank).clone()
        dt = ragged_from_local(local, info.mesh, info.placements(placement), tuple(p.shape))
        net.get_submodule(mod_name)._parameters[attr] = nn.Parameter(dt)
    return net


def _optimizer(kind: str, net: Net):
    if kind == "adamw8bit":
        return AdamW8bit(net.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=MIN_8BIT)
    if kind == "muon":
        return Muon(net.named_parameters(), lr=0.02, weight_decay=0.1, adamw_lr=3e-3)
    if kind == "adamw":
        return torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    raise AssertionError(kind)


def _train(net: Net, opt, steps: range, info: MeshInfo | None) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(1000 + step)
        for p in net.parameters():
            full = torch.randn(p.shape, generator=g)
            if isinstance(p, DTensor):
                placements = tuple(p.placements)
                ragged = placements[info.shard_mesh_dim]
                p.grad = ragged_from_local(local_slice(full, ragged, info.shard_rank).clone(),
                                           info.mesh, placements, tuple(p.shape))
            else:
                p.grad = full
        opt.step()
        opt.zero_grad(set_to_none=True)


def _local_flat(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1).clone()


def _info(mesh_shape: tuple[int, ...]) -> MeshInfo:
    return MeshInfo.from_mesh(_mesh(mesh_shape))


def _save_body(kind: str, mesh_shape: tuple[int, ...], path: str) -> None:
    info = _info(mesh_shape)
    net = _model(info)
    opt = _optimizer(kind, net)
    _train(net, opt, range(STEPS_BEFORE), info)
    tensors = {"state_dict": ckpt.model_state(net, full=False),
               "optimizer_0": ckpt.optimizer_state(net, opt, full=False)}
    ckpt.save_sharded(Path(path), tensors, {"epoch": 1})


def _load_body(kind: str, mesh_shape: tuple[int, ...], path: str) -> dict:
    """Load, train on; per parameter: equal to the single-process run's slice?"""
    info = _info(mesh_shape)
    net = _model(info)
    opt = _optimizer(kind, net)
    meta = ckpt.load_sharded(Path(path), net, {"optimizer_0": opt})
    _train(net, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), info)

    ref = _model(None)
    ref_opt = _optimizer(kind, ref)
    _train(ref, ref_opt, range(STEPS_BEFORE + STEPS_AFTER), None)
    equal = {}
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        placement = p.placements[info.shard_mesh_dim]
        want = local_slice(q.detach(), placement, info.shard_rank).reshape(-1)
        equal[name] = bool(torch.equal(_local_flat(p), want))
    return dict(equal=equal, meta=meta, states=len(opt.state))


def _check_loaded(outs: list[dict], kind: str, saved: tuple, loaded: tuple) -> None:
    for rank, out in enumerate(outs):
        bad = [n for n, ok in out["equal"].items() if not ok]
        assert not bad, (f"{kind}: saved on {saved}, loaded on {loaded}, rank {rank}: {bad} "
                         "differ from the single-process run")
        assert out["meta"] == {"epoch": 1}
        assert out["states"] == 6


def _payload_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


KINDS = ["adamw8bit", "muon", "adamw"]


@pytest.mark.parametrize("kind", KINDS)
def test_hsdp_save_loads_on_1d_meshes_and_other_world_sizes(worlds, tmp_path, kind):
    """(2, 2) at world 4 -> 1-D of 4, 1-D of 2, (2, 2), and (2, 1) at world 2."""
    path = tmp_path / "hsdp"
    worlds(4).run(_save_body, kind, (2, 2), str(path))
    for world, mesh_shape in [(4, (4,)), (2, (2,)), (4, (2, 2)), (2, (2, 1))]:
        outs = worlds(world).run(_load_body, kind, mesh_shape, str(path))
        _check_loaded(outs, kind, (2, 2), mesh_shape)


@pytest.mark.parametrize("kind", KINDS)
def test_1d_save_loads_on_hsdp(worlds, tmp_path, kind):
    """1-D of 4 and of 2 -> (2, 2) at world 4; (1, 2) at world 2 -> (2, 2)."""
    for world, mesh_shape in [(4, (4,)), (2, (2,)), (2, (1, 2))]:
        path = tmp_path / f"src{world}-{len(mesh_shape)}d"
        worlds(world).run(_save_body, kind, mesh_shape, str(path))
        outs = worlds(4).run(_load_body, kind, (2, 2), str(path))
        _check_loaded(outs, kind, mesh_shape, (2, 2))


def test_replicas_write_no_duplicate_bytes_and_the_manifest_covers_every_item(worlds, tmp_path):
    """The (2, 2) save stores what the 1-D save of 2 ranks stores (same shard layouts), not
    twice that; every stored item has a CRC-32 in ``.integrity.json``."""
    hsdp, fsdp2, replicated = tmp_path / "hsdp", tmp_path / "fsdp2", tmp_path / "replicated"
    worlds(4).run(_save_body, "adamw8bit", (2, 2), str(hsdp))
    worlds(2).run(_save_body, "adamw8bit", (2,), str(fsdp2))
    worlds(4).run(_save_body, "adamw8bit", (4, 1), str(replicated))
    one = _payload_bytes(fsdp2)
    assert one > 0
    # DCP pickles a small header per item; the tensor bytes are the same
    assert abs(_payload_bytes(hsdp) - one) < 0.05 * one, (_payload_bytes(hsdp), one)
    assert _payload_bytes(replicated) < 1.1 * one, (_payload_bytes(replicated), one)
    for path in (hsdp, replicated):
        manifest = load_manifest(path)
        md = read_metadata(path)
        assert manifest is not None and len(manifest["items"]) == len(md.storage_data)
    # offline consolidation (one process, no mesh) reads the same full tensors from all three
    full = {p.name: ckpt.consolidate(p) for p in (hsdp, fsdp2, replicated)}
    for name in ("hsdp", "replicated"):
        for key, want in full["fsdp2"]["state_dict"].items():
            assert torch.equal(full[name]["state_dict"][key], want), (name, key)
        got_states = full[name]["optimizer_states"][0]["state"]
        for idx, st in full["fsdp2"]["optimizer_states"][0]["state"].items():
            for k, v in st.items():
                assert torch.equal(got_states[idx][k], v), (name, idx, k)


def _full_roundtrip_body(kind: str, mesh_shape: tuple[int, ...], path: str,
                         single_process_source: bool) -> dict:
    """The full format on an HSDP mesh: rank 0 writes the gathered tensors once (or a
    single-process run's state dicts are the checkpoint); loading slices them on every replica."""
    info = _info(mesh_shape)
    if single_process_source:
        src = _model(None)
        src_opt = _optimizer(kind, src)
        _train(src, src_opt, range(STEPS_BEFORE), None)
        checkpoint = {"state_dict": src.state_dict(), "optimizer_0": src_opt.state_dict()}
    else:
        net = _model(info)
        opt = _optimizer(kind, net)
        _train(net, opt, range(STEPS_BEFORE), info)
        checkpoint = {"state_dict": ckpt.model_state(net, full=True),
                      "optimizer_0": ckpt.optimizer_state(net, opt, full=True)}
        ckpt.save_full(Path(path), checkpoint)
        dist.barrier()
        checkpoint = ckpt.read_full(Path(path))
    net2 = _model(info)
    opt2 = _optimizer(kind, net2)
    ckpt.load_full(checkpoint, net2, {"optimizer_0": opt2}, path=Path(path))
    _train(net2, opt2, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), info)
    ref = _model(None)
    ref_opt = _optimizer(kind, ref)
    _train(ref, ref_opt, range(STEPS_BEFORE + STEPS_AFTER), None)
    equal = {}
    for (name, p), q in zip(net2.named_parameters(), ref.parameters()):
        placement = p.placements[info.shard_mesh_dim]
        want = local_slice(q.detach(), placement, info.shard_rank).reshape(-1)
        equal[name] = bool(torch.equal(_local_flat(p), want))
    return dict(equal=equal, meta={"epoch": 1}, states=len(opt2.state))


@pytest.mark.parametrize("kind", KINDS)
def test_full_checkpoint_round_trip_on_hsdp(worlds, tmp_path, kind):
    outs = worlds(4).run(_full_roundtrip_body, kind, (2, 2), str(tmp_path / "full.ckpt"), False)
    _check_loaded(outs, kind, (2, 2), (2, 2))


@pytest.mark.parametrize("kind", KINDS)
def test_single_process_full_checkpoint_loads_on_hsdp(worlds, tmp_path, kind):
    """A plain (single-process) state dict is cut to each rank's slice of the shard group."""
    outs = worlds(4).run(_full_roundtrip_body, kind, (2, 2), str(tmp_path / "unused"), True)
    _check_loaded(outs, kind, "one process", (2, 2))


# -- through fully_shard (the strategies' engine) -------------------------------------------------
def _gpt_run(kind: str, mesh_shape: tuple[int, ...] | None, steps: range, *,
             load_from: str | None = None, save_to: str | None = None) -> dict | None:
    """GPT under ``fully_shard`` on ``mesh_shape`` (``None``: one process), every rank on the
    whole batch (the averaged gradient is exact, so runs on any mesh are bitwise comparable);
    optionally load a sharded checkpoint first and/or save one after ``steps``. Returns this
    rank's flat local parameters."""
    from lightning_vescale.fsdp import fully_shard
    from tests.distributed._fully_shard_helpers import batches, build

    model = build("gpt")
    if mesh_shape is not None:
        mesh = _mesh(mesh_shape)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, granularity=B)
        fully_shard(model, mesh=mesh, granularity=B)
    opt = _optimizer(kind, model)
    if load_from is not None:
        ckpt.load_sharded(Path(load_from), model, {"optimizer_0": opt})
    data = batches("gpt", steps.stop, 4)
    for step in steps:
        x, y = data[step]
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    if save_to is not None:
        ckpt.save_sharded(Path(save_to), {"state_dict": ckpt.model_state(model, full=False),
                                          "optimizer_0": ckpt.optimizer_state(model, opt,
                                                                              full=False)}, {})
    return {n: _local_flat(p) for n, p in model.named_parameters()}


def _assemble(per_rank: list[dict], first: int, count: int) -> dict:
    ranks = per_rank[first:first + count]
    return {n: torch.cat([r[n] for r in ranks]) for n in ranks[0]}


@pytest.mark.parametrize("kind", ["adamw8bit", "muon"])
def test_fully_shard_checkpoints_move_between_hsdp_and_1d(worlds, tmp_path, kind):
    """fully_shard GPT: HSDP (2, 2) save -> 1-D of 4 and of 2; 1-D of 4 save -> HSDP (2, 2).
    Two steps, save, load elsewhere, two more steps == four steps in one process, bitwise."""
    before, after = range(0, 2), range(2, 4)
    ref = worlds(1).run(_gpt_run, kind, None, range(0, 4))[0]
    hsdp_path, fsdp_path = str(tmp_path / "hsdp"), str(tmp_path / "fsdp")
    worlds(4).run(_gpt_run, kind, (2, 2), before, save_to=hsdp_path)
    worlds(4).run(_gpt_run, kind, (4,), before, save_to=fsdp_path)
    for world, shape, src in [(4, (4,), hsdp_path), (2, (2,), hsdp_path),
                              (4, (2, 2), fsdp_path)]:
        outs = worlds(world).run(_gpt_run, kind, shape, after, load_from=src)
        shard_size = shape[-1]
        for first in range(0, world, shard_size):
            got = _assemble(outs, first, shard_size)
            bad = [n for n in ref if not torch.equal(got[n], ref[n])]
            assert not bad, f"{kind}: {src} loaded on {shape}: {bad} differ"


def _full_state_dict_body(shape: tuple[int, ...]) -> dict:
    """``module.load_state_dict`` of a plain full state dict into an HSDP module: each rank
    keeps its slice of the shard group (fsdp's load pre-hook)."""
    from lightning_vescale.fsdp import fully_shard
    from tests.distributed._fully_shard_helpers import build

    src = build("gpt", seed=1)
    model = build("gpt")
    mesh = _mesh(shape)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.load_state_dict(src.state_dict())
    info = MeshInfo.from_mesh(mesh)
    out = {}
    for n, p in model.named_parameters():
        want = local_slice(src.get_parameter(n).detach(), p.placements[info.shard_mesh_dim],
                           info.shard_rank).reshape(-1)
        out[n] = bool(torch.equal(_local_flat(p), want))
    return out


def test_full_state_dict_loads_into_an_hsdp_module(worlds):
    for rank, out in enumerate(worlds(4).run(_full_state_dict_body, (2, 2))):
        assert all(out.values()), (rank, [n for n, ok in out.items() if not ok])
