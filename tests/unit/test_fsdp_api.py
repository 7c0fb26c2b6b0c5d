"""Pure parts of lightning_vescale.fsdp (no process group): policy, granularity, counting."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_vescale.fsdp import MixedPrecisionPolicy
from lightning_vescale.fsdp._collect import check_param, resolve_granularities
from lightning_vescale.fsdp._policy import as_policy
from lightning_vescale.testing import CopyCommCounter


def test_policy_is_frozen_keyword_only_and_validated():
    p = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert p.output_dtype is None and p.cast_forward_inputs
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.param_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(torch.bfloat16)  # type: ignore[misc]
    with pytest.raises(TypeError, match="reduce_dtype"):
        MixedPrecisionPolicy(reduce_dtype=torch.int32)


def test_policy_accepts_fsdp2_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    p = as_policy(TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert isinstance(p, MixedPrecisionPolicy)
    assert (p.param_dtype, p.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert as_policy(None) == MixedPrecisionPolicy()
    with pytest.raises(TypeError, match="mp_policy"):
        as_policy("bf16")


def _entries():
    a, b = nn.Parameter(torch.ones(4, 6)), nn.Parameter(torch.ones(6))
    return [("w", a), ("b", b)]


def test_granularity_forms():
    e = _entries()
    assert resolve_granularities(None, e) == {"w": 1, "b": 1}
    assert resolve_granularities(8, e) == {"w": 8, "b": 8}
    assert resolve_granularities({"w": 6}, e) == {"w": 6, "b": 1}
    assert resolve_granularities(lambda n, p: p.shape[-1], e) == {"w": 6, "b": 6}
    with pytest.raises(ValueError, match="'x'"):
        resolve_granularities({"x": 2}, e)
    with pytest.raises(TypeError, match="granularity"):
        resolve_granularities(2.5, e)


@pytest.mark.parametrize("param,exc,word", [
    (nn.Parameter(torch.ones(2, dtype=torch.complex64)), TypeError, "complex"),
])
def test_check_param_rejects(param, exc, word):
    with pytest.raises(exc, match=word):
        check_param("p", param)


def test_counter_counts_copies_not_views():
    x = torch.randn(8, 4)
    with CopyCommCounter() as c:
        x.view(4, 8)
        x.t()
        y = x.clone()
        y.copy_(x)
        torch.cat([x, x])
        x.to(torch.float64)
    s = c.summary()
    assert s["copies"] == 4 and s["comms"] == 0
    # clone 128 B + copy_ 128 B + cat 256 B + fp64 cast 256 B
    assert s["copy_bytes"] == 128 + 128 + 256 + 256
