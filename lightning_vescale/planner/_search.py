"""The search over shard sizes ``S`` behind :func:`~lightning_vescale.planner.plan_layout`.

Pure integer arithmetic on the group's sizes and granularities in buffer order: no names, no
shapes, no placements (those belong to :mod:`lightning_vescale.planner._layout`, the only
importer).
The layout rules and the objective are in design note [planner]; this note is how the planner
meets them.

Design note [plan-search]
-------------------------
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
The smallest such candidate is :meth:`Instance.lower_bound` (a lower bound for *any* order;
public as :func:`~lightning_vescale.planner.shard_size_lower_bound`). :func:`search`:

1. scans candidates upward from the lower bound while a work budget lasts (:data:`SCAN_WORK`
   loop steps, about 10 ms; always enough for small instances). Exact:
   the first feasible candidate is the optimum among order-preserving layouts
   (``LayoutPlan.exact``);
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
(Whole experts after element-granular tensors do pad: there the experts-first order alone does
not help either, since the leftovers at rank ends are lost; they get a buffer of their own
instead, design note [plan-buckets].)

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
"""

from __future__ import annotations

import bisect
import math
from itertools import accumulate
from typing import NamedTuple

__all__ = ["SCAN_WORK", "GreedyRun", "Instance", "SearchResult", "search"]

#: Work budget (greedy loop steps, about 10 ms) of the exact scan over candidate shard sizes;
#: read at every :func:`search` call (tests set it to -1 to force the guided search).
SCAN_WORK = 20_000


class GreedyRun(NamedTuple):
    """What one greedy placement for a shard size ``S`` found (:meth:`Instance.greedy`)."""

    end: int  # end of the last placed tensor; -1 when some tensor cannot be placed at this S
    fits: bool  # every tensor placed within the m*S buffer: S is feasible
    offsets: list[int] | None  # each tensor's offset, when recorded and every tensor was placed
    work: int  # loop steps spent (the scan's budget counts them)
    need: dict[int, int]  # granularity -> waste of failed double crossings (see greedy)


class SearchResult(NamedTuple):
    """The shard size :func:`search` chose."""

    shard_size: int
    exact: bool  # every candidate below was evaluated: optimal among order-preserving layouts


class Instance:
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
        always fits there (see *Bound* in design note [plan-search])."""
        w = max((min(e, g) for e, g in zip(self.sizes, self.grans)), default=1)
        return self.next_candidate(max(-(-self.total // self.m) + max(w, 1) - 1, 1), factor=1)

    def greedy(self, s: int, limit: int | None, record: bool = False) -> GreedyRun:
        """Greedy earliest-start placement for shard size ``s``.

        ``end`` is ``-1`` when some tensor cannot be placed for this ``s`` at all, and the run
        stops early (not ``fits``) once ``end`` exceeds ``limit``. ``offsets`` are recorded
        only with ``record`` (the search only needs ends). ``need`` maps each granularity that
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
                        return GreedyRun(end=-1, fits=False, offsets=None, work=work, need=need)
                if d > 0:  # it could have crossed at b - d, twice, had g divided s
                    need[g] = need.get(g, 0) + start - (b - d)
            if record:
                offsets[i] = start
            c = start + e
            i += 1
            if limit is not None and c > limit:
                return GreedyRun(end=c, fits=False, offsets=None, work=work, need=need)
        return GreedyRun(end=c, fits=c <= self.m * s, offsets=offsets, work=work, need=need)


def _learned_steps(learned: dict[int, int]) -> list[int]:
    """The lcm of every subset of the (up to 4) granularities whose failed double crossings cost
    the most padding, ascending (densest first): :func:`search`'s step 3 walks each."""
    top = sorted(learned, key=lambda g: (-learned[g], g))[:4]
    return sorted({math.lcm(*(g for k, g in enumerate(top) if mask >> k & 1))
                   for mask in range(1, 1 << len(top))})


def _snap_to_step(inst: Instance, x: int, step: int) -> int:
    """The first candidate at or above ``x`` that is also a multiple of ``step``: the step set
    can shrink as S grows, so settle on a fixed point (at most 4 rounds)."""
    for _ in range(4):
        st = math.lcm(inst.step(x), step)
        y = inst.next_candidate(-(-x // st) * st)
        if y == x:
            break
        x = y
    return x


def search(inst: Instance, lb: int, *, scan_work: int | None = None) -> SearchResult:
    """Smallest feasible candidate S found: exact scan under a budget, then guided probes.

    ``scan_work`` is the budget (greedy loop steps) of the exact scan, :data:`SCAN_WORK` when
    ``None``; a negative one skips it. ``exact`` is True when every candidate below the
    result was evaluated (so it is optimal among layouts that keep the order).
    """
    if scan_work is None:
        scan_work = SCAN_WORK
    m = inst.m
    s = lb
    work = 0
    learned: dict[int, int] = {}  # granularity -> waste its failed double crossings caused

    def learn(need: dict[int, int]) -> None:
        for g, waste in need.items():
            learned[g] = learned.get(g, 0) + waste

    # 1) exact linear scan over candidates while the budget lasts
    scanned = lb - 1  # every candidate <= scanned is infeasible
    while work <= scan_work:
        run = inst.greedy(s, m * s)
        work += run.work
        if run.fits:
            return SearchResult(shard_size=s, exact=True)
        learn(run.need)
        scanned = s
        s = inst.next_candidate(s + 1)
    ends: dict[int, int] = {}  # evaluated S -> greedy end (feasible iff end <= m*S)
    best = None

    def probe(x: int) -> bool:
        nonlocal best
        if x not in ends and (best is None or x < best):
            run = inst.greedy(x, None)
            ends[x] = run.end
            learn(run.need)
            if run.fits:
                best = x
        return best == x

    # 2) overflow-guided jumps until feasible, never past the bound candidate ``ub`` (always
    #    feasible, see *Bound* in [plan-search]); gallop when the jumps stall
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
    budget = 48
    for step in _learned_steps(learned):
        x = lb
        for _ in range(8):
            x = _snap_to_step(inst, x, step)
            if x >= best or budget <= 0:
                break
            budget -= x not in ends
            if probe(x):
                break
            x = max(x + 1, -(-ends[x] // m) if ends[x] > 0 else 0)
    # 4) bisection between the largest infeasible candidate below the best and the best
    #    (feasibility is not monotone in S: a refinement that only ever keeps feasible results)
    for _ in range(64):
        lo = max([scanned, *(t for t in ends if t < best)])
        if best - lo <= 1:
            break
        mid = inst.next_candidate((lo + best) // 2 + 1)
        if mid >= best:
            mid = inst.next_candidate(lo + 1)
            if mid >= best:
                break
        probe(mid)
    return SearchResult(shard_size=best, exact=False)
