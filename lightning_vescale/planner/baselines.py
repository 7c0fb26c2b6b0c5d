"""Baseline sharding figures for the planner's command line and benchmarks (pure).

What FSDP2 (each tensor's dim 0 padded to a multiple of the world size, split evenly) and FSDP1
(all tensors concatenated, padded to a multiple of the world size, split evenly) would
communicate and store for the same tensors, so :mod:`lightning_vescale.planner.cli` and
``benchmarks/planner_padding.py`` can print them next to a
:class:`~lightning_vescale.planner.LayoutPlan`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_vescale.planner._granularity import Granularity, check_granularity
from lightning_vescale.planner._layout import PaddingFigures
from lightning_vescale.planner._spec import TensorSpec, check_count, resolve_entry

__all__ = ["BaselineFigures", "fsdp2_even_rowwise", "fsdp1_flat"]


# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BaselineFigures(PaddingFigures):
    """Per-rank shard size, buffer size, padding and load imbalance of one sharding scheme."""

    scheme: str
    world_size: int
    shard_size: int  # elements each rank stores/communicates
    total_numel: int
    max_load: int  # most real elements on one rank
    split_tensors: int  # tensors with at least one block cut across ranks (given granularity)

    # buffer_size, padding, padding_ratio: PaddingFigures, as for a LayoutPlan

    @property
    def imbalance(self) -> float:
        """``max load / mean load``."""
        return self.max_load * self.world_size / self.total_numel if self.total_numel else 1.0


def _baseline_specs(tensors: Iterable, granularity: Granularity | None) -> list[TensorSpec]:
    """The entries with granularity in elements; bare shapes are named ``tensors[i]``.

    Unlike :func:`~lightning_vescale.planner.plan_layout`, names need not be unique here.
    """
    try:
        check_granularity(granularity)
    except (TypeError, ValueError) as exc:
        raise ValueError(str(exc)) from None
    out = []
    for i, item in enumerate(tensors):
        named = isinstance(item, TensorSpec) or (
            isinstance(item, tuple) and len(item) > 0 and isinstance(item[0], str)
        )
        out.append(resolve_entry(i, item if named else (f"tensors[{i}]", tuple(item)), granularity))
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
    tensors: Iterable, world_size: int, *, granularity: Granularity | None = 1
) -> BaselineFigures:
    """FSDP2-style sharding: each tensor's dim 0 is padded to a multiple of ``world_size`` and
    split evenly (``torch.chunk``), so each rank communicates ``sum_t ceil(d0/m) * row`` elements.

    ``tensors`` are :class:`TensorSpec`, ``(name, shape[, g])`` tuples or bare shapes; the
    granularity only feeds ``split_tensors``. Scalars count as one row of one element.
    """
    m = check_count("world_size", world_size, 1)
    shard = total = load0 = split = 0
    for spec in _baseline_specs(tensors, granularity):
        shape = spec.shape
        rows = shape[0] if shape else 1
        row = math.prod(shape[1:]) if shape else 1
        chunk = -(-rows // m)
        shard += chunk * row
        total += rows * row
        load0 += min(chunk, rows) * row  # rank 0 holds a full chunk: the maximum load
        split += _cuts_split(rows * row, spec.granularity, chunk * row, chunk * row)
    return BaselineFigures(
        scheme="fsdp2-even-rowwise", world_size=m, shard_size=shard, total_numel=total,
        max_load=load0, split_tensors=split,
    )


def fsdp1_flat(
    tensors: Iterable, world_size: int, *, granularity: Granularity | None = 1
) -> BaselineFigures:
    """FSDP1-style flat sharding: concatenate, pad to a multiple of ``world_size``, split evenly.

    Minimal padding, but rank boundaries fall anywhere (``split_tensors`` counts the tensors
    whose blocks of the given granularity they cut).
    """
    m = check_count("world_size", world_size, 1)
    specs = _baseline_specs(tensors, granularity)
    total = sum(spec.numel for spec in specs)
    shard = max(-(-total // m), 1)
    split = 0
    off = 0
    for spec in specs:
        e = spec.numel
        split += _cuts_split(e, spec.granularity, (off // shard + 1) * shard - off, shard)
        off += e
    return BaselineFigures(
        scheme="fsdp1-flat", world_size=m, shard_size=shard, total_numel=total,
        max_load=min(shard, total), split_tensors=split,
    )
