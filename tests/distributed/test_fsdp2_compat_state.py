"""FSDP2's composable-API surface (issue 35, items 1-3): upstream's
``test/distributed/_composable/fsdp/test_fully_shard_state.py`` ported to CPU/gloo, each case run
on torch's FSDP2 and on ours: ``fully_shard.state(module)``, re-applying, the class swap,
containers without ``forward`` refused, ``copy.deepcopy`` refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fsdp2_compat import IMPLS, MLP, expect_raises, fully_shard_of, micro


def _mlps(n: int = 3) -> nn.Sequential:
    return nn.Sequential(*[MLP(8, 8, 8) for _ in range(n)])


# -- upstream test_fully_shard_state: one distinct state per call ---------------------------------
def _state_body(impl: str):
    fs = fully_shard_of(impl)
    torch.manual_seed(0)
    model = _mlps()
    for mlp in model:
        fs(mlp)
    fs(model)
    root = fs.state(model)
    states = [root] + [fs.state(mlp) for mlp in model]
    out = {"root_not_none": root is not None,
           "distinct": len({id(s) for s in states}) == len(states),
           "unsharded_is_none": fs.state(model[0].l1) is None,
           "is_root_before_init": root._is_root is None}
    model(torch.randn(2, 8)).sum().backward()
    # what code reads through the accessor (torch's pipelining stage, user code)
    out["is_root"] = root._is_root is True and fs.state(model[0])._is_root is False
    out["all_states"] = len(root._state_ctx.all_states) == 4
    out["param_group"] = (root._fsdp_param_group is None
                          and fs.state(model[0])._fsdp_param_group is not None
                          and len(fs.state(model[1])._fsdp_param_groups) == 1)
    out["modules"] = fs.state(model[2])._modules == (model[2],)
    out["mp_policy"] = fs.state(model[2])._mp_policy is not None
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_shard_state(worlds, impl):
    out = worlds(1).run(_state_body, impl)[0]
    assert all(out.values()), (impl, out)


def _list_state_body(impl: str):
    fs = fully_shard_of(impl)
    model = _mlps(2)
    fs([model[0], model[1]])
    return fs.state(model[0]) is fs.state(model[1]) and fs.state(model[0]) is not None


@pytest.mark.parametrize("impl", IMPLS)
def test_list_group_shares_one_state(worlds, impl):
    assert worlds(1).run(_list_state_body, impl)[0], impl


# -- upstream test_fully_shard_reapply / test_fully_shard_cls --------------------------------------
def _reapply_and_cls_body(impl: str):
    from torch.distributed.fsdp import FSDPModule

    fs = fully_shard_of(impl)
    model = MLP(8, 8, 8)
    fs(model)
    out = {"reapply": expect_raises(lambda: fs(model), Exception,
                                    "once")}
    out["cls"] = isinstance(model, MLP) and isinstance(model, FSDPModule) \
        and type(model).__name__.endswith("FSDPMLP")
    out["children_plain"] = not any(isinstance(m, FSDPModule) for m in model.modules()
                                    if m is not model)
    seq = _mlps()
    fs(seq)
    out["seq"] = isinstance(seq, nn.Sequential) and isinstance(seq, FSDPModule)
    out["slice_plain"] = isinstance(seq[:2], nn.Sequential) \
        and not isinstance(seq[:2], FSDPModule)
    return {k: v for k, v in out.items() if v is not True and v is not None}


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_shard_reapply_and_cls(worlds, impl):
    bad = worlds(1).run(_reapply_and_cls_body, impl)[0]
    assert not bad, (impl, bad)


# -- upstream test_fully_shard_unsupported_module_cls ---------------------------------------------
def _containers_body(impl: str):
    fs = fully_shard_of(impl)
    words = ("fully_shard does not support containers that do not implement forward",)
    out = {
        "module_list": expect_raises(lambda: fs(nn.ModuleList([MLP(8) for _ in range(3)])),
                                     ValueError, *words),
        "module_dict": expect_raises(lambda: fs(nn.ModuleDict({"1": MLP(8), "2": MLP(8)})),
                                     ValueError, *words),
    }
    if impl == "ours":  # ours also says what to shard instead, and refuses it inside a list
        out["module_list"] = out["module_list"] or expect_raises(
            lambda: fs(nn.ModuleList([MLP(8)])), ValueError, "for b in model.layers",
            "fully_shard(b)")
        out["in_list"] = expect_raises(lambda: fs([MLP(8), nn.ModuleList([MLP(8)])]),
                                       ValueError, "do not implement forward")

    class Stack(nn.ModuleList):  # a ModuleList subclass with a forward is a module like others
        def forward(self, x):
            for m in self:
                x = m(x)
            return x

    stack = Stack([MLP(8, 8, 8) for _ in range(2)])
    fs(stack)
    out["subclass_with_forward"] = None if stack(torch.randn(2, 8)).shape == (2, 8) else "shape"
    return {k: v for k, v in out.items() if v is not None}


@pytest.mark.parametrize("impl", IMPLS)
def test_containers_without_forward_are_refused(worlds, impl):
    bad = worlds(1).run(_containers_body, impl)[0]
    assert not bad, (impl, bad)


def _blocks_of_a_module_list_body(impl: str):
    """What the error says to do instead trains like one process (2 ranks)."""
    fs = fully_shard_of(impl)
    world = dist.get_world_size()
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(MLP(8, 8, 8) for _ in range(2))

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    model = Net()
    ref = copy.deepcopy(model)
    for b in model.layers:
        fs(b)
    fs(model)
    x = torch.randn(2 * world, 8)
    model(micro(x)).square().mean().backward()
    ref(x).square().mean().backward()
    return {n: p.grad.full_tensor() for n, p in model.named_parameters()}, \
        {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("impl", IMPLS)
def test_sharding_each_block_instead_matches_one_process(worlds, impl):
    got, want = worlds(2).run(_blocks_of_a_module_list_body, impl)[0]
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"{impl} {n}")


# -- upstream test_fully_shard_deepcopy -----------------------------------------------------------
def _deepcopy_body(impl: str):
    fs = fully_shard_of(impl)
    model = MLP(8)
    fs(model)
    out = {"assertion": expect_raises(lambda: copy.deepcopy(model), AssertionError,
                                      "FSDP does not support deepcopy")}
    if impl == "ours":
        out["runtime_error_with_fix"] = expect_raises(
            lambda: copy.deepcopy(model), RuntimeError, "MLP", "before fully_shard",
            "load_state_dict")
        inner = nn.Sequential(MLP(8), nn.Linear(4, 4))
        fs(inner[0])
        out["nested"] = expect_raises(lambda: copy.deepcopy(inner), RuntimeError,
                                      "FSDP does not support deepcopy")
    return {k: v for k, v in out.items() if v is not None}


@pytest.mark.parametrize("impl", IMPLS)
def test_deepcopy_is_refused(worlds, impl):
    bad = worlds(1).run(_deepcopy_body, impl)[0]
    assert not bad, (impl, bad)
