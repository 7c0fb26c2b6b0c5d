"""No-process tests: strategy resolution, precision pairing, argument checks, sharding units, CLI.

Nothing here trains; Trainer/Fabric objects are only constructed (and LightningCLI only parses).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn

from examples.gpt import GPT, MLP, Block, GPTConfig
from lightning_vescale import (
    VeScaleFabricPrecision,
    VeScaleFabricStrategy,
    VeScaleFSDPStrategy,
    VeScalePrecision,
)
from lightning_vescale._lightning.launcher import VeScaleMultiProcessingLauncher
from lightning_vescale._lightning.sharding import ShardGranularity, resolve_sharding_units
from lightning_vescale.precision import ShardedGradScaler
from tests.lightning._lit import trainer

ROOT = Path(__file__).resolve().parents[2]


# -- resolution by name ----------------------------------------------------------------------------
def test_strategy_resolves_by_name_and_is_distributed():
    t = trainer("vescale_fsdp", devices=2)
    assert isinstance(t.strategy, VeScaleFSDPStrategy)
    assert t._accelerator_connector.is_distributed  # distributed sampler + sync_dist
    assert isinstance(t.strategy.launcher, _SubprocessScriptLauncher)
    assert t.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert t.strategy.state_dict_type == "sharded"
    fork = trainer("vescale_fsdp_fork", devices=2)
    assert isinstance(fork.strategy.launcher, VeScaleMultiProcessingLauncher)
    VeScaleFSDPStrategy.register_strategies(StrategyRegistry)  # again (import did): idempotent
    VeScaleFabricStrategy.register_strategies(FABRIC_STRATEGIES)


def test_fabric_strategy_resolves_by_name():
    fabric = Fabric(strategy="vescale_fsdp", accelerator="cpu", devices=2, precision="bf16-mixed")
    assert isinstance(fabric.strategy, VeScaleFabricStrategy)
    assert isinstance(fabric.strategy.precision, VeScaleFabricPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"


# -- precision pairing -----------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["32-true", "bf16-mixed", "bf16-true", "16-true"])
def test_precision_flag_becomes_vescale_precision(flag):
    t = trainer("vescale_fsdp", devices=2, precision=flag)
    plugin = t.strategy.precision_plugin
    assert isinstance(plugin, VeScalePrecision) and plugin.precision == flag
    policy = plugin.mixed_precision_policy
    if flag == "bf16-mixed":
        assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.bfloat16
    else:
        assert policy is None
    want = {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(flag, torch.float32)
    assert plugin.param_dtype == want


def test_16_mixed_has_a_sharded_scaler():
    t = trainer("vescale_fsdp", devices=2, plugins=[VeScalePrecision("16-mixed")])
    plugin = t.strategy.precision_plugin
    assert isinstance(plugin.scaler, ShardedGradScaler)
    assert plugin.mixed_precision_policy.param_dtype == torch.float16


@pytest.mark.parametrize("flag", ["64-true"])
def test_unsupported_precision_is_rejected(flag):
    with pytest.raises(ValueError, match="vescale_fsdp strategy cannot use the precision"):
        trainer("vescale_fsdp", devices=2, precision=flag)


def test_precision_plugin_argument_checks():
    with pytest.raises(ValueError, match="is not supported"):
        VeScalePrecision("8-true")
    with pytest.raises(ValueError, match="does not use a grad scaler"):
        VeScalePrecision("bf16-mixed", scaler=ShardedGradScaler("cpu"))


# -- arguments -------------------------------------------------------------------------------------
def test_argument_validation():
    with pytest.raises(ValueError, match="not a multiple of optimizer_block_size=256"):
        VeScaleFSDPStrategy(granularity=100)
    VeScaleFSDPStrategy(granularity=100, optimizer_block_size=None)
    VeScaleFSDPStrategy(granularity=512)
    with pytest.raises(TypeError, match="sharding_units entries"):
        VeScaleFSDPStrategy(sharding_units=[3])
    with pytest.raises(ValueError, match="state_dict_type"):
        VeScaleFSDPStrategy(state_dict_type="both")
    with pytest.raises(ValueError, match="optimizer_block_size"):
        VeScaleFSDPStrategy(optimizer_block_size=0)


def test_granularity_aligns_large_tensors_to_the_optimizer_block():
    def granularity(g, block, min_numel=4096):
        return ShardGranularity(granularity=g, optimizer_block_size=block,
                                min_block_numel=min_numel)

    fn = granularity(None, 256)
    assert fn("w", torch.empty(64, 256)) == 256  # 16384 elements: block-aligned
    assert fn("b", torch.empty(4095)) == 1  # below the 8-bit threshold: no padding
    assert granularity(None, None)("w", torch.empty(64, 256)) == 1  # engine default: elements
    assert granularity(1024, 256)("w", torch.empty(64, 256)) == 1024
    # "row" granularity of a (64, 96) matrix = 96 elements -> lcm with the block = 768
    assert granularity("row", 256)("w", torch.empty(64, 96)) == 768
    # small tensors keep the user's granularity, resolved to elements ("row" of a vector: 1)
    assert granularity("row", 256)("w", torch.empty(96)) == 1
    assert granularity("2rows", 256)("w", torch.empty(4, 8)) == 16


def test_sharding_units():
    model = GPT(GPTConfig(n_layer=3))
    default = resolve_sharding_units(model, None)
    assert default == list(model.blocks)
    assert resolve_sharding_units(model, ["Block"]) == list(model.blocks)
    assert resolve_sharding_units(model, [Block]) == list(model.blocks)
    assert resolve_sharding_units(model, ["examples.gpt.Block"]) == list(model.blocks)
    nested = resolve_sharding_units(model, ["Block", MLP])
    # post-order: each block's MLP before the block itself
    assert nested == [m for b in model.blocks for m in (b.mlp, b)]
    with pytest.raises(ValueError, match="matches no submodule.*Module classes in the model"):
        resolve_sharding_units(model, ["Nope"])
    flat = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert resolve_sharding_units(flat, None) == []  # no ModuleList: the root is the only group


# -- LightningCLI ----------------------------------------------------------------------------------
def test_cli_yaml_and_command_line_overrides(monkeypatch):
    from examples.cli import main

    cli = main(args=["--config", str(ROOT / "examples/configs/gpt_vescale.yaml")], run=False)
    s = cli.trainer.strategy
    assert isinstance(s, VeScaleFSDPStrategy)
    assert s._sharding_units == ["Block"] and s._reshard_policy.mode == "always"
    assert s._optimizer_block_size == 256 and s.state_dict_type == "sharded"
    assert s._timeout == timedelta(minutes=30)
    assert cli.trainer.num_devices == 2

    cli = main(args=[
        "--config", str(ROOT / "examples/configs/gpt_vescale.yaml"),
        "--trainer.strategy.init_args.reshard_after_forward=false",
        "--trainer.strategy.init_args.sharding_units=[Block, MLP]",
        "--trainer.strategy.init_args.granularity=row",
        "--trainer.strategy.init_args.state_dict_type=full",
        "--trainer.precision=bf16-mixed",
    ], run=False)
    s = cli.trainer.strategy
    assert s._reshard_policy.mode == "never" and s._sharding_units == ["Block", "MLP"]
    assert s._granularity.granularity == "row" and s.state_dict_type == "full"
    assert isinstance(s.precision_plugin, VeScalePrecision)
    assert s.precision_plugin.precision == "bf16-mixed"

    # reshard_after_forward: true/false/2/null from the command line (a YAML value the same)
    for text, mode, ranks in (("true", "always", None), ("false", "never", None),
                              ("2", "partial", 2), ("null", "auto", None)):
        cli = main(args=["--config", str(ROOT / "examples/configs/gpt_vescale.yaml"),
                         f"--trainer.strategy.init_args.reshard_after_forward={text}"], run=False)
        policy = cli.trainer.strategy._reshard_policy
        assert (policy.mode, policy.ranks) == (mode, ranks), text


def test_cli_strategy_by_name():
    from examples.cli import main

    cli = main(args=["--trainer.strategy=vescale_fsdp", "--trainer.accelerator=cpu",
                     "--trainer.devices=2", "--trainer.logger=false"], run=False)
    assert isinstance(cli.trainer.strategy, VeScaleFSDPStrategy)


# -- the user's GradScaler settings are carried into the sharded scaler -------------------------
def test_grad_scaler_settings_are_carried_into_the_sharded_scaler():
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_vescale.precision import to_vescale_precision

    user = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=3.0, backoff_factor=0.25,
                                growth_interval=7)
    plugin = to_vescale_precision(MixedPrecision("16-mixed", "cpu", scaler=user))
    for scaler in (plugin.scaler, VeScalePrecision("16-mixed", scaler=user).scaler):
        assert isinstance(scaler, ShardedGradScaler)
        assert scaler.get_scale() == 1024.0 and scaler.get_growth_factor() == 3.0
        assert scaler.get_backoff_factor() == 0.25 and scaler.get_growth_interval() == 7
    disabled = VeScalePrecision("16-mixed", scaler=torch.amp.GradScaler("cpu", enabled=False))
    assert isinstance(disabled.scaler, ShardedGradScaler) and not disabled.scaler.is_enabled()
