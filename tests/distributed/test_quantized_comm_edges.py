"""Quantized communication under the settings users reach first (issue 34): bf16/fp16 masters,
an fp16 gradient wire, outliers in a block, a float8 wire dtype.

The reference is ``_quant_helpers``' single process that fake-quantizes the same blocks (see
``test_quantized_comm.py``); what forward sees must equal it exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed._fully_shard_helpers import assemble, local_pieces, micro
from tests.distributed._quant_helpers import Rows, fake_quant, reference_step, rows_batches

ROWS, COLS = 64, 128  # 8192 elements: 32 blocks of 256, uneven over 3 ranks' rows


# -- bf16 / fp16 masters (precision="bf16-true", or a bf16 model under plain fully_shard) --------
def _low_precision_masters(dtype: torch.dtype, fmt: str, steps: int):
    from lightning_vescale import CommPolicy
    from lightning_vescale.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Rows(ROWS, COLS).to(dtype)
    ref = copy.deepcopy(model)
    fully_shard(model, comm_policy=CommPolicy(all_gather=fmt, quantize={"w": True}))
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(m.w.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    wants, losses = [], []
    for x, y in rows_batches(ROWS, COLS, steps, 2 * world):
        x, y = x.to(dtype), y.to(dtype)
        # what forward must see: the master, fake-quantized (full_tensor: every rank calls it)
        wants.append(fake_quant(model.w.full_tensor(), fmt, 256))
        loss = model(micro(x, rank, world), micro(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference_step(ref, ref_opt, x, y, world=world, fmt=fmt, block=256, quantized={"w"})
        losses.append(loss.item())
    return seen, wants, losses, local_pieces(model), {
        n: p.detach().clone() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_masters_all_gather_quantized(worlds, dtype, fmt, world):
    """bf16 and fp16 masters (before the fix: ``amax`` into an fp32 ``out`` raised at the first
    all-gather): forward sees exactly the fake-quantized master (the reference's scales, codes
    and one rounding to the master dtype), every step."""
    res = worlds(world).run(_low_precision_masters, dtype, fmt, 2)
    for seen, wants, losses, _, _ in res:
        assert len(seen) == len(wants) == 2
        for s, w in zip(seen, wants):
            assert s.dtype == dtype
            torch.testing.assert_close(s, w, rtol=0, atol=0)
        assert all(torch.isfinite(torch.tensor(losses)))
    # Training: the gradients are summed in the master dtype in another order than the
    # reference's, so parameters agree to a few bf16/fp16 ulps of ~0.1 (a wrong block or
    # slice would be off by the weights' own size, ~1e-1).
    got = assemble([r[3] for r in res])
    for n, want in res[0][4].items():
        torch.testing.assert_close(got[n], want, rtol=2e-2, atol=2e-3, msg=n)
