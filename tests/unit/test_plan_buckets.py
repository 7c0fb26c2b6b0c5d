"""``plan_buckets``: one buffer, or a second one for whole-matrix tensors (design note
[plan-buckets]): hand-made buckets where the split helps and where it does not, the margin, and
the MoE presets at 64 ranks (24.16% / 12.46% padding in one buffer; ~0% split)."""

from __future__ import annotations

import math

import pytest

from lightning_vescale.planner import (
    SPLIT_MARGIN,
    TensorSpec,
    is_whole_matrix,
    plan_buckets,
    plan_layout,
    transformer_groups,
)
from lightning_vescale.planner.cli import with_expert_granularity
from lightning_vescale.planner.presets import PRESETS

# 10 element-granular elements, then 4 experts of 16 elements kept whole: over 2 ranks one buffer
# in this order needs S > 37 (the experts cannot fill rank 0's remainder); apart, S = 5 and 32.
HELPS = [("attn", (10,), 1), ("experts", (4, 4, 4), "matrix")]
# 32 element-granular elements fill rank 0 exactly: one buffer pads 0%, the split saves nothing.
NO_GAIN = [("attn", (32,), 1), ("experts", (2, 4, 4), "matrix")]


def test_split_when_it_saves_padding():
    one = plan_layout(HELPS, 2, align=1)
    got = plan_buckets(HELPS, 2, align=1)
    assert one.padding > 0 and got.one_buffer_padding == one.padding
    assert got.split and got.padding == 0
    rest, whole = got.plans
    assert rest.names == ("attn",) and whole.names == ("experts",)
    assert whole.spec("experts").granularity == 16
    assert got.total_numel == 74 and got.buffer_size == 74


def test_one_buffer_when_the_split_saves_nothing():
    got = plan_buckets(NO_GAIN, 2, align=1)
    assert not got.split and got.padding == 0
    assert got.plans == (plan_layout(NO_GAIN, 2, align=1),)


@pytest.mark.parametrize("tensors", [
    [("a", (10,), 1), ("b", (3, 7), 1)],  # nothing whole
    [("e", (4, 4, 4), "matrix"), ("w", (3, 5), "matrix")],  # everything whole
])
def test_one_kind_is_planned_once(tensors):
    got = plan_buckets(tensors, 3, align=1)
    assert got.plans == (plan_layout(tensors, 3, align=1),)


def test_margin_is_a_strict_fraction_of_the_bucket():
    got = plan_buckets(HELPS, 2, align=1)
    saved = got.one_buffer_padding - got.padding
    assert saved > SPLIT_MARGIN * got.total_numel
    at = saved / got.total_numel  # saving exactly the margin keeps one buffer
    assert not plan_buckets(HELPS, 2, align=1, margin=at).split
    assert plan_buckets(HELPS, 2, align=1, margin=at * 0.999).split
    assert plan_buckets(NO_GAIN, 2, align=1, margin=-1).split  # forced: both kinds present


@pytest.mark.parametrize("margin", ["0.01", float("nan"), True])
def test_bad_margin_is_named(margin):
    with pytest.raises(ValueError, match="margin"):
        plan_buckets(HELPS, 2, margin=margin)


def test_whole_matrix_classification():
    def spec(shape, g):
        return TensorSpec._trusted("t", shape, g)
    assert is_whole_matrix(spec((4, 4, 4), 16))  # one expert
    assert is_whole_matrix(spec((4, 4, 4), 32))  # coarser
    assert is_whole_matrix(spec((8, 8), 64)) and is_whole_matrix(spec((8,), 8))
    assert not is_whole_matrix(spec((4, 4, 4), 4))  # a row
    assert not is_whole_matrix(spec((64, 64), 256))  # the 8-bit block default
    assert not is_whole_matrix(spec((1,), 1)) and not is_whole_matrix(spec((), 1))


@pytest.mark.parametrize("preset,one_buffer", [("gpt-oss-120b", 0.2416),
                                               ("deepseek-v3-stacked", 0.1246)])
def test_moe_presets_at_64_ranks_pad_about_zero(preset, one_buffer):
    groups = with_expert_granularity(transformer_groups(PRESETS[preset]), "matrix", None)
    plans = [plan_buckets(g, 64) for _, g in groups]
    total = sum(math.prod(s) for _, g in groups for _, s, _ in g)
    buffer = sum(p.buffer_size for p in plans)
    single = sum(p.one_buffer_padding + p.total_numel for p in plans)
    assert (single - total) / single == pytest.approx(one_buffer, abs=1e-4)
    assert (buffer - total) / buffer < 1e-4
    assert sum(p.split for p in plans) > len(plans) // 2


def test_cli_and_benchmark_print_the_split_layout():
    """The planner CLI's summary and ``benchmarks/moe.py``'s table plan with ``plan_buckets``
    too (``fully_shard`` does: ``tests/distributed/test_moe_buckets.py``)."""
    from benchmarks.moe import planner_table
    from lightning_vescale.planner.cli import summarize

    groups = with_expert_granularity(transformer_groups(PRESETS["gpt-oss-120b"]), "matrix", None)
    plans, rows = summarize(groups, 64, 1, 16)
    assert len(plans) == len(groups) + 36 and rows[0].padding_ratio < 1e-4
    assert "| gpt-oss-120b | 64 | 0.00% | 24.16% | 0.00% |" in planner_table((64,))
