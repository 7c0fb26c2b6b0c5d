"""The layout plan of one sharding group: :class:`LayoutPlan` and :func:`plan_layout`.

Design note [planner]
---------------------
One sharding group owns one flat buffer of ``m * S`` elements (``m`` ranks, ``S`` elements per
rank). Every tensor ``t`` of the group gets an offset ``l_t``; its ``e_t`` elements live at
``[l_t, l_t + e_t)`` and rank ``r`` owns ``[r*S, (r+1)*S)``. Each tensor has a *granularity*
``g_t`` (elements in one unsplittable block: 1 element-wise, a row, ``b`` rows of a quantization
tile, ``e_t`` for "whole tensor on one rank"; the user's forms are resolved to elements once, by
:func:`~lightning_vescale.planner.resolve_granularity`). A layout is valid when

* the intervals are disjoint and inside ``[0, m*S)``,
* every rank boundary ``k*S`` strictly inside ``[l_t, l_t + e_t)`` lies at a multiple of ``g_t``
  from ``l_t`` (so every rank's local range of ``t`` starts and ends on a multiple of ``g_t`` or
  at the tensor's end; a trailing partial block is allowed when ``g_t`` does not divide ``e_t``),
* ``S`` is a multiple of the collective alignment ``align``.

We minimize ``S`` (equivalently the padding ``m*S - sum(e_t)``). The general problem is NP-hard
(it contains bin packing: take ``g_t = e_t``). The planner keeps the caller's tensor order
(views, checkpoints and debugging stay predictable; reordering never helped on the benchmark
models) and solves the order-preserving problem. The one case order cannot fix, whole matrices
(``"matrix"`` experts) behind element-granular tensors, is handled one level up: such tensors
get a buffer of their own when that saves more than 1% of the elements in padding
(:func:`~lightning_vescale.planner.plan_buckets`, design note [plan-buckets]).

The search over ``S`` lives in :mod:`lightning_vescale.planner._search` (design note
[plan-search]: why a greedy earliest start is exact for a fixed ``S``, which ``S`` are
candidates, and the budgeted search). What callers may rely on:

* ``S >= shard_size_lower_bound(...)``, the smallest candidate ``S`` (a multiple of ``align`` and
  of ``g_t`` for every tensor with ``e_t > 2S``, at least ``ceil(sum(e_t)/m)`` and
  ``min(e_t, g_t)``): no layout in *any* order does better (``LayoutPlan.optimal`` when equal);
* ``LayoutPlan.exact``: the exact scan finished, so ``S`` is the optimum among layouts that keep
  the order (always the case for small instances);
* always ``S <= S_ub``, the first ``S >= ceil(sum(e_t)/m) + w - 1`` (``w = max_t min(g_t, e_t)``)
  that is a multiple of ``align`` and of ``g_t`` for every tensor longer than ``S``.

In practice (rows of a few thousand elements, ``S`` in the millions) ``S`` is the lower bound
or a few candidates above it; a DeepSeek-V3-sized model at 10,000 ranks plans in well under a
second (see ``benchmarks/RESULTS_planner.md``).

Each tensor's :class:`~lightning_vescale.placement.RaggedShard` is derived from the plan: the
unit is the gcd of the tensor's numel and all rank cuts inside it, expressed on the shortest
prefix of dims whose trailing product divides it, so ``RaggedShard.local_range(shape, r)``
reproduces :meth:`LayoutPlan.local_range` exactly.
"""

from __future__ import annotations

import math
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate

from lightning_vescale.placement import RaggedShard
from lightning_vescale.planner._granularity import Granularity
from lightning_vescale.planner._search import Instance, search
from lightning_vescale.planner._spec import TensorSpec, check_count, resolve_entries

__all__ = [
    "DEFAULT_ALIGN",
    "LayoutPlan",
    "PaddingFigures",
    "plan_layout",
    "shard_size_lower_bound",
]

#: Default collective alignment in elements. Every rank's shard then starts on a 16-element
#: boundary: 32 bytes for 2-byte dtypes, 64 bytes for fp32, which the vectorized copy and
#: NCCL fast paths like. It costs at most 15 elements per rank; pass ``align=1`` for none.
DEFAULT_ALIGN = 16


