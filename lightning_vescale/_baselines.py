"""Baseline sharding figures for the planner's command line and benchmarks (pure).

What FSDP2 (each tensor's dim 0 padded to a multiple of the world size, split evenly) and FSDP1
(all tensors concatenated, padded to a multiple of the world size, split evenly) would
communicate and store for the same tensors, so :mod:`lightning_vescale.plan` and
``benchmarks/planner_padding.py`` can print them next to a :class:`~lightning_vescale.planner.LayoutPlan`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_vescale.planner import (
    Granularity,
    TensorSpec,
    _as_specs,
    _check_int,
    resolve_granularity,
)

__all__ = ["BaselineFigures", "fsdp2_even_rowwise", "fsdp1_flat"]


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BaselineFigures:
    """Per-rank shard size, buffer size, padding and load imbalance of one sharding scheme."""

    scheme: str
    world_size: int
    shard_size: int  # elements each rank stores/communicates
    total_numel: int
    max_load: int  # most real elements on one rank
    split_tensors: int  # tensors with at least one block cut across ranks (given granularity)

    @property
    def buffer_size(self) -> int:
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.buffer_size - self.total_numel

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.buffer_size if self.buffer_size else 0.0

    @property
    def imbalance(self) -> float:
        """``max load / mean load``."""
        return self.max_load * self.world_size / self.total_numel if self.total_numel else 1.0


def _baseline_specs(tensors: Iterable, granularity: Granularity) -> list[tuple[tuple[int, ...], int]]:
    out = []
    for item in tensors:
        if isinstance(item, (TensorSpec, tuple)) and len(item) and isinstance(
            item.name if isinstance(item, TensorSpec) else item[0], str
        ):
            out.append(_as_specs([item], granularity)[0][1:])
        else:  # a bare shape
            shape = TensorSpec("shape", tuple(item)).shape
            out.append((shape, resolve_granularity(granularity, shape)))
    if not out:
        raise ValueError("tensors is empty; a sharding group needs at least one tensor.")
    return out


def _cuts_split(e: int, g: int, first_cut: int, period: int) -> bool:
    # cuts at first_cut, first_cut + period, ... (relative to the tensor) strictly inside (0, e)
    if first_cut >= e or e == 0:
        return False
    if first_cut % g:
        return True
    return first_cut + period < e and period % g != 0


def fsdp2_even_rowwise(
    tensors: Iterable, world_size: int, *, granularity: Granularity = 1
) -> BaselineFigures:
    """FSDP2-style sharding: each tensor's dim 0 is padded to a multiple of ``world_size`` and
    split evenly (``torch.chunk``), so each rank communicates ``sum_t ceil(d0/m) * row`` elements.

    ``tensors`` are :class:`TensorSpec`, ``(name, shape[, g])`` tuples or bare shapes; the
    granularity only feeds ``split_tensors``. Scalars count as one row of one element.
    """
    m = _check_int("world_size", world_size, 1)
    shard = total = load0 = split = 0
    for shape, g in _baseline_specs(tensors, granularity):
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if shape else 1
        chunk = -(-rows // m)
        shard += chunk * row
        total += rows * row
        load0 += min(chunk, rows) * row  # rank 0 holds a full chunk: the maximum load
        split += _cuts_split(rows * row, g, chunk * row, chunk * row)
    return BaselineFigures(
        scheme="fsdp2-even-rowwise", world_size=m, shard_size=shard, total_numel=total,
        max_load=load0, split_tensors=split,
    )


def fsdp1_flat(tensors: Iterable, world_size: int, *, granularity: Granularity = 1) -> BaselineFigures:
    """FSDP1-style flat sharding: concatenate, pad to a multiple of ``world_size``, split evenly.

    Minimal padding, but rank boundaries fall anywhere (``split_tensors`` counts the tensors
    whose blocks of the given granularity they cut).
    """
    m = _check_int("world_size", world_size, 1)
    specs = _baseline_specs(tensors, granularity)
    total = sum(math.prod(s) for s, _ in specs)
    shard = max(-(-total // m), 1)
    split = 0
    off = 0
    for shape, g in specs:
        e = math.prod(shape)
        split += _cuts_split(e, g, (off // shard + 1) * shard - off, shard)
        off += e
    return BaselineFigures(
        scheme="fsdp1-flat", world_size=m, shard_size=shard, total_numel=total,
        max_load=min(shard, total), split_tensors=split,
    )
