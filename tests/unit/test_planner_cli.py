"""``python -m lightning_vescale.planner`` on presets and tiny import-path models (in-process
through ``main(argv)``, plus one process-start smoke test)."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lightning_vescale.planner import (
    PRESETS,
    fsdp2_even_rowwise,
    num_params,
    plan_layout,
    transformer_groups,
)
from lightning_vescale.planner import cli as plan_cli

ROOT = Path(__file__).resolve().parents[2]
BUILT_ON: list[str] = []  # devices the tiny models' parameters were created on


class TinyBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)


class TinyGPT(nn.Module):
    """Embedding, a ModuleList of blocks, a head: the CLI groups it per block + root."""

    def __init__(self, vocab: int = 50, d: int = 8, n_layer: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(TinyBlock(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)
        BUILT_ON.append(self.emb.weight.device.type)


def _table_rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if parts and parts[0] in ("vescale", "lower", "fsdp2-even-rowwise", "fsdp1-flat"):
            key = parts[0]
            rows.setdefault(key, parts)
    return rows


def _pct(parts: list[str]) -> float:
    return float(next(p for p in parts if p.endswith("%"))[:-1])


def test_llama_preset_meets_padding_target(capsys):
    assert plan_cli.main(["--preset", "llama3-70b", "--world-size", "1024"]) == 0
    out = capsys.readouterr().out
    assert "70,553,706,496 parameters" in out and "81 group(s)" in out
    rows = _table_rows(out)
    assert set(rows) == {"vescale", "lower", "fsdp2-even-rowwise", "fsdp1-flat"}
    assert _pct(rows["vescale"]) < 3.0
    # FSDP2 figure from an independent computation of padded dim-0 chunks
    groups = transformer_groups(PRESETS["llama3-70b"], "block")
    shard = sum(-(-s[0] // 1024) * math.prod(s[1:]) for _, g in groups for _, s in g)
    total = num_params(PRESETS["llama3-70b"])
    expected = 100 * (1024 * shard - total) / (1024 * shard)
    assert _pct(rows["fsdp2-even-rowwise"]) == pytest.approx(expected, abs=1e-3)
    assert f"{shard:,}" in " ".join(rows["fsdp2-even-rowwise"])
    assert re.search(r"plan time|ms", out)


@pytest.mark.parametrize(("preset", "sizes"), [("gpt-oss-120b", ["8", "64"]),
                                               ("deepseek-v3", ["1024"])])
def test_other_presets_run(capsys, preset, sizes):
    args = ["--preset", preset, "--world-size", *sizes, "--granularity", "32rows"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert out.count("world size") == len(sizes)
    assert f"{num_params(PRESETS[preset]):,} parameters" in out


def test_config_overrides_and_model_grouping(capsys):
    cfg = '{"layers": 2, "experts": 8}'
    args = ["--preset", "deepseek-v3", "--config", cfg, "--grouping", "model",
            "--world-size", "16", "--granularity", "element", "--align", "1", "--describe"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "1 group(s) (model)" in out
    rows = _table_rows(out)
    assert _pct(rows["vescale"]) == pytest.approx(_pct(rows["fsdp1-flat"]), abs=1e-3)
    assert "largest group" in out and "LayoutPlan" in out


def test_config_only(capsys):
    cfg = '{"hidden": 64, "layers": 2, "heads": 4, "vocab": 100, "ffn": 256}'
    assert plan_cli.main(["--config", cfg, "--world-size", "3"]) == 0
    assert "3 group(s) (block)" in capsys.readouterr().out


def test_import_path_model_on_meta_device(capsys):
    BUILT_ON.clear()
    args = ["--model", f"{__name__}:TinyGPT", "--init-args", '{"n_layer": 2, "d": 8}',
            "--world-size", "2", "3", "--granularity", "row", "--align", "1"]
    assert plan_cli.main(args) == 0
    assert BUILT_ON == ["meta"]
    out = capsys.readouterr().out
    model = TinyGPT(n_layer=2, d=8)
    n = sum(p.numel() for p in model.parameters())
    assert f"{n:,} parameters" in out and "3 group(s) (block)" in out
    groups = plan_cli.module_groups(model)
    assert [g for g, _ in groups] == ["blocks.0", "blocks.1", "root"]
    assert [n for n, _ in groups[-1][1]] == ["emb.weight", "head.weight"]
    # the printed planner row is the sum of the per-group plans
    s_sum = sum(plan_layout(g, 3, granularity="row", align=1).shard_size for _, g in groups)
    assert f"{s_sum:,}" in " ".join(_table_rows(out.split("world size 3")[1])["vescale"])
    assert fsdp2_even_rowwise(groups[0][1], 3).split_tensors == 0


def test_lightning_module_with_configure_model(capsys):
    args = ["--model", "tests.unit._planner_cli_models:TinyLit", "--world-size", "2"]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "2 group(s) (block)" in out  # two blocks built in configure_model, no root params


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--model", "no_such_module_xyz:Model"], "cannot import"),
        (["--model", "torch.nn"], "package.module:ClassName"),
        (["--model", "torch.nn:NoSuch"], "no attribute"),
        (["--preset", "llama3-70b", "--config", '{"bogus": 1}'], "bogus"),
        ([], "--preset"),
        (["--preset", "llama3-70b", "--world-size", "0"], "world-size"),
        (["--preset", "llama3-70b", "--granularity", "tiles"], "granularity"),
    ],
)
def test_cli_errors(capsys, args, match):
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(args)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def _imports(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    return imported


def test_cli_module_imports_only_layers_0_1_and_torch():
    planner_dir = Path(plan_cli.__file__).parent
    for path in sorted(planner_dir.glob("*.py")):
        imported = _imports(path)
        ours = {m for m in imported if m.startswith("lightning_vescale")}
        assert all(m == "lightning_vescale.placement" or m.startswith("lightning_vescale.planner")
                   for m in ours), (path.name, ours)
        assert not any(m == "lightning" or m.startswith("lightning.") for m in imported), path
        assert not any(m.startswith("pytorch_lightning") for m in imported), path
    imported = _imports(Path(plan_cli.__file__))
    assert torch.__name__ in {m.split(".")[0] for m in imported} or "torch.nn" in imported


_CONFIG_ARGS = ["--config", '{"hidden": 64, "layers": 2, "heads": 4, "vocab": 100, "ffn": 256}',
                "--world-size", "3", "--describe"]


def test_describe_prints_the_largest_group(capsys):
    assert plan_cli.main(_CONFIG_ARGS) == 0
    out = capsys.readouterr().out
    assert "3 group(s) (block)" in out and "largest group" in out


def test_granularity_error_names_the_valid_forms(capsys):
    with pytest.raises(SystemExit) as exc:
        plan_cli.main(["--preset", "llama3-70b", "--granularity", "tiles"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # the error names the valid forms, not the parser's function
    assert "granularity='tiles' is not understood" in err
    assert "'row'" in err and "'<k>rows'" in err
    assert "_granularity" not in err


def test_python_dash_m_planner_smoke():
    """The one process start: ``python -m lightning_vescale.planner`` is ``main`` (stdout, exit
    code) as a program; everything else above runs ``main(argv)`` in this process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "lightning_vescale.planner", *_CONFIG_ARGS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "3 group(s) (block)" in proc.stdout and "largest group" in proc.stdout
