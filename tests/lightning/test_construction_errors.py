"""Every strategy argument is checked when the strategy is constructed, before any process starts.

A typo in a YAML config used to surface only after the launch (10-25 s later, on every rank).
Each case below builds the strategy (both faces) and must raise at once with a message that names
the parameter, the value and a fix. Also: the planner CLI's ``--model`` errors, and the one-line
log for a model that is one sharding group.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from torch import nn

from lightning_vescale import MemoryProfiler, VeScaleFabricStrategy, VeScaleFSDPStrategy
from lightning_vescale._lightning.sharding import resolve_sharding_units
from lightning_vescale.planner.cli import main as planner_main

FACES = [VeScaleFSDPStrategy, VeScaleFabricStrategy]

CASES = [
    (dict(granularity="foo"), ValueError, r"granularity='foo' is not understood; use an int"),
    (dict(granularity=0), ValueError, r"granularity must be >= 1"),
    (dict(granularity=True), TypeError, r"granularity must be .* got True"),
    (dict(granularity=100), ValueError,
     r"granularity=100 is not a multiple of optimizer_block_size=256.*Use granularity=256 \(the "
     r"next multiple of 256\), or granularity=None"),
    (dict(granularity="300"), ValueError, r"Use granularity=512"),
    (dict(granularity=1000, optimizer_block_size=64), ValueError, r"Use granularity=1024"),
    (dict(reshard_after_forward="yes"), TypeError,
     r"reshard_after_forward='yes' \(str\) is not supported; use None \(auto"),
    (dict(reshard_after_forward=0), ValueError,
     r"reshard_after_forward=0 does not fit the shard group size: use None \(auto"),
    (dict(process_group_backend="ncl"), ValueError,
     r"process_group_backend must be None .* or one of \[.*'gloo'.*'nccl'.*got 'ncl'"),
    (dict(process_group_backend=5), ValueError, r"process_group_backend must be None"),
    (dict(optimizer_block_size=0), ValueError, r"optimizer_block_size must be a positive int"),
    (dict(optimizer_min_block_numel=True), ValueError, r"optimizer_min_block_numel must be an int"),
    (dict(sharding_units=5), TypeError, r"sharding_units must be a list .* got 5"),
    (dict(sharding_units=[""]), TypeError, r"sharding_units entries must be"),
    (dict(sharding_units=[nn.Linear(2, 2)]), TypeError, r"sharding_units entries must be"),
    (dict(state_dict_type="Sharded"), ValueError, r"state_dict_type must be 'sharded' or 'full'"),
    (dict(timeout=30), TypeError, r"timeout must be a datetime.timedelta .* got 30"),
    (dict(timeout=timedelta(0)), ValueError, r"timeout must be positive"),
]


@pytest.mark.parametrize("face", FACES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kwargs,error,match", CASES, ids=lambda c: repr(c)[:40])
def test_bad_argument_fails_at_construction(face, kwargs, error, match):
    with pytest.raises(error, match=match):
        face(**kwargs)


def test_bad_start_method_fails_at_construction():
    with pytest.raises(ValueError, match="start_method must be one of"):
        VeScaleFSDPStrategy(start_method="thread")


@pytest.mark.parametrize("kwargs", [
    dict(granularity="row"), dict(granularity=512), dict(granularity="512"),
    dict(granularity=100, optimizer_block_size=None), dict(process_group_backend="NCCL"),
    dict(process_group_backend="cpu:gloo,cuda:nccl"), dict(sharding_units=[]),
    dict(sharding_units="Block"), dict(reshard_after_forward=False),
    dict(reshard_after_forward=None), dict(reshard_after_forward=2),
])
def test_good_arguments_are_accepted(kwargs):
    for face in FACES:
        face(**kwargs)


def test_memory_profiler_without_matplotlib_fails_at_construction(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-vescale\[plot\]'"):
        MemoryProfiler(plot_dir="memory")
    MemoryProfiler()  # no plot: no matplotlib needed


# -- sharding units -------------------------------------------------------------------------------
def test_a_model_without_module_list_is_one_group_and_says_how_to_choose_units(caplog):
    flat = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with caplog.at_level(logging.INFO):
        assert resolve_sharding_units(flat, None) == []
    lines = [r.getMessage() for r in caplog.records if "sharding group" in r.getMessage()]
    assert len(lines) == 1
    assert "Sequential has no nn.ModuleList" in lines[0] and "sharding_units=" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert resolve_sharding_units(flat, []) == []  # asked for one group: nothing to say
        blocks = nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))
        assert resolve_sharding_units(blocks, None) == [blocks[0][0]]
    assert not [r for r in caplog.records if "sharding group" in r.getMessage()]


# -- planner CLI ----------------------------------------------------------------------------------
@pytest.mark.parametrize("args,match", [
    (["--model", "examples.gpt:Block"],
     ["Block(config: 'GPTConfig') cannot be called", "missing a required argument: 'config'",
      "--init-args '{\"config\": \"...\"}'", "a function or class that builds the model"]),
    (["--model", "examples.train_gpt:GPTModule", "--init-args", '{"n_layers": 4}'],
     ["unexpected keyword argument 'n_layers'", "--init-args '{\"n_layer\": 2}'"]),
    (["--preset", "llama3-70b", "--granularity", "rowz"],
     ["granularity='rowz' is not understood; use an int >= 1 (elements), 'element', 'row', "
      "'<k>rows' (e.g. '32rows') or 'matrix'"]),
])
def test_planner_cli_errors_say_how_to_fix_them(capsys, args, match):
    with pytest.raises(SystemExit):
        planner_main(args)
    err = capsys.readouterr().err
    for m in match:
        assert m in err, err


def test_granularity_policy_says_why():
    default = VeScaleFSDPStrategy().granularity_policy.explain()
    assert "tensors of 4,096+ elements: multiples of 256 elements" in default
    assert "smaller tensors: element-wise" in default
    rows = VeScaleFabricStrategy(granularity="row").granularity_policy.explain()
    assert "granularity='row', rounded up to a multiple of 256" in rows
    off = VeScaleFSDPStrategy(optimizer_block_size=None).granularity_policy.explain()
    assert off.startswith("every tensor: element-wise (optimizer_block_size=None")
