"""Layer 1: the structure-aware layout planner.

Design note [planner]
---------------------
One sharding group owns one flat buffer of ``m * S`` elements (``m`` ranks, ``S`` elements per
rank). Every tensor ``t`` of the group gets an offset ``l_t``; its ``e_t`` elements live at
``[l_t, l_t + e_t)`` and rank ``r`` owns ``[r*S, (r+1)*S)``. Each tensor has a *granularity*
``g_t`` (elements in one unsplittable block: 1 element-wise, a row, ``b`` rows of a quantization
tile, ``e_t`` for "whole tensor on one rank"). A layout is valid when

* the intervals are disjoint and inside ``[0, m*S)``,
* every rank boundary ``k*S`` strictly inside ``[l_t, l_t + e_t)`` lies at a multiple of ``g_t``
  from ``l_t`` (so every rank's local range of ``t`` starts and ends on a multiple of ``g_t`` or
  at the tensor's end; a trailing partial block is allowed when ``g_t`` does not divide ``e_t``),
* ``S`` is a multiple of the collective alignment ``align``.

We minimize ``S`` (equivalently the padding ``m*S - sum(e_t)``). The general problem is NP-hard
(it contains bin packing: take ``g_t = e_t``). The planner keeps the caller's tensor order and
solves the order-preserving problem as follows.

*Fixed S, fixed order: greedy earliest start is exact.* Place each tensor at the earliest legal
offset at or after the end of the previous one. The earliest legal end of tensor ``i+1`` is a
non-decreasing function of the end of tensor ``i``, so by induction the greedy minimizes every
end, and a fixed ``S`` admits an order-preserving layout iff the greedy's end ``E(S) <= m*S``.
The earliest legal start from cursor ``c`` is found in O(1): with ``B`` the next boundary after
``c`` and ``d`` the largest multiple of ``g`` not exceeding ``B - c``, start at ``c`` if the tensor
fits before ``B``; else at ``B - d`` if ``d > 0`` and the tensor crosses only one boundary or
``g | S``; else retry once from ``B`` (a fresh shard is the best any later position can offer).
Runs of tensors that fit between two boundaries are skipped with a binary search on prefix sums,
so one evaluation costs ``O(k log n)`` with ``k <= min(n, 2m + 1)`` loop steps (each step places
a run or a tensor that crosses a boundary).

*Candidate S.* ``S`` must be a multiple of ``align`` and of ``g_t`` for every tensor with
``e_t > 2S`` (it crosses at least two boundaries, whose distance ``S`` must then be a multiple of
``g_t``); it is at least ``ceil(sum(e_t)/m)`` and at least ``min(e_t, g_t)`` for every ``t``.
The smallest such candidate is :func:`shard_size_lower_bound` (a lower bound for *any* order).
The search:

1. scans candidates upward from the lower bound while a work budget lasts (``_SCAN_WORK`` loop
   steps, about 10 ms; always enough for small instances). Exact: the first feasible candidate
   is the optimum among order-preserving layouts (``LayoutPlan.exact``);
2. past the budget, jumps to the candidate at ``ceil(E(S)/m)`` (the overflow says how much room
   the current waste needs), galloping if that stalls, never past ``S_ub`` (below);
3. probes *learned steps*: the greedy reports the granularities of tensors that could not cross
   two boundaries because ``g_t`` does not divide ``S``, with the waste that caused; for every
   subset of the (up to 4) costliest, it walks the candidates that are also multiples of the
   subset's lcm upward from the lower bound (at most 48 probes in all);
4. bisects between the largest infeasible candidate below the best and the best (feasibility
   is not monotone in ``S``, so this only ever refines a feasible result).

We re-ran every group of the benchmarks (LLaMA-3-70B and GPT-OSS-120B per block and whole, 8 to
16,384 ranks; DeepSeek-V3 at 8, 1,024 and 10,000 ranks; element to 128-row granularity) where
the budget ran out with an unlimited exact scan: steps 2-4 found the order-optimal ``S`` in
every case. Reordering (sorting by size or granularity, either way) never gave a smaller ``S``
on those cases, so the caller's order is kept: views, checkpoints and debugging stay predictable.

*Bound.* Let ``w = max_t min(g_t, e_t)`` and ``S_ub`` the first ``S >= ceil(sum(e_t)/m) + w - 1``
that is a multiple of ``align`` and of ``g_t`` for every tensor longer than ``S``. At such an
``S`` every greedy shift wastes fewer than ``w`` elements, inside the shard whose end boundary
the shifted tensor then crosses or starts at (so at most one shift per shard), hence real data
in ``[0, m*S)`` is at least ``m*S - m*(w-1) >= sum(e_t)``: everything fits. The guided search
never jumps past ``S_ub``, so always ``lower_bound <= S <= S_ub``. Tests check the exact scan
against brute force and this bound. In practice (rows of a few thousand elements, ``S`` in the
millions) ``S`` is the lower bound or a few candidates above it.

Complexity: ``O(n log n)`` set-up, ``O(k log n)`` per evaluated ``S``, the budgeted scan, then at
most about 150 evaluations (jumps, 48 learned-step probes, 64 bisection steps), in practice a
dozen. A DeepSeek-V3-sized model at 10,000 ranks plans in well under a second (see
``benchmarks/RESULTS_planner.md``).

Each tensor's :class:`~lightning_vescale.placement.RaggedShard` is derived from the plan: the
unit is the gcd of the tensor's numel and all rank cuts inside it, expressed on the shortest
prefix of dims whose trailing product divides it, so ``RaggedShard.local_range(shape, r)``
reproduces :meth:`LayoutPlan.local_range` exactly.
"""

