"""Distributed checkpoint (torch.distributed.checkpoint) of RaggedShard DTensors.

Save with one layout / world size, load into another RaggedShard layout, another world size,
``Replicate``, ``Shard(d)`` and plain tensors; the reference is the dense tensor each rank can
build from a seed, so a wrong chunk description or a wrong view shows up as wrong values.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_vescale.placement import (
    RaggedShard,
    flat_range_to_boxes,
    ragged_from_local,
    ragged_ranges,
)

SHAPES = {"w": (6, 5, 3), "v": (10,), "s": (), "m": (4, 3)}


def _dense(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def _layouts(world: int, variant: int) -> dict[str, RaggedShard]:
    """A few ragged layouts per world size: zeros, one-hot, units inside rows, dims=()."""
    if variant == 0:
        units_w = [(6,), (1, 5), (2, 0, 1), (1, 2, 0, 3)][world - 1]          # dims (0,), P=6
        units_m = [(1,), (0, 1), (1, 0, 0), (0, 0, 1, 0)][world - 1]          # one-hot
    else:
        units_w = [(5,), (3, 2), (1, 3, 1), (2, 0, 1, 2)][world - 1]          # dims (0, 1), P=30
        units_m = [(4,), (3, 1), (2, 2, 0), (1, 1, 1, 1)][world - 1]
    dims_w = (0,) if variant == 0 else (0, 1)
    units_v = [(10,), (7, 3), (0, 5, 5), (1, 4, 0, 5)][world - 1] if variant == 0 else \
        [(1,), (1, 1), (2, 2, 1), (0, 2, 2, 1)][world - 1]
    one_hot = tuple(1 if r == world - 1 - variant % world else 0 for r in range(world))
    return {
        "w": RaggedShard(dims_w, units_w),
        "v": RaggedShard((0,), units_v),
        "s": RaggedShard((), one_hot),
        "m": RaggedShard((0,), units_m),
    }


def _ragged_state(layouts: dict[str, RaggedShard], fill: bool) -> dict[str, DTensor]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()
    state = {}
    for name, pl in layouts.items():
        full = _dense(name)
        start, end = pl.local_range(full.shape, rank)
        local = full.reshape(-1)[start:end].clone() if fill else torch.zeros(end - start)
        state[name] = ragged_from_local(local, mesh, pl, full.shape)
    return state


def _save_ragged(path: str, variant: int) -> None:
    dcp.save(_ragged_state(_layouts(dist.get_world_size(), variant), fill=True),
             checkpoint_id=path)


def _load(path: str, target: str, variant: int = 0) -> dict[str, torch.Tensor]:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    if target == "ragged":
        state = _ragged_state(_layouts(world, variant), fill=False)
    elif target == "plain":
        state = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    else:
        placement = Replicate() if target == "replicate" else Shard(0)
        state = {
            name: DTensor.from_local(torch.zeros(shape), mesh, [Replicate()], run_check=False)
            .redistribute(mesh, [placement] if shape else [Replicate()])
            for name, shape in SHAPES.items()
        }
    locals_before = {k: v._local_tensor for k, v in state.items() if isinstance(v, DTensor)}
    dcp.load(state, checkpoint_id=path)
    out = {}
    for name, value in state.items():
        if isinstance(value, DTensor):
            # loads write in place, into the very local tensors (views into flat buffers survive)
            assert value._local_tensor is locals_before[name]
            out[name] = value.full_tensor()
        else:
            out[name] = value
    return out


def _assert_dense(results: list[dict[str, torch.Tensor]]) -> None:
    for per_rank in results:
        assert set(per_rank) == set(SHAPES)
        for name, value in per_rank.items():
            torch.testing.assert_close(value, _dense(name), rtol=0, atol=0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_save_load_across_layouts_same_world(worlds, tmp_path, world):
    path = str(tmp_path / "ckpt")
    worlds(world).run(_save_ragged, path, 0)
    for target, variant in [("ragged", 1), ("ragged", 0), ("replicate", 0), ("shard", 0),
                            ("plain", 0)]:
        _assert_dense(worlds(world).run(_load, path, target, variant))


def test_save_world4_load_world2_and_plain(worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    worlds(4).run(_save_ragged, path, 1)
    _assert_dense(worlds(2).run(_load, path, "ragged", 0))
    _assert_dense(worlds(2).run(_load, path, "replicate"))
    _assert_dense(worlds(3).run(_load, path, "ragged", 1))
    _assert_dense(worlds(1).run(_load, path, "plain"))


def _save_shard0(path: str) -> None:
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = {
        name: DTensor.from_local(_dense(name), mesh, [Replicate()], run_check=False)
        .redistribute(mesh, [Shard(0)] if shape else [Replicate()])
        for name, shape in SHAPES.items()
    }
    dcp.save(state, checkpoint_id=path)


def test_torch_shard0_checkpoint_loads_into_ragged(worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    worlds(3).run(_save_shard0, path)
    _assert_dense(worlds(4).run(_load, path, "ragged", 0))


def _chunk_metadata(path: str) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    md = dcp.FileSystemReader(path).read_metadata()
    return {
        name: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[name].chunks)
        for name in SHAPES
    }


def test_chunk_metadata_is_rectangles_of_the_ranges(worlds, tmp_path):
    path = str(tmp_path / "ckpt")
    worlds(4).run(_save_ragged, path, 1)
    chunks = _chunk_metadata(path)
    for name, pl in _layouts(4, 1).items():
        shape = SHAPES[name]
        expected = sorted(
            (tuple(o), tuple(s))
            for start, end in ragged_ranges(shape, pl)
            for o, s in flat_range_to_boxes(shape, start, end)
        )
        assert chunks[name] == expected
        for start, end in ragged_ranges(shape, pl):
            assert len(flat_range_to_boxes(shape, start, end)) <= max(1, 2 ** len(shape) - 1)
        assert sum(math.prod(s) for _, s in chunks[name]) == math.prod(shape)


# -- full state dicts: ranks other than 0 drop each gathered tensor at once ----------------------
def _full_state_peak_body():
    import weakref

    from torch import nn

    from lightning_vescale.checkpoint._state_dicts import model_state, optimizer_state
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    alive: list[weakref.ref] = []
    peak = [0]
    real = DTensor.full_tensor

    def tracked(self, **kw):
        out = real(self, **kw)
        alive[:] = [r for r in alive if r() is not None]  # storages still held by anyone
        alive.append(weakref.ref(out.untyped_storage()))
        peak[0] = max(peak[0], len(alive))
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DTensor, "full_tensor", tracked)
        msd = model_state(model, full=True)
        model_peak, peak[0], alive[:] = peak[0], 0, []
        osd = optimizer_state(model, opt, full=True)
    return dist.get_rank(), len(msd), model_peak, len(osd), peak[0]


def test_full_state_dicts_hold_one_full_tensor_at_a_time_off_rank_0(worlds):
    """Rank 0 keeps every gathered tensor (it returns them); the others used to keep a CPU copy
    of the whole model (and of every optimizer state) until the dict was thrown away."""
    for rank, n_model, model_peak, n_opt, opt_peak in worlds(2).run(_full_state_peak_body):
        if rank == 0:
            assert n_model == 8 and model_peak == 8 and n_opt == 2 and opt_peak == 16
        else:
            assert (n_model, n_opt) == (0, 0) and model_peak == 1 and opt_peak == 1
