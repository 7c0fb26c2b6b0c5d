"""A list group in backward (issue 35, item 4), on torch's FSDP2 and on ours: torchtitan's
``fully_shard([norm, output], reshard_after_forward=False)`` is all-gathered in backward as often
as FSDP2 does (counted with ``CopyCommCounter``), and the gradients match one process, also with
two forwards before one backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_vescale._gloo_exchange import unfused
from tests.distributed._fsdp2_compat import IMPLS, full_grads, fully_shard_of, micro

_ALL_GATHER = "c10d._allgather_base_"


class _Titan(nn.Module):
    """torchtitan's layout: embedding-like input layer, blocks, then ``norm`` and ``output``."""

    def __init__(self, d: int = 8, n_layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.output(self.norm(h))


def _shard(impl: str, model: _Titan, reshard_after_forward: bool | None) -> None:
    fs = fully_shard_of(impl)
    for layer in model.layers:
        fs(layer)
    fs([model.norm, model.output], reshard_after_forward=reshard_after_forward)
    fs(model)


@unfused()  # counts each all-gather as FSDP2 issues it (design note [gloo-fused-exchange])
def _count_body(impl: str, reshard_after_forward: bool | None):
    from lightning_vescale.testing import CopyCommCounter

    torch.manual_seed(0)
    model = _Titan()
    _shard(impl, model, reshard_after_forward)
    x = torch.randn(4, 8)
    counts = []
    for _ in range(3):
        with CopyCommCounter() as fwd:
            loss = model(x).square().mean()
        with CopyCommCounter() as bwd:
            loss.backward()
        model.zero_grad()
        counts.append((fwd.by_op[_ALL_GATHER], bwd.by_op[_ALL_GATHER]))
    return counts


@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_list_group_backward_all_gathers_as_fsdp2(worlds, reshard_after_forward):
    """Forward: root, 2 layers, the list group (4). Backward: each layer again, and the list
    group only when it resharded after forward: 2 (pinned) or 3, as FSDP2; before the fix ours
    re-gathered the list group between ``output``'s and ``norm``'s backward (3 and 4)."""
    want = [(4, 2 if reshard_after_forward is False else 3)] * 3
    for impl in IMPLS:
        got = worlds(2).run(_count_body, impl, reshard_after_forward)[0]
        assert got == want, (impl, got)


def test_list_group_auto_keeps_the_last_group(worlds):
    """``None``: FSDP2 reshards the list group and gathers it in backward (3); ours keeps the
    last group of the forward order from the second step on (design note
    [fsdp-reshard-policy]): 2, once, not re-gathered between its modules."""
    assert worlds(2).run(_count_body, "torch", None)[0] == [(4, 3)] * 3
    assert worlds(2).run(_count_body, "ours", None)[0] == [(4, 3), (4, 2), (4, 2)]


def _parity_body(impl: str, reshard_after_forward: bool | None, forwards: int):
    world = dist.get_world_size()
    torch.manual_seed(0)
    model = _Titan()
    ref = copy.deepcopy(model)
    _shard(impl, model, reshard_after_forward)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(2 * world, 8, generator=g) for _ in range(forwards)]
    out = []
    for _ in range(2):  # the second iteration runs with the recorded orders (prefetch)
        sum(model(micro(x)).square().mean() for x in xs).backward()
        out.append(full_grads(model))
        model.zero_grad()
    sum(ref(x).square().mean() for x in xs).backward()
    return out, {n: p.grad.clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reshard_after_forward,forwards", [(False, 1), (True, 2), (False, 2)])
def test_list_group_gradients_match_one_process(worlds, impl, reshard_after_forward, forwards):
    steps, want = worlds(2).run(_parity_body, impl, reshard_after_forward, forwards)[0]
    for got in steps:
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6,
                                       msg=f"{impl} {n}")
