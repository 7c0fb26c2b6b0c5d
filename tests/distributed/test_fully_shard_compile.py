"""``torch.compile`` per block under ``fully_shard`` (design note [fsdp-compile]).

FSDP2's pattern: ``fully_shard(block)``, then ``block.compile()``; the engine's hooks run
eagerly around each compiled forward. Three models train side by side on the same data: compiled
blocks under ``fully_shard``, eager blocks under ``fully_shard``, and a single-process eager
reference on the global batch. With ``aot_eager`` (dynamo + AOTAutograd, no code generation) the
compiled run must equal the eager run bitwise; with ``inductor`` (generated C++ kernels, other
rounding) losses agree to 1e-5 relative with both. No recompilation after the first step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_vescale.fsdp import fully_shard
from tests.distributed._fully_shard_helpers import (
    assemble,
    batches,
    build,
    local_pieces,
    micro,
)


def _shard(model, backend: str | None):
    for block in model.blocks:
        fully_shard(block)
        if backend is not None:
            block.compile(backend=backend)
    return fully_shard(model)


def _compile_body(backend: str, steps: int) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rank, world = dist.get_rank(), dist.get_world_size()
    base = build("gpt")
    ref = copy.deepcopy(base)
    compiled, eager = _shard(copy.deepcopy(base), backend), _shard(copy.deepcopy(base), None)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
            for m in (compiled, eager, ref)]
    losses = {"compiled": [], "eager": [], "ref": []}
    frames_after_first = None
    for step, (x, y) in enumerate(batches("gpt", steps, 2 * world)):
        for name, model, opt in zip(losses, (compiled, eager, ref), opts):
            if name == "ref":
                loss = model(x, y)
            else:
                loss = model(micro(x, rank, world), micro(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            value = loss.detach().clone()
            if name != "ref":
                dist.all_reduce(value)
                value /= world
            losses[name].append(value.item())
        if step == 0:
            frames_after_first = counters["frames"]["ok"]
    return {"losses": losses, "compiled": local_pieces(compiled), "eager": local_pieces(eager),
            "ref": {n: p.detach().clone() for n, p in ref.named_parameters()},
            "frames_first": frames_after_first, "frames_last": counters["frames"]["ok"]}


def _check(results: list[dict], *, bitwise: bool) -> None:
    r0 = results[0]
    lc, le, lr = (r0["losses"][k] for k in ("compiled", "eager", "ref"))
    if bitwise:
        assert lc == le, (lc, le)
    for a, b in ((lc, le), (lc, lr)):
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-5 * abs(y), (a, b)
    got = assemble([r["compiled"] for r in results])
    eager = assemble([r["eager"] for r in results])
    for n, want in r0["ref"].items():
        if bitwise:
            assert torch.equal(got[n], eager[n]), n
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-4, msg=n)
    for r in results:
        assert r["frames_first"] > 0, r["frames_first"]  # the blocks were compiled
        assert r["frames_last"] == r["frames_first"], (r["frames_first"], r["frames_last"])


@pytest.mark.parametrize("world_size", [1, 3])
def test_compiled_blocks_aot_eager_bitwise_equal_eager(worlds, world_size):
    _check(worlds(world_size).run(_compile_body, "aot_eager", 3), bitwise=True)


def test_compiled_blocks_inductor_parity(worlds):
    _check(worlds(2).run(_compile_body, "inductor", 3), bitwise=False)
