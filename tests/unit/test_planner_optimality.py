"""The planner against brute force on tiny instances.

The brute force knows nothing of the planner: for increasing ``S`` (multiples of ``align``) it
tries every offset of every tensor (depth-first, optionally over every order) and checks the
layout rules directly. Documented guarantees (design note [planner] in
lightning_vescale/planner/_layout.py):

* ``plan.exact`` (the exact scan finished, always the case on tiny instances): ``S`` equals the
  optimum among layouts that keep the given order;
* always: ``lower_bound <= optimum over all orders <= S <= S_ub``, with ``S_ub`` the first
  ``S >= ceil(total/m) + w - 1``, ``w = max_t min(g_t, e_t)``, that is a multiple of ``align``
  and of ``g_t`` for every tensor longer than ``S`` (where the greedy always fits).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_vescale.planner import _search, plan_layout


def _ok(off: int, e: int, g: int, s: int, m: int) -> bool:
    if off + e > m * s:
        return False
    k = off // s + 1
    while k * s < off + e:
        if (k * s - off) % g:
            return False
        k += 1
    return True


def _fits_in_order(items, s: int, m: int) -> bool:
    """Depth-first over all offsets (no greediness): is there a valid layout in this order?"""

    def rec(i: int, cursor: int) -> bool:
        if i == len(items):
            return True
        e, g = items[i]
        for off in range(cursor, m * s - e + 1):
            if _ok(off, e, g, s, m) and rec(i + 1, off + e):
                return True
        return False

    return rec(0, 0)


def _valid_s(items, s: int, align: int) -> bool:
    return s % align == 0


def brute_force(items, m: int, align: int, *, any_order: bool) -> int:
    total = sum(e for e, _ in items)
    s = align
    orders = list(itertools.permutations(items)) if any_order else [items]
    while True:
        if any(_fits_in_order(list(o), s, m) for o in orders):
            return s
        s += align
        assert s <= max(total, 1) * align + align, "brute force must terminate"


_tiny = st.tuples(
    st.lists(
        st.tuples(st.integers(min_value=1, max_value=9), st.integers(min_value=1, max_value=6)),
        min_size=1,
        max_size=4,
    ),
    st.integers(min_value=1, max_value=4),  # world size
    st.integers(min_value=1, max_value=3),  # align
)


def _plan(items, m, align):
    return plan_layout([(f"t{i}", (e,), g) for i, (e, g) in enumerate(items)], m, align=align)


@settings(max_examples=150, deadline=None)
@given(_tiny)
def test_exact_scan_equals_order_preserving_brute_force(case):
    items, m, align = case
    plan = _plan(items, m, align)
    assert plan.exact
    assert plan.shard_size == brute_force(items, m, align, any_order=False)


@settings(max_examples=60, deadline=None)
@given(_tiny)
def test_within_documented_bound_of_any_order_optimum(case):
    items, m, align = case
    plan = _plan(items, m, align)
    opt_any = brute_force(items, m, align, any_order=True)
    assert plan.lower_bound <= opt_any <= plan.shard_size
    inst = _search.Instance([e for e, _ in items], [g for _, g in items], m, align)
    ub = inst.bound_candidate()
    assert inst.greedy(ub, m * ub).end <= m * ub  # the bound's premise: the greedy fits at S_ub
    assert plan.shard_size <= ub


@settings(max_examples=60, deadline=None)
@given(_tiny)
def test_guided_search_within_bound(case):
    items, m, align = case
    old = _search.SCAN_WORK
    _search.SCAN_WORK = -1  # force the large-instance path
    try:
        plan = _plan(items, m, align)
    finally:
        _search.SCAN_WORK = old
    assert plan.shard_size >= brute_force(items, m, align, any_order=False)
    inst = _search.Instance([e for e, _ in items], [g for _, g in items], m, align)
    ub = inst.bound_candidate()
    assert plan.shard_size <= ub


@pytest.mark.parametrize(
    ("items", "m", "align", "expected"),
    [
        ([(6, 1), (6, 1)], 4, 1, 3),  # element-wise: ceil(12/4)
        ([(6, 6), (6, 6), (6, 6)], 2, 1, 12),  # whole tensors: bin packing
        ([(12, 4)], 2, 1, 8),  # rows of 4: S=6 would cut a row
        ([(12, 4), (5, 1)], 2, 1, 9),  # ...a shifted start makes S=ceil(17/2) work
        ([(7, 1)], 3, 4, 4),  # alignment
    ],
)
def test_known_optima(items, m, align, expected):
    plan = _plan(items, m, align)
    assert plan.shard_size == expected == brute_force(items, m, align, any_order=True)


_medium = st.tuples(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=4000), st.integers(min_value=1, max_value=700)),
        min_size=1,
        max_size=30,
    ),
    st.integers(min_value=1, max_value=64),
    st.sampled_from([1, 4, 16]),
)


@settings(max_examples=150, deadline=None)
@given(_medium)
def test_bound_holds_on_medium_instances(case):
    # S_ub always admits a layout (checked with the brute force's own rule checker), and the
    # planner, exact or guided, never returns more.
    items, m, align = case
    inst = _search.Instance([e for e, _ in items], [g for _, g in items], m, align)
    ub = inst.bound_candidate()
    run = inst.greedy(ub, None, record=True)
    assert run.offsets is not None and run.end <= m * ub
    cursor = 0
    for (e, g), off in zip(items, run.offsets):
        assert off >= cursor and _ok(off, e, g, ub, m)
        cursor = off + e
    old = _search.SCAN_WORK
    for budget in (old, -1):
        _search.SCAN_WORK = budget
        try:
            plan = _plan(items, m, align)
        finally:
            _search.SCAN_WORK = old
        assert plan.lower_bound <= plan.shard_size <= ub
