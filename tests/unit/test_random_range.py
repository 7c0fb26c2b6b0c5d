"""One rank's range of a whole-tensor random draw on the CPU generator (issue 35:
``placement/_random_range.py``, design note [ragged-random]).

Each case draws the whole tensor with an op (the one-process reference), then draws only the
range ``[start, stop)`` with :func:`draw_range` from the same seed, with scratch buffers far
smaller than the tensor: the range must be bitwise the whole draw's and the generator (the
default one, or the ``generator=`` given, leaving the default alone) must end where the whole
draw leaves it.
"""

from __future__ import annotations

import pytest
import torch

import lightning_vescale.placement._random_range as rr
from lightning_vescale.placement._common import aten

OPS = [  # (op, extra args): each is a CPU kernel that draws in element order
    (aten.uniform_.default, (-2.0, 3.0)),
    (aten.normal_.default, (0.5, 2.0)),
    (aten.random_.default, ()),
    (aten.random_.to, (100,)),
    (getattr(aten.random_, "from"), (-5, 7)),
    (aten.exponential_.default, (1.5,)),
    (aten.geometric_.default, (0.3,)),
    (aten.log_normal_.default, (0.0, 0.5)),
    (aten.cauchy_.default, (0.0, 1.0)),
    (aten.bernoulli_.float, (0.3,)),
]
SIZES = [16, 17, 31, 48, 1000, 4099]


def _ranges(n: int) -> list[tuple[int, int]]:
    return [(0, n), (0, n // 3), (n // 3, n - n // 5), (n - 1, n), (5, 5), (n, n)]


def _draw(op, args, dtype, n, start, stop, generator=None):
    kwargs = {} if generator is None else {"generator": generator}
    local = torch.full((stop - start,), -1, dtype=dtype)
    assert rr.can_draw_range(op, local, n, kwargs)
    rr.draw_range(op, local, start, n, args, kwargs)
    return local


# bf16 normal_ keeps the whole draw (can_draw_range says no: test_which_draws_take_the_range)
CASES = [(op, args, dtype) for op, args in OPS
         for dtype in (torch.float32, torch.float64, torch.bfloat16)
         if not (op is aten.normal_.default and dtype is torch.bfloat16)]


@pytest.mark.parametrize("op,args,dtype", CASES,
                         ids=[f"{op}-{str(dtype)[6:]}" for op, _, dtype in CASES])
def test_range_is_the_whole_draws(monkeypatch, op, args, dtype):
    monkeypatch.setattr(rr, "SCRATCH_NUMEL", 48)  # many pieces, aligned to 16 for normal_
    for n in SIZES:
        torch.manual_seed(0)
        whole = torch.empty(n, dtype=dtype)
        op(whole, *args)
        after = torch.rand(4)
        for start, stop in _ranges(n):
            torch.manual_seed(0)
            mine = _draw(op, args, dtype, n, start, stop)
            assert torch.equal(mine, whole[start:stop]), (op, dtype, n, start, stop)
            assert torch.equal(torch.rand(4), after), "the generator must end where it does"


def test_a_given_generator_advances_and_the_default_does_not(monkeypatch):
    monkeypatch.setattr(rr, "SCRATCH_NUMEL", 32)
    gen = torch.Generator().manual_seed(5)
    whole = torch.empty(1000).normal_(generator=gen)
    gen_after = torch.rand(3, generator=gen)
    torch.manual_seed(1)
    default_next = torch.rand(3)
    torch.manual_seed(1)
    gen.manual_seed(5)
    mine = _draw(aten.normal_.default, (0.0, 1.0), torch.float32, 1000, 100, 700, generator=gen)
    assert torch.equal(mine, whole[100:700])
    assert torch.equal(torch.rand(3, generator=gen), gen_after)
    assert torch.equal(torch.rand(3), default_next)  # the default generator was not touched


def test_which_draws_take_the_range():
    """The CPU generator for the element-order kernels; another device's generator (a meta
    tensor stands in for an accelerator's), bf16/fp16 ``normal_`` and a tensor under 16
    elements for ``normal_`` keep the whole draw."""
    cpu = torch.empty(4)
    assert rr.can_draw_range(aten.uniform_.default, cpu, 100, {})
    assert rr.can_draw_range(aten.normal_.default, cpu, 100, {})
    assert rr.can_draw_range(aten.normal_.default, cpu, 100, {"generator": torch.Generator()})
    assert not rr.can_draw_range(aten.normal_.default, cpu, 15, {})
    assert not rr.can_draw_range(aten.normal_.default, cpu.bfloat16(), 100, {})
    assert not rr.can_draw_range(aten.uniform_.default, torch.empty(4, device="meta"), 100, {})
