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

With tensor parallelism (design note [fsdp-tp]) a group plans each rank's *TP-local* tensors, so
*elements* and *per rank* count one tp coordinate's pieces, and a ``tp`` column says how the
group's TP parameters are split: the tp degree and the placements, e.g. ``2: Shard(0) x 5,
Shard(1) x 2`` (its other parameters are whole on the tp dim). :func:`tensor_parallel_text` says
it for a whole module in one line (the ``MemoryProfiler`` table prints it).

Layer 5 (reads layer 3's public introspection only).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable
from typing import Any

from torch import nn

from lightning_vescale._dbuffer_quant import message_bytes
from lightning_vescale.fsdp import iter_param_groups

__all__ = ["GroupSummary", "ShardingSummary", "sharding_summary", "tensor_parallel_text"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupSummary:
    """One ``fully_shard`` group (all its buffers: one per dtype and trainable/frozen, and more
    for whole-matrix tensors where design note [plan-buckets] splits them: one for all, or one
    per tensor)."""

    name: str  #: the group's module, relative to the summarised module (``"<root>"`` for it)
    tensors: int  #: parameters in the group
    elements: int  #: real parameter elements
    rank_elements: tuple[int, ...]  #: real elements each rank owns
    buffer_elements: int  #: flat buffer size summed over the group's buffers (world * shard)
    granularities: tuple[tuple[int, int], ...]  #: (granularity in elements, tensors), ascending
    #: bytes of one all-gather of the group (the per-rank message as ``CopyCommCounter`` counts
    #: it), with the group's ``CommPolicy`` and without (``param_dtype`` everywhere)
    gather_bytes: int = 0
    gather_bytes_unquantized: int = 0
    #: bytes of one gradient reduce-scatter, with the policy's wire dtype and without
    reduce_bytes: int = 0
    reduce_bytes_unquantized: int = 0
    #: the group's DBuffers, one summary each (named by the buffer's label, e.g.
    #: ``"[torch.float32, matrix]"``), when it has more than one; ``()`` otherwise
    buffers: tuple[GroupSummary, ...] = ()
    #: the tp degree of the group's tensor-parallel parameters (1: none)
    tp_size: int = 1
    #: ``(placement, tensors)`` of its tensor-parallel parameters, e.g. ``(("Shard(0)", 5),)``
    tp_placements: tuple[tuple[str, int], ...] = ()

    @property
    def tp_text(self) -> str:
        """The ``tp`` cell: ``"<degree>: <placement> x <tensors>, ..."`` (``""``: no TP)."""
        if not self.tp_placements:
            return ""
        return f"{self.tp_size}: " + ", ".join(f"{p} x {n}" for p, n in self.tp_placements)

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
    comm_policy: str = ""  #: the ``CommPolicy`` in words (``""``: none)

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
        with_tp = any(g.tp_placements for g in self.groups)

        def row(g: GroupSummary, name: str) -> tuple[str, ...]:
            return (name, f"{g.tensors}", f"{g.elements:,}", ranks(g.rank_elements),
                    f"{100 * g.padding_ratio:.2f} %", grans(g.granularities),
                    *((g.tp_text,) if with_tp else ()))

        rows = [r for g in self.groups  # a group of several buffers: one sub-row each
                for r in [row(g, g.name), *(row(b, f"  {b.name}") for b in g.buffers)]]
        total_grans: Counter[int] = Counter()
        for g in self.groups:
            for size, count in g.granularities:
                total_grans[size] += count
        rows.append(("total", f"{sum(g.tensors for g in self.groups)}", f"{self.elements:,}",
                     ranks(self.rank_elements), f"{100 * self.padding_ratio:.2f} %",
                     grans(tuple(sorted(total_grans.items()))), *(("",) if with_tp else ())))
        head = ("group", "tensors", "elements", rank_head, "padding",
                "granularity (elements x tensors)", *(("tp",) if with_tp else ()))
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        right = (False, True, True, False, True, False, False)

        def fmt(r: tuple[str, ...]) -> str:
            cells = [c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(r, widths, right)]
            return "  ".join(cells).rstrip()

        lines = [fmt(head), *(fmt(r) for r in rows)]
        if self.comm_policy:
            lines.append(self.comm_line())
        return "\n".join(lines)

    def comm_line(self) -> str:
        """The policy and the bytes it saves per all-gather / reduce-scatter of every group
        (the table's last line; the strategies log it once when they shard with a policy)."""
        def mb(n: int) -> str:
            return f"{n / 2**20:,.2f} MiB"

        g = sum(x.gather_bytes for x in self.groups)
        g0 = sum(x.gather_bytes_unquantized for x in self.groups)
        r = sum(x.reduce_bytes for x in self.groups)
        r0 = sum(x.reduce_bytes_unquantized for x in self.groups)
        return (f"comm policy: {self.comm_policy}; all-gather {mb(g)} instead of {mb(g0)} "
                f"({g / g0 if g0 else 1:.2f}x), reduce-scatter {mb(r)} instead of {mb(r0)} "
                f"({r / r0 if r0 else 1:.2f}x) per pass of every group")

    def __str__(self) -> str:
        return self.table()


def sharding_summary(module: nn.Module) -> ShardingSummary:
    """Summarise the ``fully_shard`` groups under ``module`` (see the module docstring).

    Raises:
        ValueError: ``module`` has no ``fully_shard`` group (nothing was sharded).
    """
    groups: list[GroupSummary] = []
    world, replicas, policy = 0, 1, ""
    for name, group in iter_param_groups(module):
        if group.comm_policy is not None:
            policy = group.comm_policy.describe()
        if not group.buffers:
            continue
        world = next(iter(group.buffers.values())).plan.world_size
        replicas = group.mesh_info.replicate_size
        summary = dataclasses.replace(_summarize(name or "<root>", group.buffers.items(), world),
                                      **_tp_fields(group))
        if len(group.buffers) > 1:  # e.g. whole-matrix experts apart (design note [plan-buckets])
            summary = dataclasses.replace(summary, buffers=tuple(
                _summarize(buf.name[buf.name.find("["):], [(key, buf)], world)
                for key, buf in group.buffers.items()))
        groups.append(summary)
    if not groups:
        raise ValueError(f"sharding_summary: {type(module).__name__} has no fully_shard group; "
                         "call it after fully_shard (or after the strategy's setup).")
    return ShardingSummary(world_size=world, groups=tuple(groups), replicas=replicas,
                           comm_policy=policy)


def _tp_fields(group: Any) -> dict[str, Any]:
    """``tp_size`` and ``tp_placements`` of a group's tensor-parallel parameters ([fsdp-tp])."""
    specs = [mp.tp for mp in group.params if getattr(mp, "tp", None) is not None]
    if not specs:
        return {}
    counts = Counter(", ".join(repr(p) for p in spec.placements) for spec in specs)
    return {"tp_size": max(spec.tp_mesh.size() for spec in specs),
            "tp_placements": tuple(sorted(counts.items()))}


def tensor_parallel_text(module: nn.Module | None) -> str | None:
    """How ``module``'s ``fully_shard`` groups hold tensor-parallel parameters, in one line
    (``"tp 2: 14 parameters (Shard(0) x 10, Shard(1) x 4)"``), or ``None`` without any."""
    counts: Counter[str] = Counter()
    size = 1
    for _, group in iter_param_groups(module) if module is not None else ():
        fields = _tp_fields(group)
        size = max(size, fields.get("tp_size", 1))
        for placement, n in fields.get("tp_placements", ()):
            counts[placement] += n
    if not counts:
        return None
    listed = ", ".join(f"{p} x {n}" for p, n in sorted(counts.items()))
    return f"tp {size}: {sum(counts.values())} parameters ({listed})"


def _summarize(name: str, buffers: Iterable[tuple[Any, Any]], world: int) -> GroupSummary:
    """The figures of ``buffers`` (``(key, DBuffer)`` pairs of one group) from their plans."""
    buffers = list(buffers)
    plans = [buf.plan for _, buf in buffers]
    grans = Counter(spec.granularity for plan in plans for spec in plan.entries)
    loads = [plan.rank_loads() for plan in plans]
    return GroupSummary(
        name=name,
        tensors=sum(len(plan.entries) for plan in plans),
        elements=sum(plan.total_numel for plan in plans),
        rank_elements=tuple(sum(load[r] for load in loads) for r in range(world)),
        buffer_elements=sum(plan.buffer_size for plan in plans),
        granularities=tuple(sorted(grans.items())),
        **_comm_bytes(buffers),
    )


def _comm_bytes(buffers: Iterable[tuple[Any, Any]]) -> dict[str, int]:
    """Bytes per all-gather / reduce-scatter of a group's buffers, with and without its
    ``CommPolicy`` (design note [comm-policy]): int8/fp8 codes plus fp32 scales, and gradients in
    the wire dtype; only trainable floating-point buffers are reduce-scattered."""
    out = dict(gather_bytes=0, gather_bytes_unquantized=0, reduce_bytes=0,
               reduce_bytes_unquantized=0)
    for key, buf in buffers:
        trainable = key[1]
        n = buf.plan.buffer_size
        plain = n * buf.param_dtype.itemsize
        out["gather_bytes_unquantized"] += plain
        out["gather_bytes"] += (buf.world_size * message_bytes(buf.plan, buf.quant_block_size)
                                if buf.quantize else plain)
        if trainable and buf.dtype.is_floating_point:
            out["reduce_bytes_unquantized"] += n * buf.reduce_dtype.itemsize
            out["reduce_bytes"] += n * (buf.wire_dtype or buf.reduce_dtype).itemsize
    return out

