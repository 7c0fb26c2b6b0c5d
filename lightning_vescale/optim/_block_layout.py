"""The identity of ``AdamW8bit``'s quantization blocks of one parameter, recorded in its state
dict so that loading codes and scales into a layout whose blocks differ is refused instead of
pairing codes with other blocks' scales (design note [adamw8bit], *Tensor parallelism*).

The blocks of a ``fully_shard`` parameter over tensor parallelism are those of its TP-local
tensors (``ShardLayout.region``); without TP they are the global tensor's. The record is the
*block grid*: for each tensor dim, how many TP-local pieces split it (the product of the sizes
of the tp mesh dims that ``Shard`` it: the same on every rank), an int64 tensor of shape
``(ndim,)`` (``(1,)`` for a 0-d parameter). Where the TP-local blocks are
exactly the global ones (no TP, ``Replicate()`` on tp, or only dim 0 split with each TP-local
tensor a whole number of blocks, so the ``(tp * blocks,)`` scales are the global scales in
order) the grid is canonical: all ones. Two layouts with the same grid have the same blocks;
distributed checkpoint reshards the rest (the data-parallel ranges, block-aligned).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_vescale.optim._base import ShardLayout, _dtensor

#: The state-dict entry holding the block grid of a quantized parameter's states.
BLOCK_LAYOUT_KEY = "block_layout"


def block_grid(layout: ShardLayout, block_size: int) -> tuple[int, ...]:
    """The canonical block grid of ``layout`` for ``block_size`` (see the module docstring)."""
    ones = (1,) * max(len(layout.shape), 1)
    if layout.region is None:
        return ones
    assert layout.mesh is not None and layout.mesh_info is not None
    grid = list(ones)  # from the placements, not this rank's box: the same on every rank
    for j in range(layout.mesh_info.shard_mesh_dim + 1, len(layout.placements)):
        pl = layout.placements[j]
        if type(pl) is Shard:
            grid[pl.dim] *= layout.mesh.size(j)
    even = all(s % g == 0 for s, g in zip(layout.shape, grid))
    if all(g == 1 for g in grid[1:]) and even and layout.region_numel % block_size == 0:
        return ones  # whole TP-local row ranges of whole blocks: the global blocks, in order
    return tuple(grid)


def block_layout_record(layout: ShardLayout, block_size: int, *,
                        like: torch.Tensor) -> torch.Tensor:
    """The state-dict entry for a quantized parameter ``like`` of ``layout``: a plain CPU
    tensor for a plain parameter, a ``Replicate()`` DTensor on its mesh (on its device) for a
    DTensor one, as its other states (every rank holds the same value, which distributed
    checkpoint saves once and loads in place, on any mesh)."""
    record = torch.tensor(block_grid(layout, block_size), dtype=torch.int64)
    if not isinstance(like, DTensor):
        return record
    mesh = like.device_mesh
    # built in place on the state's device (as ``_base._dtensor`` does for every state):
    # ``DTensor.from_local`` would move a CPU-offloaded record to the mesh's device
    local = record.to(like.to_local().device)
    return _dtensor(local, mesh, [Replicate()] * mesh.ndim, tuple(local.shape), (1,))


def _describe(grid: tuple[int, ...]) -> str:
    split = [(d, g) for d, g in enumerate(grid) if g != 1]
    if not split:
        return ("the global tensor's blocks (no tensor parallelism, Replicate() on tp, or a "
                "Shard(0) split on block boundaries)")
    parts = ", ".join(f"dim {d} split over {g} tp ranks (Shard({d}))" for d, g in split)
    return f"the TP-local tensors' blocks with {parts}"


def check_block_layout(saved: object, layout: ShardLayout, block_size: int, *,
                       name: str) -> None:
    """Raise ``RuntimeError`` if the saved record ``saved`` (``None``: a state saved without
    one, i.e. before records existed, read as the global blocks) names other blocks than
    ``layout``'s. Pure: the same outcome on every rank, before any collective."""
    live = block_grid(layout, block_size)
    if saved is None:
        got = (1,) * len(live)
    else:
        value = saved.full_tensor() if isinstance(saved, DTensor) else saved
        if is_fake(value):  # the dry run's (and fake-world tests') FakeTensors carry no values
            return
        got = tuple(int(x) for x in torch.as_tensor(value).reshape(-1).tolist())
    if got == live:
        return
    where = "" if layout.mesh is None else (
        f" (live placements {layout.placements} on a mesh of shape "
        f"{tuple(layout.mesh.shape)} {layout.mesh.mesh_dim_names or ''})")
    raise RuntimeError(
        f"AdamW8bit.load_state_dict: the 8-bit states of parameter {name} (shape "
        f"{tuple(layout.shape)}, block_size {block_size}) were quantized in "
        f"{_describe(got)} (saved {BLOCK_LAYOUT_KEY} {list(got)}), but this optimizer's "
        f"blocks are {_describe(live)} ({BLOCK_LAYOUT_KEY} {list(live)}){where}. Their block "
        "scales (exp_avg_absmax, exp_avg_sq_absmax) cannot be paired with other blocks. "
        "Resume at the same tensor-parallel layout as the checkpoint (the same tp size and "
        "TP plan; the data-parallel size may change), or drop the optimizer state (load the "
        "model only and start the optimizer afresh).")