from __future__ import annotations

import bisect
import math
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from lightning_vescale.placement import RaggedShard

__all__ = [
    "DEFAULT_ALIGN",
    "TensorSpec",
    "LayoutPlan",
    "plan_layout",
    "resolve_granularity",
    "shard_size_lower_bound",
]

#: Default collective alignment in elements. Every rank's shard then starts on a 16-element
#: boundary: 32 bytes for 2-byte dtypes, 64 bytes for fp32, which the vectorized copy and
#: NCCL fast paths like. It costs at most 15 elements per rank; pass ``align=1`` for none.
DEFAULT_ALIGN = 16

# Work budget (tensor steps) of the exact linear scan over candidate shard sizes.
_SCAN_WORK = 20_000

Granularity = int | str


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a group: ``name``, ``shape`` and optional ``granularity``.

    ``granularity`` is elements per unsplittable block (an ``int >= 1``) or one of
    ``"element"``, ``"row"``, ``"<k>rows"`` (see :func:`resolve_granularity`); ``None`` takes
    the ``granularity`` given to :func:`plan_layout`.
    """

    name: str
    shape: tuple[int, ...]
    granularity: Granularity | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec name must be a non-empty str, got name={self.name!r}")
        try:
            raw = tuple(self.shape)
        except TypeError as exc:
            raise ValueError(
                f"TensorSpec {self.name!r}: shape must be a sequence of ints, got "
                f"shape={self.shape!r}"
            ) from exc
        if not all(type(d) is int and d >= 0 for d in raw):  # slow path: int-likes, errors
            if not all(
                hasattr(d, "__index__") and not isinstance(d, bool) and d.__index__() >= 0
                for d in raw
            ):
                raise ValueError(
                    f"TensorSpec {self.name!r}: shape must hold non-negative ints, got "
                    f"shape={self.shape!r}"
                )
            raw = tuple(d.__index__() for d in raw)
        object.__setattr__(self, "shape", raw)
        if self.granularity is not None and (
            isinstance(self.granularity, bool) or not isinstance(self.granularity, (int, str))
        ):
            raise ValueError(
                f"TensorSpec {self.name!r}: granularity must be an int >= 1, a str or None, got "
                f"granularity={self.granularity!r}"
            )

    @classmethod
    def _trusted(cls, name: str, shape: tuple[int, ...], granularity: int) -> TensorSpec:
        # Internal: build an already-validated spec without re-validating (planning speed).
        spec = object.__new__(cls)
        object.__setattr__(spec, "name", name)
        object.__setattr__(spec, "shape", shape)
        object.__setattr__(spec, "granularity", granularity)
        return spec

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def resolve_granularity(granularity: Granularity, shape: Sequence[int]) -> int:
    """Granularity in elements for a tensor of ``shape``.

    * ``int >= 1``: elements, as is (a decimal string such as ``"4096"`` too).
    * ``"element"``: 1.
    * ``"row"``: one row of the innermost matrix, ``shape[-1]`` elements for tensors with 2 or
      more dims (so a stacked-expert ``(E, out, in)`` weight keeps its matrices' rows whole);
      1 for 0-/1-D tensors (norm weights and biases are vectors of one-element rows).
    * ``"<k>rows"`` (e.g. ``"32rows"``): ``k`` such rows (``k`` elements for 0-/1-D tensors),
      the tile of a row-blocked quantizer.

    The result may exceed the tensor's numel, which means "the whole tensor on one rank";
    "whole matrix per rank" for Muon-style optimizers is ``granularity=numel``.
    """
    if isinstance(granularity, bool):
        raise ValueError(f"granularity must be an int >= 1 or a str, got {granularity!r}")
    if isinstance(granularity, int):
        if granularity < 1:
            raise ValueError(
                f"granularity must be >= 1 element, got granularity={granularity}; use 1 for "
                "element-wise sharding."
            )
        return granularity
    if isinstance(granularity, str):
        shape = tuple(shape)
        row = shape[-1] if len(shape) >= 2 else 1
        text = granularity.strip().lower()
        if text in ("element", "elements", "elem"):
            return 1
        if text in ("row", "rows"):
            return max(row, 1)
        match = re.fullmatch(r"(\d+)\s*-?\s*rows?", text)
        if match and int(match.group(1)) >= 1:
            return max(int(match.group(1)) * row, 1)
        if text.isdigit() and int(text) >= 1:
            return int(text)
    raise ValueError(
        f"granularity={granularity!r} is not understood; use an int >= 1 (elements), "
        "'element', 'row' or '<k>rows' (e.g. '32rows')."
    )


def _as_specs(tensors: Iterable, default: Granularity) -> list[tuple[str, tuple[int, ...], int]]:
    out: list[tuple[str, tuple[int, ...], int]] = []
    seen: set[str] = set()
    try:
        resolve_granularity(default, (1, 1))
    except ValueError as exc:
        raise ValueError(f"plan_layout: {exc}") from None
    default_int = default if type(default) is int else None
    for i, item in enumerate(tensors):
        if isinstance(item, TensorSpec):
            spec = item
        elif isinstance(item, tuple) and len(item) in (2, 3):
            spec = TensorSpec(*item)
        else:
            raise ValueError(
                f"tensors[{i}]={item!r} must be a TensorSpec or a tuple (name, shape) / "
                "(name, shape, granularity)."
            )
        if spec.name in seen:
            raise ValueError(f"tensor name {spec.name!r} appears twice; names must be unique.")
        seen.add(spec.name)
        gran = spec.granularity if spec.granularity is not None else default
        if gran is default_int:
            g = default_int
        elif type(gran) is int and gran >= 1:
            g = gran
        else:
            try:
                g = resolve_granularity(gran, spec.shape)
            except ValueError as exc:
                raise ValueError(f"tensor {spec.name!r}: {exc}") from None
        out.append((spec.name, spec.shape, g))
    if not out:
        raise ValueError("tensors is empty; a sharding group needs at least one tensor.")
    return out


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {name}={value!r}")
    return value


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutPlan:
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

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def buffer_size(self) -> int:
        """``world_size * shard_size``: elements of the whole (unsharded) buffer."""
        return self.world_size * self.shard_size

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """Alias of ``entries``: the tensors in buffer order with granularity in elements."""
        return self.entries

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
    def padding(self) -> int:
        """Elements of the buffer that hold no tensor: ``world_size * shard_size - total``."""
        return self.buffer_size - self.total_numel

    @property
    def padding_ratio(self) -> float:
        """``padding / buffer_size``: the fraction of communicated/stored elements that is waste."""
        return self.padding / self.buffer_size if self.buffer_size else 0.0

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
            cuts = [self.local_range(name, r)[1] for r in ranks[:-1]]
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
# The algorithm
# ------------------------------------------------------------------------------------------------
class _Instance:
    """Sizes/granularities in order with prefix sums and candidate-S helpers."""

    def __init__(self, sizes: list[int], grans: list[int], m: int, align: int) -> None:
        self.sizes, self.grans, self.m, self.align = sizes, grans, m, align
        self.total = sum(sizes)
        self.prefix = [0, *accumulate(sizes)]
        # tensors sorted by size (descending) with running lcm of their granularities: the step
        # S must be a multiple of is lcm(align, g_t for e_t > 2S) = _lcm_prefix[#{e_t > 2S}]
        order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
        self._neg_sizes = [-sizes[i] for i in order]
        lcm = align
        self._lcm_prefix = [lcm]
        for i in order:
            lcm = math.lcm(lcm, grans[i]) if sizes[i] > 0 else lcm
            self._lcm_prefix.append(lcm)
        # breakpoints: S >= ceil(e/factor) drops tensor e from the set {e_t > factor * S}
        self._breaks = {f: sorted({-(-e // f) for e in sizes}) for f in (1, 2)}

    def step(self, s: int, factor: int = 2) -> int:
        """``lcm(align, g_t for e_t > factor * s)``: ``factor=2`` is necessary for any layout
        (tensors crossing two boundaries); ``factor=1`` makes every crossing cheap (bound)."""
        count = bisect.bisect_left(self._neg_sizes, -factor * s)  # number of e_t > factor*s
        return self._lcm_prefix[count]

    def next_candidate(self, x: int, factor: int = 2) -> int:
        """Smallest ``S >= x`` that is a multiple of ``step(S, factor)``."""
        s = max(x, 1)
        breaks = self._breaks[factor]
        while True:
            st = self.step(s, factor)
            cand = -(-s // st) * st
            i = bisect.bisect_right(breaks, s)
            nxt = breaks[i] if i < len(breaks) else None
            if nxt is None or cand < nxt:
                return cand
            s = nxt

    def lower_bound(self) -> int:
        lb = -(-self.total // self.m)
        for e, g in zip(self.sizes, self.grans):
            lb = max(lb, min(e, g))
        return self.next_candidate(max(lb, 1))

    def bound_candidate(self) -> int:
        """``S_ub``: the first ``S >= ceil(total/m) + w - 1`` (``w = max_t min(g_t, e_t)``) that
        is a multiple of ``align`` and of ``g_t`` for every tensor longer than ``S``. The greedy
        always fits there (see design note [planner])."""
        w = max((min(e, g) for e, g in zip(self.sizes, self.grans)), default=1)
        return self.next_candidate(max(-(-self.total // self.m) + max(w, 1) - 1, 1), factor=1)

    def greedy(
        self, s: int, limit: int | None, record: bool = False
    ) -> tuple[int, list[int] | bool | None, int, dict[int, int]]:
        """Greedy earliest-start placement for shard size ``s``.

        Returns ``(end, placed, work, need)``; ``end`` is ``-1`` when some tensor cannot be
        placed for this ``s`` at all, and the run stops early once ``end`` exceeds ``limit``.
        ``placed`` is ``None`` unless the run completed, else the offsets when ``record``
        (else ``True``: the search only needs ends). ``need`` maps each granularity that
        could not cross two boundaries because it does not divide ``s`` to the elements that
        cost (a multiple of it would have saved them): the search learns steps from it.
        """
        sizes, grans, prefix = self.sizes, self.grans, self.prefix
        n = len(sizes)
        offsets = [0] * n if record else None
        c = 0  # cursor: end of the previous tensor
        i = 0
        work = 0
        need: dict[int, int] = {}
        bisect_right = bisect.bisect_right
        while i < n:
            work += 1
            # skip the run of tensors that fit before the next boundary
            b = (c // s + 1) * s
            # largest j with c + prefix[j] - prefix[i] <= b  (tensors i..j-1 fit)
            j = bisect_right(prefix, b - c + prefix[i], i, n + 1) - 1
            if j > i:
                base = c - prefix[i]
                if record:
                    offsets[i:j] = [base + x for x in prefix[i:j]]
                c = base + prefix[j]
                i = j
                continue  # the cursor may sit on a boundary: the next run starts afresh
            e, g = sizes[i], grans[i]
            # tensor i crosses boundary b when started at c: find its earliest legal start
            d0 = b - c
            d = d0 - d0 % g
            if d > 0 and (e <= d + s or s % g == 0):
                start = b - d
            else:
                # fresh shard at b: d0 = s
                if e <= s:
                    start = b
                else:
                    d1 = s - s % g
                    if d1 > 0 and (e <= d1 + s or s % g == 0):
                        start = b + s - d1
                    else:
                        need[g] = need.get(g, 0) + s
                        return -1, None, work, need
                if d > 0:  # it could have crossed at b - d, twice, had g divided s
                    need[g] = need.get(g, 0) + start - (b - d)
            if record:
                offsets[i] = start
            c = start + e
            i += 1
            if limit is not None and c > limit:
                return c, None, work, need
        return c, (offsets if record else True), work, need


def shard_size_lower_bound(
    tensors: Iterable, world_size: int, *, granularity: Granularity = 1, align: int = DEFAULT_ALIGN
) -> int:
    """A lower bound on ``S`` valid for any layout (any order) of ``tensors``.

    The smallest multiple of ``align`` (and of ``g_t`` for every tensor with ``e_t > 2S``) that
    is at least ``ceil(sum(e_t) / world_size)`` and at least ``min(e_t, g_t)`` for every tensor.
    """
    _check_int("world_size", world_size, 1)
    _check_int("align", align, 1)
    specs = _as_specs(tensors, granularity)
    inst = _Instance([math.prod(s) for _, s, _ in specs], [g for *_, g in specs], world_size, align)
    return inst.lower_bound()


def plan_layout(
    tensors: Iterable,
    world_size: int,
    *,
    granularity: Granularity = 1,
    align: int = DEFAULT_ALIGN,
    max_shard_size: int | None = None,
) -> LayoutPlan:
    """Plan one sharding group's flat buffer; see design note [planner] in this module.

    Args:
        tensors: ordered entries, each a :class:`TensorSpec` or a tuple ``(name, shape)`` /
            ``(name, shape, granularity)``. The buffer keeps this order.
        world_size: ranks ``m`` sharing the buffer.
        granularity: default granularity for entries without one: elements (int) or
            ``"element"``/``"row"``/``"<k>rows"`` resolved per tensor shape.
        align: every rank's shard size ``S`` (hence every shard start) is a multiple of this
            many elements. Defaults to :data:`DEFAULT_ALIGN`.
        max_shard_size: optional cap on ``S``; a tensor that cannot be placed under it raises.

    Returns:
        A frozen :class:`LayoutPlan`. Deterministic: the same input gives the same plan.

    Raises:
        ValueError: bad input (empty list, ``world_size < 1``, bad shape/granularity/align,
            duplicate names) or no layout with ``S <= max_shard_size`` (naming the tensor).
    """
    _check_int("world_size", world_size, 1)
    _check_int("align", align, 1)
    if max_shard_size is not None:
        _check_int("max_shard_size", max_shard_size, 1)
    specs = _as_specs(tensors, granularity)
    sizes = [math.prod(shape) for _, shape, _ in specs]
    grans = [g for *_, g in specs]
    m = world_size
    inst = _Instance(sizes, grans, m, align)
    lb = inst.lower_bound()
    if max_shard_size is not None:
        _check_cap(specs, sizes, grans, max_shard_size, align, lb)
    s, exact = _search(inst, lb)
    offsets = inst.greedy(s, None, record=True)[1]
    assert isinstance(offsets, list), "the search returned an infeasible shard size"
    if max_shard_size is not None and s > max_shard_size:
        raise ValueError(
            f"no layout of these {len(specs)} tensors over world_size={m} found with "
            f"S <= max_shard_size={max_shard_size} (best S={s}, lower bound {lb}); raise "
            "max_shard_size, the world size, or use a finer granularity."
        )
    entries = tuple(TensorSpec._trusted(name, shape, g) for name, shape, g in specs)
    return LayoutPlan(
        world_size=m,
        shard_size=s,
        align=align,
        entries=entries,
        offset_list=tuple(offsets),
        lower_bound=lb,
        exact=exact,
    )


def _check_cap(specs, sizes, grans, cap, align, lb) -> None:
    for (name, shape, g), e in zip(specs, sizes):
        if min(e, g) > cap:
            raise ValueError(
                f"tensor {name!r} (shape={tuple(shape)}, granularity={g} elements) cannot be "
                f"placed with S <= max_shard_size={cap}: one of its blocks is larger than a "
                "shard; use a finer granularity or a larger max_shard_size."
            )
    if lb > cap:
        raise ValueError(
            f"the smallest admissible shard size is {lb} > max_shard_size={cap} (align={align}, "
            "granularities of tensors spanning several shards); raise max_shard_size."
        )


def _search(inst: _Instance, lb: int) -> tuple[int, bool]:
    """Smallest feasible candidate S found: exact scan under a budget, then guided probes.

    Returns ``(S, exact)``; ``exact`` is True when every candidate below ``S`` was
    evaluated (so ``S`` is optimal among layouts that keep the order).
    """
    m = inst.m
    s = lb
    work = 0
    learned: dict[int, int] = {}  # granularity -> waste its failed double crossings caused

    def learn(need: dict[int, int]) -> None:
        for g, waste in need.items():
            learned[g] = learned.get(g, 0) + waste

    # 1) exact linear scan over candidates while the budget lasts
    scanned = lb - 1  # every candidate <= scanned is infeasible
    while work <= _SCAN_WORK:
        end, offs, w, need = inst.greedy(s, m * s)
        work += w
        if offs is not None and end <= m * s:
            return s, True
        learn(need)
        scanned = s
        s = inst.next_candidate(s + 1)
    ends: dict[int, int] = {}  # evaluated S -> greedy end (feasible iff end <= m*S)
    best = None

    def probe(x: int) -> bool:
        nonlocal best
        if x not in ends and (best is None or x < best):
            end, offs, _, need = inst.greedy(x, None)
            ends[x] = end if offs is not None else -1
            learn(need)
            if offs is not None and end <= m * x:
                best = x
        return best == x

    # 2) overflow-guided jumps until feasible, never past the bound candidate ``ub`` (always
    #    feasible, see [planner] *Bound*); gallop when the jumps stall
    ub = inst.bound_candidate()
    stall = 1
    while not probe(s):
        want = -(-ends[s] // m) if ends[s] > 0 else s + 1
        nxt = inst.next_candidate(max(want, s + stall))
        stall = stall * 2 if nxt <= want + inst.step(nxt) else 1
        s = min(nxt, ub) if s < ub else nxt
    # 3) learned steps: candidates that are also multiples of some of the granularities whose
    #    double crossings failed avoid that waste. Try every subset of the (up to 4) costliest,
    #    densest lcm first; walk each sequence upward from the lower bound, jumping by the
    #    overflow, while below the best.
    top = sorted(learned, key=lambda g: (-learned[g], g))[:4]
    subsets = sorted(
        {math.lcm(*(g for k, g in enumerate(top) if mask >> k & 1))
         for mask in range(1, 1 << len(top))}
    )
    budget = 48
    for step in subsets:
        x = lb
        for _ in range(8):
            for _ in range(4):  # the step set can shrink as S grows: settle on a fixed point
                st = math.lcm(inst.step(x), step)
                y = inst.next_candidate(-(-x // st) * st)
                if y == x:
                    break
                x = y
            if x >= best or budget <= 0:
                break
            budget -= x not in ends
            if probe(x):
                break
            x = max(x + 1, -(-ends[x] // m) if ends[x] > 0 else 0)
    # 4) bisection between the largest infeasible candidate below the best and the best
    #    (feasibility is not monotone in S: a refinement that only ever keeps feasible results)
    for _ in range(64):
        lo = max((t for t in ends if t < best), default=scanned)
        lo = max(lo, scanned)
        if best - lo <= 1:
            break
        mid = inst.next_candidate((lo + best) // 2 + 1)
        if mid >= best:
            mid = inst.next_candidate(lo + 1)
            if mid >= best:
                break
        probe(mid)
    return best, False
