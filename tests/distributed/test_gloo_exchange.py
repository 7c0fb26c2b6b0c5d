"""Small gloo collectives fused into one all-to-all (design note [gloo-fused-exchange]).

* Each kind, queued together with the others, gives bitwise what its unfused collective gives
  (gloo's own ``reduce_scatter_tensor``, ``all_gather_single``, ``all_reduce(MAX)``), at 2 and 3
  ranks, with element counts that are not multiples of the 16-byte alignment.
* A queue issues one all-to-all however many operations it holds; a single operation issues its
  own collective; an operation above ``FUSE_MAX_BYTES`` is not queued.
* The engine (design note [fsdp-gloo-fusion]): a root and two blocks at 2 and 3 ranks issue 2
  collectives per step instead of 8, and train bitwise like the same run without fusion; with
  a smaller budget, four blocks gather ahead, stay gathered into backward and keep their
  reduce-scatters in flight only as far as the budget allows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_vescale import _gloo_exchange as gx
from lightning_vescale._dbuffer_comm import gloo_reduce_scatter_sum


@contextlib.contextmanager
def _counting(targets: list[tuple[object, str]]) -> Iterator[dict[str, int]]:
    """Count the calls of each ``(module, name)`` collective in this rank while inside (the
    ranks outlive the test: the originals are put back)."""
    counts: dict[str, int] = {}
    originals = [(mod, name, getattr(mod, name)) for mod, name in targets]
    for mod, name, orig in originals:
        def wrapped(*a, __orig=orig, __name=name, **k):
            counts[__name] = counts.get(__name, 0) + 1
            return __orig(*a, **k)

        setattr(mod, name, wrapped)
    try:
        yield counts
    finally:
        for mod, name, orig in originals:
            setattr(mod, name, orig)


def _submit_all_kinds(full, shard, rs_out, rs_in, rs32_out, rs32_in, flags, rank, W) -> list:
    return [
        gx.submit_all_gather(full, shard, rank=rank, world_size=W, group=None,
                             alone=lambda: dist.all_gather_single(full, shard, async_op=True)),
        gx.submit_reduce_scatter_sum(rs_out, rs_in, rank=rank, world_size=W, group=None,
                                     alone=lambda: None),
        gx.submit_reduce_scatter_sum(rs32_out, rs32_in, rank=rank, world_size=W, group=None,
                                     alone=lambda: None),
        gx.submit_max_all_reduce(flags, rank=rank, world_size=W, group=None),
    ]


def _kinds_body() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7 + rank)
    out: dict = {}
    # all-gather of 7 fp32 (28 bytes: padded in the exchange), reduce-scatter of bf16 parts
    # summed into fp32 (a wire dtype) and of fp32, MAX of uint8 flags
    shard = torch.randn(7, generator=g)
    full = torch.empty(7 * W)
    rs_in = (torch.randn(5 * W, generator=g) * torch.logspace(-3, 3, 5 * W)).to(torch.bfloat16)
    rs_out = torch.empty(5, dtype=torch.float32)
    rs32_in = torch.randn(9 * W, generator=g) * torch.logspace(-3, 3, 9 * W)
    rs32_out = torch.empty(9)
    flags = torch.tensor([rank % 2, 1, 0, int(rank == W - 1)], dtype=torch.uint8)
    ref_flags = flags.clone()
    with _counting([(dist, "all_to_all_single"), (dist, "all_gather_single"),
                    (dist, "all_reduce")]) as counts:
        works = _submit_all_kinds(full, shard, rs_out, rs_in, rs32_out, rs32_in, flags, rank, W)
        assert counts == {}, counts  # queued: nothing issued yet
        works[2].wait()  # waiting any one issues them all, as one exchange
        out["one_exchange"] = dict(counts)
    for w in works:
        w.wait()
        w.wait()  # idempotent
    ref_full = torch.empty_like(full)
    dist.all_gather_single(ref_full, shard)
    dist.all_reduce(ref_flags, op=dist.ReduceOp.MAX)
    order = [(rank - k) % W for k in range(1, W)] + [rank]

    def ring_sum(inp: torch.Tensor, width: int) -> torch.Tensor:
        """Every rank's slice for this rank, summed in fp32 in gloo's ring order (the order
        ``gloo_reduce_scatter_sum`` keeps; its bits against gloo's own reduce-scatter are
        tests/distributed/test_dbuffer_gloo_reduce_scatter.py's subject)."""
        every = torch.empty(W * inp.numel(), dtype=inp.dtype)
        dist.all_gather_single(every, inp)
        parts = every.view(W, W, width)[:, rank].float()
        total = parts[order[0]] + parts[order[1]]
        for k in order[2:]:
            total = total + parts[k]
        return total

    ref_rs32, ref_wide = ring_sum(rs32_in, 9), ring_sum(rs_in, 5)
    unfused = torch.empty(9)  # the DBuffer's unfused form, on the same input
    gloo_reduce_scatter_sum(unfused, rs32_in, rank=rank, world_size=W, group=None,
                            async_op=False, release=lambda: None)
    out["all_gather"] = torch.equal(full, ref_full)
    out["reduce_scatter_fp32"] = torch.equal(rs32_out, ref_rs32) and torch.equal(rs32_out,
                                                                                   unfused)
    out["reduce_scatter_wide"] = torch.equal(rs_out, ref_wide)
    out["max"] = torch.equal(flags, ref_flags)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_kind_fused_is_bitwise_unfused(worlds, world_size):
    for r in worlds(world_size).run(_kinds_body):
        assert r["one_exchange"] == {"all_to_all_single": 1}, r
        assert r["all_gather"] and r["reduce_scatter_fp32"] and r["reduce_scatter_wide"], r
        assert r["max"], r


def _alone_and_large_body() -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    shard = torch.full((3,), float(rank))
    full = torch.empty(3 * W)
    with _counting([(dist, "all_to_all_single"), (dist, "all_gather_single")]) as counts:
        gx.submit_all_gather(full, shard, rank=rank, world_size=W, group=None,
                             alone=lambda: dist.all_gather_single(full, shard,
                                                                  async_op=True)).wait()
        alone = dict(counts)
    big = torch.zeros(gx.FUSE_MAX_BYTES // 4 + 1)
    return {"alone": alone, "alone_ok": full.tolist() == [float(r) for r in range(W)
                                                            for _ in range(3)],
            "small_fuses": gx.fusable(gx.FUSE_MAX_BYTES),
            "large_fuses": gx.fusable(big.numel() * big.element_size())}


def test_single_operation_issues_its_own_collective(worlds):
    for r in worlds(2).run(_alone_and_large_body):
        assert r["alone"] == {"all_gather_single": 1}, r  # no copies through an exchange
        assert r["alone_ok"], r
        assert r["small_fuses"] and not r["large_fuses"], r


# -- the engine ---------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 24), nn.Linear(24, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class _Net(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 12)
        self.blocks = nn.ModuleList([_Block() for _ in range(blocks)])
        self.head = nn.Linear(12, 17)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)


def _engine_body(fuse: bool, steps: int, blocks: int = 2,
                 budget_blocks: float | None = None, reshard: bool | None = None) -> dict:
    """``steps`` training steps of a root and ``blocks`` blocks; per step: the collectives
    issued, the loss, and which groups (root first) were gathered right after forward.
    ``budget_blocks``: from the second step, ``FUSE_MAX_BYTES`` is that many blocks' bytes;
    ``reshard``: the blocks' ``reshard_after_forward``."""
    import lightning_vescale._dbuffer_comm as comm_mod
    from lightning_vescale.fsdp import fully_shard, get_state

    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Net(blocks)
    for blk in model.blocks:
        fully_shard(blk, reshard_after_forward=reshard)
    fully_shard(model)
    groups = [get_state(m).group for m in (model, *model.blocks)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 17, (steps, W, 4, 6), generator=torch.Generator().manual_seed(1))
    per_step, losses, kept = [], [], []
    targets = [(dist, "all_to_all_single"), (comm_mod, "_all_gather_flat"),
               (dist, "all_reduce")]
    saved = gx.FUSE_MAX_BYTES
    try:
        with _counting(targets) as counts, (contextlib.nullcontext() if fuse else gx.unfused()):
            for step in range(steps):
                if step == 1 and fuse and budget_blocks is not None:
                    gx.FUSE_MAX_BYTES = int(budget_blocks * groups[1].fused_gather_bytes)
                counts.clear()
                x = data[step, rank]
                out = model(x[:, :-1])
                kept.append([g.is_unsharded for g in groups])
                loss = nn.functional.cross_entropy(out.flatten(0, 1), x[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                per_step.append(sum(counts.values()))
                losses.append(loss.item())
    finally:
        gx.FUSE_MAX_BYTES = saved
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {"per_step": per_step, "losses": losses, "params": params, "kept": kept}


def _assert_same_training(fused: dict, plain: dict) -> None:
    assert fused["losses"] == plain["losses"]
    for name, t in fused["params"].items():
        assert torch.equal(t, plain["params"][name]), name


@pytest.mark.parametrize("world_size", [2, 3])
def test_engine_fuses_a_step_into_two_exchanges_bitwise(worlds, world_size):
    w = worlds(world_size)
    fused = w.run(_engine_body, True, 4)
    plain = w.run(_engine_body, False, 4)
    for f, p in zip(fused, plain):
        # from the second step (the first records the orders, no prefetch yet): the forward
        # gathers the root and both blocks in one exchange, which keep their parameters into
        # backward; the final callback's exchange carries the three reduce-scatters and the
        # gradient flags. Unfused: 3 all-gathers + block 0's backward one, 3 + 1.
        assert f["per_step"][1:] == [2] * 3, f["per_step"]
        assert p["per_step"][1:] == [8] * 3, p["per_step"]
        assert f["kept"][1:] == [[True, True, True]] * 3, f["kept"]
        assert p["kept"][1:] == [[True, False, True]] * 3, p["kept"]  # root and last (auto)
        _assert_same_training(f, p)


@pytest.mark.parametrize("world_size", [2, 3])
def test_engine_gathers_ahead_within_the_budget(worlds, world_size):
    """With room for 2.5 blocks in one exchange, a root and four blocks: the root's forward
    gathers itself and blocks 0-1, block 1's gathers blocks 2-3; blocks 1-3 stay gathered into
    backward (block 3 as the last of the forward, 1-2 within the budget), block 0 does not;
    reduce-scatters stay in flight two blocks at a time. Bitwise the unfused training."""
    w = worlds(world_size)
    fused = w.run(_engine_body, True, 4, 4, 2.5)
    plain = w.run(_engine_body, False, 4, 4)
    for f, p in zip(fused, plain):
        assert f["kept"][1:] == [[True, False, True, True, True]] * 3, f["kept"]
        assert p["kept"][1:] == [[True, False, False, False, True]] * 3, p["kept"]
        # forward 2 | block 0's backward gather with blocks 3-2's reduces | 1-0's, the root's
        # and the flags. Unfused: 5 + 3 all-gathers, 5 reduce-scatters, the flags.
        assert f["per_step"][1:] == [4] * 3, f["per_step"]
        assert p["per_step"][1:] == [14] * 3, p["per_step"]
        _assert_same_training(f, p)


def test_engine_keeps_fsdp2s_memory_schedule_when_asked(worlds):
    """``reshard_after_forward=True`` on the blocks: nothing gathered ahead or kept into
    backward (what the user asked for), only the collectives that meet anyway are fused."""
    w = worlds(2)
    fused = w.run(_engine_body, True, 4, 2, None, True)
    plain = w.run(_engine_body, False, 4, 2, None, True)
    for f, p in zip(fused, plain):
        assert f["kept"][1:] == [[True, False, False]] * 3, f["kept"]
        assert p["kept"] == f["kept"]
        # root + block 0 | block 1 | block 1's backward gather | block 0's with block 1's
        # reduce | the final callback's. Unfused: 3 + 2 all-gathers, 3 reduce-scatters, flags
        assert f["per_step"][1:] == [5] * 3, f["per_step"]
        assert p["per_step"][1:] == [9] * 3, p["per_step"]
        _assert_same_training(f, p)
