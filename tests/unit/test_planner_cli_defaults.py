"""The planner CLI's default granularity is the one training uses (``fully_shard``'s and the
strategies' default), so the layout it prints is the layout a default run builds."""

from __future__ import annotations

import json

from lightning_vescale.planner import cli as plan_cli
from lightning_vescale.planner import default_granularity, plan_layout, transformer_groups
from lightning_vescale.planner.presets import TransformerConfig

CONFIG = {"hidden": 64, "layers": 2, "heads": 4, "vocab": 100, "ffn": 160}


def _planner_row(out: str) -> str:
    return next(line for line in out.splitlines() if line.split()[:1] == ["vescale"])


def _shard_sum(granularity_of) -> int:
    groups = transformer_groups(TransformerConfig(**CONFIG), "block")
    return sum(plan_layout([(n, s, granularity_of(s)) for n, s in g], 3, align=1).shard_size
               for _, g in groups)


def test_default_is_the_training_default(capsys):
    assert plan_cli.main(["--config", json.dumps(CONFIG), "--world-size", "3",
                          "--align", "1"]) == 0
    out = capsys.readouterr().out
    default, row = _shard_sum(default_granularity), _shard_sum(lambda s: "row")
    assert default != row  # the case tells the two defaults apart
    assert f"{default:,}" in _planner_row(out)
    assert "granularity=default (element-wise, multiples of 256 for tensors of 4096+" in out
    assert "optimizer_block_size=256" in out


def test_row_stays_available(capsys):
    assert plan_cli.main(["--config", json.dumps(CONFIG), "--world-size", "3", "--align", "1",
                          "--granularity", "row"]) == 0
    out = capsys.readouterr().out
    assert f"{_shard_sum(lambda s: 'row'):,}" in _planner_row(out)
    assert "granularity=row," in out
