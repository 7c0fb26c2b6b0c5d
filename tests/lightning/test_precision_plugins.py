"""Lightning's precision plugins become ours by class, with the device type they carry.

``to_vescale_precision`` recognises Lightning's (Trainer's and Fabric's) ``Precision``,
``MixedPrecision``, ``HalfPrecision`` and ``FSDPPrecision`` with ``isinstance`` (subclasses
included, look-alikes refused) and keeps the device type of a plugin's ``device``, whatever the
accelerator (the strategy sets its root device's type at setup either way).
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins import precision as fabric_plugins
from lightning.pytorch.plugins import precision as trainer_plugins

from lightning_vescale.precision import (
    VeScaleFabricPrecision,
    VeScalePrecision,
    _default_device_type,
    to_vescale_precision,
)


class MyMixed(trainer_plugins.MixedPrecision):
    """A user's subclass of Lightning's plugin: still Lightning's mixed precision."""


class MixedPrecision:
    """A look-alike that only shares the name: not Lightning's plugin."""

    precision = "bf16-mixed"
    device = "cpu"


@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
def test_lightning_plugins_are_recognised_by_class(fabric):
    plugins = trainer_plugins if not fabric else fabric_plugins
    target = VeScaleFabricPrecision if fabric else VeScalePrecision
    cases = [(plugins.Precision(), "32-true"),
             (plugins.MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
             (plugins.HalfPrecision("bf16-true"), "bf16-true"),
             (plugins.FSDPPrecision("bf16-mixed"), "bf16-mixed")]
    for plugin, flag in cases:
        out = to_vescale_precision(plugin, fabric=fabric)
        assert type(out) is target and out.precision == flag, plugin


def test_a_subclass_converts_and_a_look_alike_is_refused():
    out = to_vescale_precision(MyMixed("bf16-mixed", "cpu"))
    assert isinstance(out, VeScalePrecision) and out.precision == "bf16-mixed"
    with pytest.raises(ValueError, match="cannot use the precision plugin MixedPrecision"):
        to_vescale_precision(MixedPrecision())
    with pytest.raises(ValueError, match="cannot use the precision plugin DoublePrecision"):
        to_vescale_precision(trainer_plugins.DoublePrecision())


@pytest.mark.parametrize(("device", "want"), [("cpu", "cpu"), ("cuda", "cuda"),
                                              ("cuda:1", "cuda"), ("xpu", "xpu"),
                                              (torch.device("mps"), "mps")])
def test_the_plugins_device_type_is_kept(device, want):
    out = to_vescale_precision(trainer_plugins.MixedPrecision("bf16-mixed", device))
    assert out._device_type == want


def test_without_a_device_the_accelerators_type_until_setup():
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    assert _default_device_type() == (acc.type if acc is not None else "cpu")
    plugin = to_vescale_precision(trainer_plugins.FSDPPrecision("bf16-mixed"))
    assert plugin._device_type is None
    plugin._set_device_type("cpu")  # what the strategy does once its root device is known
    assert plugin.forward_context().device == "cpu"