class PaddingFigures:
    """Buffer and padding figures shared by :class:`LayoutPlan` and the baselines' figures.

    The subclass provides ``world_size``, ``shard_size`` (elements per rank) and
    ``total_numel`` (elements of real data).
    """

    world_size: int
    shard_size: int

    @property
    def buffer_size(self) -> int:
        """``world_size * shard_size``: elements of the whole (unsharded) buffer."""
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        """Elements of the buffer that hold no tensor: ``world_size * shard_size - total``."""
        return self.buffer_size - self.total_numel  # type: ignore[attr-defined]

    @property
    def padding_ratio(self) -> float:
        """``padding / buffer_size``: the fraction of communicated/stored elements that is waste."""
        return self.padding / self.buffer_size if self.buffer_size else 0.0


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutPlan(PaddingFigures):
    """Where each tensor of one group lives in the group's flat buffer of ``world_size * S``.

    Built by :func:`plan_layout`; see design note [planner] in this module. All ranges are
    half-open ``(start, end)`` element ranges. Picklable; equal plans compare equal.

    Attributes:
        world_size: ranks ``m``; rank ``r`` owns buffer elements ``[r*S, (r+1)*S)``.
        shard_size: ``S``, a multiple of ``align``.
        align: the collective alignment the plan was made with.
        entries: the tensors in buffer order (the caller's order), granularity in elements.
        offset_list: ``entries[i]`` lives at ``[offset_list[i], offset_list[i] + numel)``.
        lower_bound: :func:`shard_size_lower_bound` of the instance (no order does better).
        exact: True when ``shard_size`` is optimal among layouts keeping the order (the exact
            scan reached it); :attr:`optimal` when it equals ``lower_bound``.
    """

    world_size: int
    shard_size: int
    align: int
    entries: tuple[TensorSpec, ...]  # in buffer order; granularity resolved to elements
    offset_list: tuple[int, ...]  # offset of entries[i]
    lower_bound: int = 0  # shard_size_lower_bound() of the instance (0: unknown)
    exact: bool = False  # True when shard_size is optimal among order-preserving layouts
    _index: dict = field(init=False, default_factory=dict, repr=False, compare=False)
    _placements: dict = field(init=False, default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.offset_list) != len(self.entries):
            raise ValueError(
                f"offset_list has {len(self.offset_list)} entries for {len(self.entries)} tensors"
            )
        self._index.clear()
        self._index.update({s.name: i for i, s in enumerate(self.entries)})
        offsets = dict(zip((s.name for s in self.entries), self.offset_list))
        object.__setattr__(self, "_offsets", offsets)

    def __getstate__(self):  # drop caches; they are rebuilt on load
        state = dict(self.__dict__)
        state["_placements"] = {}
        state.pop("_offsets", None)
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    # -- sizes (buffer_size, padding, padding_ratio: PaddingFigures) ----------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names in buffer order."""
        return tuple(s.name for s in self.entries)

    @property
    def offsets(self) -> Mapping[str, int]:
        """Read-only ``name -> offset`` of each tensor in the buffer."""
        return types.MappingProxyType(self._offsets)  # type: ignore[attr-defined]

    @property
    def total_numel(self) -> int:
        """Elements of real data (sum of tensor numels)."""
        return sum(s.numel for s in self.entries)

    @property
    def optimal(self) -> bool:
        """True when ``shard_size`` equals the lower bound, i.e. no layout in any order is smaller."""
        return self.shard_size == self.lower_bound

    def spec(self, name: str) -> TensorSpec:
        """The entry of tensor ``name`` (granularity in elements)."""
        try:
            return self.entries[self._index[name]]
        except KeyError:
            raise KeyError(f"{name!r} is not a tensor of this plan") from None

    # -- ranges ----------------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside [0, {self.world_size})")

    def local_range(self, name: str, rank: int) -> tuple[int, int]:
        """Flat range of tensor ``name`` (relative to the tensor) that ``rank`` owns.

        Ranks before the tensor get ``(0, 0)``, ranks after it ``(numel, numel)``, matching
        :meth:`RaggedShard.local_range`.
        """
        self._check_rank(rank)
        spec = self.spec(name)
        off, e, s = self._offsets[name], spec.numel, self.shard_size  # type: ignore[attr-defined]
        return (min(max(rank * s - off, 0), e), min(max((rank + 1) * s - off, 0), e))

    def buffer_range(self, name: str, rank: int) -> tuple[int, int]:
        """Same range as :meth:`local_range`, in buffer coordinates (add the tensor's offset)."""
        start, end = self.local_range(name, rank)
        off = self._offsets[name]  # type: ignore[attr-defined]
        return (start + off, end + off)

    def ranks_spanned(self, name: str) -> range:
        """Ranks that own at least one element of ``name`` (empty for zero-size tensors)."""
        spec = self.spec(name)
        off, s = self._offsets[name], self.shard_size  # type: ignore[attr-defined]
        if spec.numel == 0:
            return range(0)
        return range(off // s, (off + spec.numel - 1) // s + 1)

    def placement(self, name: str) -> RaggedShard:
        """The tensor's ``RaggedShard``; its ``local_range(shape, r)`` equals ``local_range``."""
        cached = self._placements.get(name)
        if cached is not None:
            return cached
        spec = self.spec(name)
        e, shape = spec.numel, spec.shape
        ranks = self.ranks_spanned(name)
        units = [0] * self.world_size
        if len(ranks) <= 1:  # one owner (or a zero-size tensor): one unit on one rank
            owner = ranks[0] if len(ranks) else min(
                self._offsets[name] // self.shard_size, self.world_size - 1  # type: ignore
            )
            units[owner] = 1
            result = RaggedShard((), units)
        else:
            cuts = [end for _, end in (self.local_range(name, r) for r in ranks[:-1])]
            unit = math.gcd(e, *cuts)
            k = 0  # shortest dims prefix whose trailing product divides the unit
            while unit % math.prod(shape[k:]) != 0:
                k += 1
            for r in ranks:
                a, b = self.local_range(name, r)
                units[r] = (b - a) // unit
            result = RaggedShard(tuple(range(k)), units)
        self._placements[name] = result
        return result

    # -- loads -----------------------------------------------------------------------------------
    def rank_loads(self) -> list[int]:
        """Elements of real data each rank owns (padding excluded)."""
        s, m = self.shard_size, self.world_size
        diff = [0] * (m + 1)
        for spec, off in zip(self.entries, self.offset_list):
            e = spec.numel
            if e == 0:
                continue
            end = off + e
            r0, r1 = off // s, (end - 1) // s
            if r0 == r1:
                diff[r0] += e
                diff[r0 + 1] -= e
                continue
            # partial head on r0, full ranks r0+1..r1-1, partial tail on r1
            head = (r0 + 1) * s - off
            diff[r0] += head
            diff[r0 + 1] -= head
            if r1 > r0 + 1:
                diff[r0 + 1] += s
                diff[r1] -= s
            tail = end - r1 * s
            diff[r1] += tail
            diff[r1 + 1] -= tail
        return list(accumulate(diff[:m]))

    @property
    def imbalance(self) -> float:
        """``max(rank_loads) / mean(rank_loads)`` (1.0 is perfect balance)."""
        total = self.total_numel
        return max(self.rank_loads()) * self.world_size / total if total else 1.0

    def describe(self, max_rows: int = 64) -> str:
        """A readable table: per tensor offset/size/granularity/ranks, per rank load, totals."""
        lines = [
            f"LayoutPlan: world_size={self.world_size} shard_size(S)={self.shard_size} "
            f"buffer={self.buffer_size} real={self.total_numel} padding={self.padding} "
            f"({100 * self.padding_ratio:.3f}%) align={self.align} "
            f"lower_bound(S)={self.lower_bound} exact={self.exact}",
            f"{'tensor':<40} {'shape':<22} {'offset':>14} {'numel':>13} {'gran':>9} ranks",
        ]
        for i, (spec, off) in enumerate(zip(self.entries, self.offset_list)):
            if i == max_rows:
                lines.append(f"... {len(self.entries) - max_rows} more tensors")
                break
            rs = self.ranks_spanned(spec.name)
            span = f"{rs.start}-{rs.stop - 1}" if len(rs) > 1 else (str(rs.start) if rs else "-")
            lines.append(
                f"{spec.name[:40]:<40} {str(tuple(spec.shape))[:22]:<22} {off:>14} "
                f"{spec.numel:>13} {spec.granularity:>9} {span}"
            )
        loads = self.rank_loads()
        lines.append(f"{'rank':>6} {'load':>14} {'padding':>12}")
        shown = loads if len(loads) <= max_rows else loads[: max_rows // 2]
        for r, load in enumerate(shown):
            lines.append(f"{r:>6} {load:>14} {self.shard_size - load:>12}")
        if len(shown) < len(loads):
            lines.append(f"... {len(loads) - len(shown)} more ranks")
        lines.append(
            f"load: min={min(loads)} max={max(loads)} imbalance(max/mean)={self.imbalance:.4f}"
        )
        return "\n".join(lines)



# ------------------------------------------------------------------------------------------------
# Planning (the search itself: lightning_vescale.planner._search)
# ------------------------------------------------------------------------------------------------
def _instance(specs: list[TensorSpec], world_size: int, align: int) -> Instance:
    """The search's view of resolved ``specs``: numels and granularities in buffer order."""
    return Instance([s.numel for s in specs], [s.granularity for s in specs], world_size, align)


def shard_size_lower_bound(
    tensors: Iterable,
    world_size: int,
    *,
    granularity: Granularity | None = 1,
    align: int = DEFAULT_ALIGN,
) -> int:
    """A lower bound on ``S`` valid for any layout (any order) of ``tensors``.

    The smallest multiple of ``align`` (and of ``g_t`` for every tensor with ``e_t > 2S``) that
    is at least ``ceil(sum(e_t) / world_size)`` and at least ``min(e_t, g_t)`` for every tensor.
    """
    check_count("world_size", world_size, 1)
    check_count("align", align, 1)
    return _instance(resolve_entries(tensors, granularity), world_size, align).lower_bound()


def plan_layout(
    tensors: Iterable,
    world_size: int,
    *,
    granularity: Granularity | None = 1,
    align: int = DEFAULT_ALIGN,
    max_shard_size: int | None = None,
) -> LayoutPlan:
    """Plan one sharding group's flat buffer; see design note [planner] in this module.

    Args:
        tensors: ordered entries, each a :class:`TensorSpec` or a tuple ``(name, shape)`` /
            ``(name, shape, granularity)``. The buffer keeps this order.
        world_size: ranks ``m`` sharing the buffer.
        granularity: default granularity for entries without one, any form of
            :func:`~lightning_vescale.planner.check_granularity` (elements as an int,
            ``"element"``/``"row"``/``"<k>rows"`` resolved per tensor shape, ``None`` = 1).
        align: every rank's shard size ``S`` (hence every shard start) is a multiple of this
            many elements. Defaults to :data:`DEFAULT_ALIGN`.
        max_shard_size: optional cap on ``S``; a tensor that cannot be placed under it raises.

    Returns:
        A frozen :class:`LayoutPlan`. Deterministic: the same input gives the same plan.

    Raises:
        ValueError: bad input (empty list, ``world_size < 1``, bad shape/granularity/align,
            duplicate names) or no layout with ``S <= max_shard_size`` (naming the tensor).
    """
    check_count("world_size", world_size, 1)
    check_count("align", align, 1)
    if max_shard_size is not None:
        check_count("max_shard_size", max_shard_size, 1)
    specs = resolve_entries(tensors, granularity)
    m = world_size
    inst = _instance(specs, m, align)
    lb = inst.lower_bound()
    if max_shard_size is not None:
        _check_cap(specs, max_shard_size, align, lb)
    found = search(inst, lb)
    s = found.shard_size
    offsets = inst.greedy(s, None, record=True).offsets
    assert offsets is not None, "the search returned an infeasible shard size"
    if max_shard_size is not None and s > max_shard_size:
        raise ValueError(
            f"no layout of these {len(specs)} tensors over world_size={m} found with "
            f"S <= max_shard_size={max_shard_size} (best S={s}, lower bound {lb}); raise "
            "max_shard_size, the world size, or use a finer granularity."
        )
    return LayoutPlan(
        world_size=m,
        shard_size=s,
        align=align,
        entries=tuple(specs),
        offset_list=tuple(offsets),
        lower_bound=lb,
        exact=found.exact,
    )


def _check_cap(specs: list[TensorSpec], cap: int, align: int, lb: int) -> None:
    """Raise early, naming the culprit, when no ``S <= cap`` can exist."""
    for spec in specs:
        if min(spec.numel, spec.granularity) > cap:
            raise ValueError(
                f"tensor {spec.name!r} (shape={spec.shape}, granularity={spec.granularity} "
                f"elements) cannot be placed with S <= max_shard_size={cap}: one of its blocks "
                "is larger than a shard; use a finer granularity or a larger max_shard_size."
            )
    if lb > cap:
        raise ValueError(
            f"the smallest admissible shard size is {lb} > max_shard_size={cap} (align={align}, "
            "granularities of tensors spanning several shards); raise max_shard_size."
        )
