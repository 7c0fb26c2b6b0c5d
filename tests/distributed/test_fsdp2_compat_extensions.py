"""FSDP2's tensor-subclass all-gather extension (issue 35, item 6): upstream's
``test_fully_shard_extensions.py`` cases (a ``TwoTensor`` with ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, a bf16-all-gather subclass defined here, the monkey-patch on a sharded
parameter's local tensor) on CPU/gloo. Torch's FSDP2 runs the hooks; ours refuses such a
parameter with a ``ValueError`` naming it (design note [fsdp-all-gather-extension]) instead of
gathering it in full precision with the hooks silently skipped."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fsdp2_compat import IMPLS, expect_raises, fully_shard_of

CALLS = {"pre": 0, "post": 0}


def _pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    CALLS["pre"] += 1
    return (self.a, self.b), None


def _post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    from torch.testing._internal.two_tensor import TwoTensor

    CALLS["post"] += 1
    a, b = all_gather_outputs
    if out is not None:
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


class _MLP(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d, bias=False)
        self.out_proj = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


def _two_tensor_model() -> nn.Sequential:
    """Upstream's ``_init_two_tensor_mlp``: every weight a ``TwoTensor`` of two equal tensors."""
    from torch.testing._internal.two_tensor import TwoTensor

    model = nn.Sequential(*[_MLP() for _ in range(2)])
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            lin.weight = nn.Parameter(TwoTensor(lin.weight, lin.weight.clone()))
    return model


def _two_tensor_body(impl: str):
    from torch.testing._internal.two_tensor import TwoTensor

    fs = fully_shard_of(impl)
    TwoTensor.fsdp_pre_all_gather = _pre_all_gather
    TwoTensor.fsdp_post_all_gather = _post_all_gather
    try:
        torch.manual_seed(42)
        model = _two_tensor_model()
        ref = copy.deepcopy(model)

        def shard() -> None:
            for mlp in model:
                fs(mlp)
            fs(model)

        if impl == "ours":
            return {"refused": expect_raises(shard, ValueError, "'in_proj.weight'", "TwoTensor",
                                             "fsdp_pre_all_gather", "CommPolicy")}
        shard()
        x = torch.randn(2, 8)
        loss = model(x).sum()
        loss.backward()
        ref_loss = ref(x).sum()
        return {"hooks_ran": CALLS["pre"] > 0 and CALLS["post"] > 0 or CALLS,
                "same_loss": torch.allclose(loss.detach(), ref_loss.detach()) or
                (loss.item(), ref_loss.item())}
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


@pytest.mark.parametrize("impl", IMPLS)
def test_two_tensor_all_gather_extension(worlds, impl):
    out = worlds(2).run(_two_tensor_body, impl)[0]
    bad = {k: v for k, v in out.items() if v is not True and v is not None}
    assert not bad, (impl, bad)


class _BF16AllGather(torch.Tensor):
    """A subclass defining the extension (upstream's ``BFloat16AllGatherTensor``, reduced):
    gathered in bf16, upcast after."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, data.stride(),
                                                   data.storage_offset(), dtype=data.dtype,
                                                   device=data.device)

    def __init__(self, data: torch.Tensor) -> None:
        self._data = data

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._data.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (t,) = outputs
        up = t.to(param_dtype)
        return up, (t, up)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        import torch.utils._pytree as pytree

        out = func(*pytree.tree_map_only(cls, lambda x: x._data, args),
                   **pytree.tree_map_only(cls, lambda x: x._data, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, outer_size, outer_stride):
        return _BF16AllGather(inner["_data"])


def _subclass_body():
    from lightning_vescale.fsdp import fully_shard

    model = _MLP()
    model.out_proj.weight = nn.Parameter(_BF16AllGather(model.out_proj.weight.detach()))
    return expect_raises(lambda: fully_shard(model), ValueError, "'out_proj.weight'",
                         "_BF16AllGather", "fsdp_pre_all_gather / fsdp_post_all_gather")


def test_subclass_defining_the_extension_is_refused(worlds):
    assert worlds(2).run(_subclass_body)[0] is None


def _monkey_patch_body(impl: str):
    """Upstream's monkey-patch case: the methods set on a sharded parameter's local tensor
    after ``fully_shard``."""
    fs = fully_shard_of(impl)
    ran = []

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        ran.append(True)
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def post(self, outputs, metadata, param_dtype, *, out=None):
        (t,) = outputs
        if out is not None:  # as upstream: the copy must not bump the saved tensor's version
            from torch.autograd.grad_mode import _unsafe_preserve_version_counter

            with _unsafe_preserve_version_counter(out):
                out.copy_(t)
            return None
        up = t.to(param_dtype)
        return up, (t, up)

    torch.manual_seed(0)
    model = nn.Sequential(_MLP(), _MLP())
    for mlp in model:
        fs(mlp)
    fs(model)
    for name, p in model.named_parameters():
        if "weight" in name:
            local = p._local_tensor
            local.fsdp_pre_all_gather = pre.__get__(local)
            local.fsdp_post_all_gather = post.__get__(local)
    x = torch.randn(2, 8)
    if impl == "ours":
        return expect_raises(lambda: model(x), ValueError, "'0.in_proj.weight'",
                             "fsdp_pre_all_gather")
    model(x).sum().backward()
    return None if ran else "the pre-all-gather hook did not run"


@pytest.mark.parametrize("impl", IMPLS)
def test_monkey_patched_local_tensor(worlds, impl):
    assert worlds(2).run(_monkey_patch_body, impl)[0] is None, impl


def _plain_still_trains_body():
    """A model without the extension is untouched by the check (one step, two ranks)."""
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(_MLP(), _MLP())
    ref = copy.deepcopy(model)
    for mlp in model:
        fully_shard(mlp)
    fully_shard(model)
    x = torch.randn(2 * dist.get_world_size(), 8)
    r = dist.get_rank()
    model(x[2 * r:2 * r + 2]).sum().backward()
    ref(x).sum().div(dist.get_world_size()).backward()
    return all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6)
               for p, q in zip(model.parameters(), ref.parameters()))


def test_plain_parameters_still_train(worlds):
    assert all(worlds(2).run(_plain_still_trains_body))


def _torchao_float8_body():
    """torchao's own float8 training (``convert_to_float8_training`` with
    ``enable_fsdp_float8_all_gather=True``): its weights are ``WeightWithDynamicFloat8CastTensor``,
    whose ``fsdp_pre_all_gather`` casts to float8 for FSDP2's all-gather. Ours refuses them by
    name at ``fully_shard`` instead of gathering them in full precision without the hooks."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_vescale.fsdp import fully_shard

    model = nn.Sequential(_MLP(16), _MLP(16))
    convert_to_float8_training(model, config=Float8LinearConfig(
        enable_fsdp_float8_all_gather=True))
    cls = type(model[0].in_proj.weight).__name__
    assert cls == "WeightWithDynamicFloat8CastTensor", cls  # torchao's subclass, not ours
    return expect_raises(lambda: fully_shard(model[0]), ValueError, "'in_proj.weight'", cls,
                         "fsdp_pre_all_gather / fsdp_post_all_gather")


def test_torchao_float8_all_gather_is_refused(worlds):
    """The ``[clients]`` extra installs torchao: its ``Float8Linear`` with float8 all-gather."""
    pytest.importorskip("torchao.float8")
    assert worlds(2).run(_torchao_float8_body)[0] is None
