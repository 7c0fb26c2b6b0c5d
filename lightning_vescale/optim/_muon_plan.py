"""Layer 4: distributed Muon's plan: which rank orthogonalises each matrix, and the buckets.

Pure functions of shapes and placements (no process group, no tensors), so every rank computes
the same plan without talking, and tests check them directly. See design note
[distributed-muon] in ``muon.py`` for how the optimizer uses them: :func:`assign_owners` picks a
load-balanced owner per matrix (longest-processing-time greedy on the Newton–Schulz cost, then
locality), :func:`plan_buckets` groups items into all-to-all rounds, and :func:`build_plan` puts
both together into a :class:`CommPlan` with each round's split sizes for this rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_vescale.optim._newton_schulz import newton_schulz_flops

__all__ = ["assign_owners", "plan_buckets", "Bucket", "CommPlan", "build_plan"]


def assign_owners(
    costs: Sequence[int],
    world_size: int,
    *,
    holdings: Sequence[Sequence[int]] | None = None,
    base_load: Sequence[int] | None = None,
    fixed: Sequence[int | None] | None = None,
) -> list[int]:
    """Owner rank per item: LPT greedy (largest cost first, onto the least-loaded rank).

    ``fixed[i]`` (when not ``None``) is item ``i``'s owner already (a matrix one rank holds
    whole: it is orthogonalised there, without communication); its cost starts that rank's load
    and the other items are balanced around it.

    Ties on load are broken by ``base_load[r]`` (work already assigned elsewhere, e.g. earlier
    buckets), then by ``holdings[i][r]`` (elements of item ``i`` rank ``r`` already holds), then
    by the lowest rank. LPT's makespan (max load) is within 4/3 of optimal. With ``holdings``, a
    second pass prefers owners that already hold most of each item as long as no rank exceeds
    LPT's makespan; it is kept only if it moves fewer elements. Deterministic: every rank gets
    the same answer.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base = list(base_load) if base_load is not None else [0] * world_size
    zero = [0] * world_size
    fixed = list(fixed) if fixed is not None else [None] * len(costs)
    order = sorted((i for i in range(len(costs)) if fixed[i] is None),
                   key=lambda i: (-costs[i], i))
    start = [0] * world_size
    owners = [0] * len(costs)
    for i, o in enumerate(fixed):
        if o is not None:
            owners[i] = o
            start[o] += costs[i]
    load = list(start)
    for i in order:
        hold = holdings[i] if holdings is not None else zero
        best = min(range(world_size), key=lambda r: (load[r], base[r], -hold[r], r))
        owners[i] = best
        load[best] += costs[i]
    if holdings is None:
        return owners
    # Locality pass: same LPT order, but put each item on the rank holding most of it among the
    # ranks where it still fits under LPT's makespan. Keep it only if the makespan is no worse
    # (so balance is never traded away) and fewer elements move.
    makespan = max(load)
    load2 = list(start)
    owners2 = list(owners)
    for i in order:
        fits = [r for r in range(world_size) if load2[r] + costs[i] <= makespan]
        pool = fits or list(range(world_size))
        best = min(pool, key=lambda r: (-holdings[i][r], load2[r], base[r], r) if fits
                   else (load2[r], base[r], -holdings[i][r], r))
        owners2[i] = best
        load2[best] += costs[i]

    def moved(own: list[int]) -> int:
        return sum(sum(holdings[i]) - holdings[i][o] for i, o in enumerate(own))

    if max(load2) <= makespan and moved(owners2) < moved(owners):
        return owners2
    return owners


def plan_buckets(numels: Sequence[int], cap_numel: int) -> list[list[int]]:
    """Split items (in order) into consecutive buckets of at most ``cap_numel`` elements.

    An item larger than the cap gets a bucket of its own; empty input gives no bucket.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and size + n > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One all-to-all round. ``items`` index the step's distributed matrices."""

    items: tuple[int, ...]
    owned: tuple[int, ...]  # items of this bucket that this rank orthogonalises
    to_owner_send: tuple[int, ...]  # per destination rank: my elements of its matrices
    to_owner_recv: tuple[int, ...]  # per source rank: its elements of my matrices


@dataclass(frozen=True, kw_only=True)
class CommPlan:
    """How one step moves the distributed matrices of one shard group (this rank's view).

    ``key`` says which inputs it was built for (a cache reuses it while the key is the same);
    ``ranges[i][r]`` is rank ``r``'s flat range of item ``i``; ``owners[i]`` the rank that
    orthogonalises it; ``buckets`` the all-to-all rounds, in order.
    """

    key: tuple
    rank: int
    world_size: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # per item, per rank
    owners: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    #: items one rank holds whole (no communication; design note [muon-stacked-experts]) that
    #: this rank holds, so orthogonalises; the other whole ones it skips (it holds none of them)
    local_owned: tuple[int, ...] = ()
    whole: tuple[int, ...] = ()  # every item one rank holds whole

    def numel(self, item: int, rank: int) -> int:
        """Elements of ``item`` that ``rank`` holds."""
        start, end = self.ranges[item][rank]
        return end - start


def build_plan(key: tuple, shapes: Sequence[tuple[int, int]],
               ranges: Sequence[Sequence[tuple[int, int]]], rank: int, world_size: int,
               ns_steps: int, cap_numel: int) -> CommPlan:
    """Owners for all matrices at once (best balance, most locality), then buckets.

    Args:
        key: stored in the plan (see :class:`CommPlan`).
        shapes: ``(rows, cols)`` per item; ``ranges``: per item, every rank's flat range.
        rank, world_size: this rank and the shard group's size.
        ns_steps: Newton–Schulz steps (the cost model); cap_numel: elements per bucket.

    Buckets take the matrices round-robin over owners (each owner's in parameter order), so
    every bucket gives every owner some Newton–Schulz work while the next bucket is in flight.
    A matrix that one rank holds whole stays there (no bucket; its cost counts in that rank's
    load), so a plan of such matrices only (``granularity="matrix"``) has no bucket at all.
    """
    costs = [newton_schulz_flops(r, c, ns_steps) for r, c in shapes]
    holds = [[e - s for s, e in rng] for rng in ranges]  # elements per item, per rank
    fixed = [next((r for r, h in enumerate(hold) if h == rows * cols), None)
             for hold, (rows, cols) in zip(holds, shapes)]
    owners = assign_owners(costs, world_size, holdings=holds, fixed=fixed)
    per_owner = [[i for i in range(len(shapes)) if owners[i] == r and fixed[i] is None]
                 for r in range(world_size)]
    order = [i for column in itertools.zip_longest(*per_owner) for i in column if i is not None]

    buckets = []
    numels = [rows * cols for rows, cols in (shapes[i] for i in order)]
    for positions in plan_buckets(numels, cap_numel):
        items = [order[p] for p in positions]
        buckets.append(Bucket(
            items=tuple(items),
            owned=tuple(i for i in items if owners[i] == rank),
            to_owner_send=tuple(sum(holds[i][rank] for i in items if owners[i] == d)
                                for d in range(world_size)),
            to_owner_recv=tuple(sum(holds[i][s] for i in items if owners[i] == rank)
                                for s in range(world_size)),
        ))
    return CommPlan(key=key, rank=rank, world_size=world_size,
                    ranges=tuple(tuple(r) for r in ranges), owners=tuple(owners),
                    buckets=tuple(buckets),
                    local_owned=tuple(i for i, o in enumerate(fixed) if o == rank),
                    whole=tuple(i for i, o in enumerate(fixed) if o is not None))
