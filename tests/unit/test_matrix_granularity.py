"""Granularity ``"matrix"`` (the trailing 2-D matrix whole: one expert of a stacked
``(E, out, in)`` weight) through every layer that takes a granularity: the planner's
``resolve_granularity``/``plan_layout``, ``fully_shard``'s resolution, the strategies' policy and
argument checks, and the planner's command line."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_vescale.planner import (
    GRANULARITY_FORMS,
    check_granularity,
    matrix_numel,
    plan_layout,
    resolve_granularity,
)
from lightning_vescale.planner import cli as plan_cli


@pytest.mark.parametrize("shape, expected", [
    ((8, 16, 4), 64),      # one expert of (E, out, in)
    ((16, 4), 64),         # a 2-D weight: the whole weight
    ((2, 3, 5, 7), 35),    # 4-D: the trailing matrix (one kh x kw kernel of a conv)
    ((9,), 9),             # 1-D: one (1, n) matrix, the whole vector
    ((), 1),               # 0-D: one element
    ((0, 4, 4), 16),       # empty stack: still one matrix's size
    ((3, 0), 1),           # empty matrix: at least 1 (valid, and irrelevant)
])
def test_matrix_numel_and_resolution(shape, expected):
    assert matrix_numel(shape) == expected
    for spelling in ("matrix", "Matrix", " matrices ", "MAT"):
        assert resolve_granularity(spelling, shape) == expected
    # Block-wise optimizers round it up to a multiple of their block, as every other form.
    assert resolve_granularity("matrix", shape, multiple_of=256) == math.lcm(expected, 256)


def test_matrix_is_a_named_form():
    assert check_granularity("matrix") == "matrix"
    assert "'matrix'" in GRANULARITY_FORMS
    with pytest.raises(ValueError, match="'matrix'"):
        check_granularity("matrixx")


def _matrix_bounds_hold(plan, name, shape, world):
    mat = matrix_numel(shape)
    for r in range(world):
        start, end = plan.local_range(name, r)
        numel = math.prod(shape)
        assert start % mat == 0, (name, r, start, mat)
        assert end % mat == 0 or end == numel, (name, r, end, mat)


@pytest.mark.parametrize("experts, out, inn, world", [
    (6, 16, 8, 4),       # 6 experts over 4 ranks
    (160, 8, 4, 64),     # 160 experts over 8x8 ranks (HF transformers #48237)
    (1, 18, 2304, 8),    # one 18x2304 matrix over 8 ranks (microsoft/dion #74)
    (3, 96, 4, 5),       # 96 rows over 5 ranks
    (2, 4, 4, 7),        # ranks that hold nothing
])
def test_rank_bounds_fall_on_expert_bounds(experts, out, inn, world):
    shape = (experts, out, inn)
    tensors = [("router", (experts, inn)), ("experts.w1", shape), ("norm", (inn,)),
               ("experts.w2", (experts, inn, out))]
    plan = plan_layout(tensors, world, granularity="matrix", align=1)
    for name, shp in tensors:
        _matrix_bounds_hold(plan, name, shp, world)
    # every matrix (expert, whole 2-D weight, whole vector) lies on exactly one rank
    assert len(plan.ranks_spanned("norm")) == 1
    assert len(plan.ranks_spanned("router")) == 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 12), st.integers(1, 12)),
                min_size=1, max_size=5),
       st.integers(1, 9), st.sampled_from([1, 4, 16]))
def test_matrix_bounds_on_random_stacks(stacks, world, align):
    tensors = [(f"w{i}", s) for i, s in enumerate(stacks)]
    plan = plan_layout(tensors, world, granularity="matrix", align=align)
    for name, shape in tensors:
        _matrix_bounds_hold(plan, name, shape, world)


def test_per_tensor_matrix_granularity_mixes_with_others():
    # Only the experts whole; the dense weight keeps the element-wise default.
    tensors = [("dense", (10, 10)), ("experts", (4, 6, 5), "matrix")]
    plan = plan_layout(tensors, 3, granularity=None, align=1)
    _matrix_bounds_hold(plan, "experts", (4, 6, 5), 3)
    assert plan.spec("experts").granularity == 30
    assert plan.spec("dense").granularity == 1


def test_fully_shard_resolution_takes_matrix():
    from lightning_vescale.fsdp._collect import resolve_granularities

    w = torch.nn.Parameter(torch.zeros(4, 6, 5))
    b = torch.nn.Parameter(torch.zeros(5))
    named = [("experts", w), ("bias", b)]
    assert resolve_granularities("matrix", named) == {"experts": 30, "bias": 5}
    assert resolve_granularities({"experts": "matrix"}, named) == {"experts": 30, "bias": 1}


def test_strategy_policy_and_checks_take_matrix():
    from lightning_vescale._lightning.sharding import ShardGranularity, validate_sharding_args

    validate_sharding_args(None, "matrix", 256, 4096)  # accepted next to the 8-bit block
    policy = ShardGranularity(granularity="matrix", optimizer_block_size=256,
                              min_block_numel=4096)
    # a (8, 64, 32) stack: experts of 2048 elements, a multiple of 256 already
    assert policy("experts", torch.zeros(8, 64, 32)) == 2048
    # experts of 18 x 2304 = 41472 = 2^9 * 81: already block-aligned
    assert policy("w", torch.zeros(2, 18, 2304)) == 41472
    # a small tensor keeps the bare form
    assert policy("b", torch.zeros(3, 5)) == 15
    assert "matrix" in policy.explain()


def test_planner_cli_takes_matrix(capsys):
    assert plan_cli.main(["--preset", "gpt-oss-120b", "--world-size", "64", "--granularity",
                          "matrix"]) == 0
    assert "granularity=matrix" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_cli.main(["--preset", "gpt-oss-120b", "--granularity", "matrixx"])
    assert "'matrix'" in capsys.readouterr().err
