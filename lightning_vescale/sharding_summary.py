"""What sharding did to a model: groups, per-rank elements, padding and granularities.

:func:`sharding_summary` reads a ``fully_shard``-ed module (through the strategy or by hand) and
returns a :class:`ShardingSummary`, whose ``str()`` is a small table::

    group       tensors   elements  per rank (r0 | r1)   padding  granularity (elements x tensors)
    blocks.0         12     12,704  6,352 | 6,352         0.00 %  1 x 8, 256 x 4
    <root>            5      3,168  1,584 | 1,584         0.00 %  1 x 5

*Elements* are the group's real parameter elements; *per rank* is what each rank owns of them
(its shard minus padding); *padding* is the share of the group's flat buffer that holds no
parameter (what the structure-aware planner needed to keep every block on one rank, plus the
alignment of collectives). *Granularity* is how many consecutive elements of a tensor always
stay on one rank (1: element-wise; 256: AdamW8bit's quantization block; a row length: whole
rows). Everything comes from the groups' layout plans, which every rank knows, so no
communication is needed and every rank returns the same summary.

Layer 5 (reads layer 3's public introspection only).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from torch import nn

from lightning_vescale.fsdp import iter_param_groups

__all__ = ["GroupSummary", "ShardingSummary", "sharding_summary"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSummary:
    """One ``fully_shard`` group (all its buffers: one per dtype and trainable/frozen)."""

    name: str  #: the group's module, relative to the summarised module (``"<root>"`` for it)
    tensors: int  #: parameters in the group
    elements: int  #: real parameter elements
    rank_elements: tuple[int, ...]  #: real elements each rank owns
    buffer_elements: int  #: flat buffer size summed over the group's buffers (world * shard)
    granularities: tuple[tuple[int, int], ...]  #: (granularity in elements, tensors), ascending

    @property
    def padding_ratio(self) -> float:
        """Share of the flat buffer that holds no parameter."""
        if not self.buffer_elements:
            return 0.0
        return (self.buffer_elements - self.elements) / self.buffer_elements


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingSummary:
    """Every group of a sharded module, in the order ``named_modules()`` visits them.

    ``world_size`` is the size of a shard group (the ranks a group is split over). Under HSDP
    ``replicas`` shard groups hold the same layout (design note [hsdp] in ``mesh.py``).
    """

    world_size: int
    groups: tuple[GroupSummary, ...]
    replicas: int = 1

    @property
    def elements(self) -> int:
        return sum(g.elements for g in self.groups)

    @property
    def rank_elements(self) -> tuple[int, ...]:
        """Real parameter elements each rank owns, over all groups."""
        return tuple(sum(g.rank_elements[r] for g in self.groups)
                     for r in range(self.world_size))

    @property
    def padding_ratio(self) -> float:
        buffer = sum(g.buffer_elements for g in self.groups)
        return (buffer - self.elements) / buffer if buffer else 0.0

    def table(self, max_ranks: int = 4) -> str:
        """The summary as a text table (per-rank columns for up to ``max_ranks`` ranks, then
        min/max)."""
        def ranks(values: tuple[int, ...]) -> str:
            if len(values) <= max_ranks:
                return " | ".join(f"{v:,}" for v in values)
            return f"min {min(values):,}, max {max(values):,}"

        def grans(g: tuple[tuple[int, int], ...]) -> str:
            return ", ".join(f"{size:,} x {count}" for size, count in g)

        rank_head = ("per rank (" + " | ".join(f"r{r}" for r in range(self.world_size)) + ")"
                     if self.world_size <= max_ranks else "per rank")
        if self.replicas > 1:  # HSDP: the columns are the ranks of one shard group
            rank_head = rank_head.replace("per rank", f"per shard-group rank, x{self.replicas} "
                                          "replicas", 1)
        rows = [(g.name, f"{g.tensors}", f"{g.elements:,}", ranks(g.rank_elements),
                 f"{100 * g.padding_ratio:.2f} %", grans(g.granularities)) for g in self.groups]
        total_grans: Counter[int] = Counter()
        for g in self.groups:
            for size, count in g.granularities:
                total_grans[size] += count
        rows.append(("total", f"{sum(g.tensors for g in self.groups)}", f"{self.elements:,}",
                     ranks(self.rank_elements), f"{100 * self.padding_ratio:.2f} %",
                     grans(tuple(sorted(total_grans.items())))))
        head = ("group", "tensors", "elements", rank_head, "padding",
                "granularity (elements x tensors)")
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        right = (False, True, True, False, True, False)

        def fmt(r: tuple[str, ...]) -> str:
            cells = [c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(r, widths, right)]
            return "  ".join(cells).rstrip()

        return "\n".join([fmt(head), *(fmt(r) for r in rows)])

    def __str__(self) -> str:
        return self.table()


def sharding_summary(module: nn.Module) -> ShardingSummary:
    """Summarise the ``fully_shard`` groups under ``module`` (see the module docstring).

    Raises:
        ValueError: ``module`` has no ``fully_shard`` group (nothing was sharded).
    """
    groups: list[GroupSummary] = []
    world, replicas = 0, 1
    for name, group in iter_param_groups(module):
        plans = [buf.plan for buf in group.buffers.values()]
        if not plans:
            continue
        world = plans[0].world_size
        replicas = group.mesh_info.replicate_size
        grans = Counter(spec.granularity for plan in plans for spec in plan.entries)
        loads = [plan.rank_loads() for plan in plans]
        groups.append(GroupSummary(
            name=name or "<root>",
            tensors=sum(len(plan.entries) for plan in plans),
            elements=sum(plan.total_numel for plan in plans),
            rank_elements=tuple(sum(load[r] for load in loads) for r in range(world)),
            buffer_elements=sum(plan.buffer_size for plan in plans),
            granularities=tuple(sorted(grans.items())),
        ))
    if not groups:
        raise ValueError(f"sharding_summary: {type(module).__name__} has no fully_shard group; "
                         "call it after fully_shard (or after the strategy's setup).")
    return ShardingSummary(world_size=world, groups=tuple(groups), replicas=replicas)
