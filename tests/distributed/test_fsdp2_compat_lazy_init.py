"""FSDP2's ``test_reset_sharded_param_in_lazy_init`` (torch's
``test/distributed/_composable/fsdp/test_fully_shard_init.py``), on torch's FSDP2 and on ours.

A meta-device model is sharded, two of its layers are materialised with ``to_empty``, and a
parameter of the root group is *replaced* (``model.weight_norm = nn.Parameter(...)``, computed
from the materialised layers) before the first forward. FSDP2 re-registers such a parameter at
lazy initialisation (``FSDPParam.reset_sharded_param``); so does ours: the group adopts the new
parameter's data (design note [fsdp-materialize]).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed._fsdp2_compat import IMPLS, full, fully_shard_of


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def init_weight_norm(self):
        with torch.no_grad():
            weight_norm = torch.linalg.norm(
                self.layer1.weight, dim=1
            ) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(weight_norm)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        out = self.layer1(inp)
        out = self.layer2(out)
        return out.sum() + self.weight_norm.sum()


def _reset_sharded_param_in_lazy_init(impl: str):
    fully_shard = fully_shard_of(impl)
    with torch.device("meta"):
        model = MyModel()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)

    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():  # (not upstream: values, so that both sides can be compared)
        model.layer1.weight.fill_(0.5)
        model.layer2.weight.fill_(-0.25)
    model.init_weight_norm()
    expected_norm = full(model.weight_norm)

    inp = torch.arange(9.0).reshape(3, 3) / 9
    loss = model(inp).sum()
    loss.backward()
    return (loss.item(), expected_norm, full(model.weight_norm), full(model.weight_norm.grad),
            full(model.layer1.weight.grad))


@pytest.mark.parametrize("impl", IMPLS)
def test_reset_sharded_param_in_lazy_init(worlds, impl):
    out = worlds(2).run(_reset_sharded_param_in_lazy_init, impl)
    for loss, expected_norm, norm, norm_grad, l1_grad in out:
        torch.testing.assert_close(norm, expected_norm)  # the new parameter, not the meta one
        torch.testing.assert_close(norm_grad, torch.ones(3))
        # single-process value: layer1 = 0.5, layer2 = -0.25 everywhere
        x = torch.arange(9.0).reshape(3, 3) / 9
        ref = x @ torch.full((3, 3), 0.5).T @ torch.full((3, 3), -0.25).T
        assert abs(loss - (ref.sum().item() + expected_norm.sum().item())) < 1e-5
        torch.testing.assert_close(l1_grad, torch.full((3, 3), -0.75) * x.sum(0))


def _sharded_model():
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = MyModel()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    return model


def _replace_in_materialized_group():
    model = _sharded_model()
    model.weight_norm = nn.Parameter(torch.full((3,), 2.0))  # a plain tensor: ours only
    model(torch.ones(3, 3)).backward()
    ok = (full(model.weight_norm), full(model.weight_norm.grad))
    model = _sharded_model()
    model.weight_norm = nn.Parameter(torch.ones(4))
    try:
        model(torch.ones(3, 3))
    except ValueError as e:
        return ok, str(e)
    return ok, "no error"


def test_replaced_param_of_a_materialized_group_is_adopted(worlds):
    for (norm, grad), error in worlds(2).run(_replace_in_materialized_group):
        torch.testing.assert_close(norm, torch.full((3,), 2.0))
        torch.testing.assert_close(grad, torch.ones(3))
        assert "parameter 'weight_norm' was replaced by one of shape (4,)" in error, error
        assert "planned for (3,)" in error, error
