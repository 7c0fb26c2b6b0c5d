"""``plan_buckets``: one buffer, a second one for whole-matrix tensors, or one per whole-matrix
tensor (design note [plan-buckets]): hand-made buckets where each split helps and where it does
not, the margin per additional buffer, the cap, and the MoE presets at 64 ranks (24.16% / 12.46%
padding in one buffer; ~0% split) and 256 ranks (DeepSeek-V3: 23.35% in one or two buffers, ~0%
one buffer per expert stack; GPT-OSS: per stack would pad 49.5%, not taken)."""

from __future__ import annotations

import math

import pytest

from lightning_vescale.planner import (
    MAX_STACK_BUFFERS,
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
# 6 element-granular elements, 2 experts of 8 and 2 of 6 kept whole, over 2 ranks (34 elements):
# one buffer pads 6, two buffers 4 (the 4 whole experts alone need S = 16: 14 | 14 + 2), one
# buffer per stack 0 (3 | 8, 8 | 6, 6: the stacks tile the ranks apart).
STACKS = [("attn", (6,), 1), ("a", (2, 2, 4), "matrix"), ("b", (2, 2, 3), "matrix")]
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
    table = planner_table((64, 256))
    assert "| gpt-oss-120b | 64 | 0.00% | 24.16% | 0.00% | 2 |" in table
    assert "| deepseek-v3-stacked | 256 | 0.00% | 23.35% | 0.01% | 3 |" in table


def test_one_buffer_per_stack_when_only_that_tiles_the_ranks():
    one = plan_layout(STACKS, 2, align=1)
    two = plan_buckets(STACKS, 2, align=1, max_stacks=0)
    got = plan_buckets(STACKS, 2, align=1, margin=0.0)
    assert (one.padding, two.padding, got.padding) == (6, 4, 0) and not two.per_stack
    assert got.per_stack and got.split and got.one_buffer_padding == 6
    assert [p.names for p in got.plans] == [("attn",), ("a",), ("b",)]
    assert got.suffixes == ((), ("matrix", "a"), ("matrix", "b"))
    assert two.suffixes == ((), ("matrix",))


def test_every_additional_buffer_must_save_the_margin():
    """Per stack (3 buffers) saves 6 of 34 elements over one buffer: more than one margin at
    0.1 (3.4) but not two (6.8), so one buffer; two buffers save 2, less than 3.4."""
    assert not plan_buckets(STACKS, 2, align=1, margin=0.1).split
    assert plan_buckets(STACKS, 2, align=1, margin=0.07).per_stack  # 4.76 < 6; two: 2 < 2.38
    assert not plan_buckets(STACKS, 2, align=1, margin=3 / 34).split  # exactly 2 margins: one
    assert plan_buckets(STACKS, 2, align=1, margin=0.05).per_stack  # two (2 > 1.7) then 4 > 1.7
    assert plan_buckets(STACKS, 2, align=1, margin=-1).per_stack  # forced: most buffers


def test_per_stack_only_up_to_the_cap():
    """A bucket of many whole matrices (``"matrix"`` on every weight, Muon-style) never gets a
    buffer per tensor past :data:`MAX_STACK_BUFFERS`, even forced; up to it, only if it pays."""
    many = [(f"w{i}", (2, 2, 3), "matrix") for i in range(MAX_STACK_BUFFERS + 1)]
    assert plan_buckets(many, 4, align=1, margin=-1).plans == (plan_layout(many, 4, align=1),)
    few = many[:MAX_STACK_BUFFERS]
    assert len(plan_buckets(few, 4, align=1, margin=-1).plans) == MAX_STACK_BUFFERS
    assert not plan_buckets(few, 4, align=1).split  # 8 x 12 over 4 ranks pads 0: no gain
    assert not plan_buckets(STACKS, 2, align=1, margin=0.0, max_stacks=1).per_stack
    with pytest.raises(ValueError, match="max_stacks"):
        plan_buckets(STACKS, 2, max_stacks=-1)


def _preset_figures(preset: str, world: int) -> tuple[float, float, list]:
    groups = with_expert_granularity(transformer_groups(PRESETS[preset]), "matrix", None)
    plans = [plan_buckets(g, world) for _, g in groups]
    total = sum(math.prod(s) for _, g in groups for _, s, _ in g)
    buffer = sum(p.buffer_size for p in plans)
    single = sum(p.one_buffer_padding + p.total_numel for p in plans)
    return (single - total) / single, (buffer - total) / buffer, plans


def test_deepseek_at_256_ranks_one_buffer_per_stack():
    """256 ``gate_up`` and 256 ``down`` experts over 256 ranks: one of each per rank (FSDP2's
    row chunks' 0.01%) only with a buffer per stack; one or two buffers pad 23.35%."""
    one, got, plans = _preset_figures("deepseek-v3-stacked", 256)
    assert one == pytest.approx(0.2335, abs=1e-4) and got < 1e-4
    moe = [p for p in plans if p.split]
    assert moe and all(p.per_stack and len(p.plans) == 3 for p in moe)
    assert moe[0].suffixes[1:] == (("matrix", "model.layers.3.mlp.experts.gate_up_proj"),
                                   ("matrix", "model.layers.3.mlp.experts.down_proj"))


def test_gpt_oss_at_256_ranks_keeps_one_buffer():
    """Per stack GPT-OSS's 128 experts over 256 ranks pad 49.5% (half the ranks hold none of a
    stack): not taken; one buffer per bucket stays (24.16%)."""
    one, got, plans = _preset_figures("gpt-oss-120b", 256)
    assert got == pytest.approx(one) == pytest.approx(0.2416, abs=1e-4)
    assert not any(p.split for p in plans)
