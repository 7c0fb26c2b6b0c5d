"""Mixed precision and dtypes: bf16 compute with fp32 masters and reductions, one group holding
parameters of two dtypes (one DBuffer per dtype), ``output_dtype``."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from tests.distributed._fully_shard_helpers import (
    OPTS,
    assemble,
    batches,
    build,
    global_mean,
    make_opt,
    micro,
    shard,
)


# -- mixed precision --------------------------------------------------------------------------
def _bf16_body(steps):
    from lightning_vescale.fsdp import MixedPrecisionPolicy, param_fqn_map

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build("gpt")
    ref = copy.deepcopy(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard(model, mp_policy=mp)
    seen_dtypes = set()
    model.blocks[0].attn.qkv.register_forward_pre_hook(
        lambda m, a: seen_dtypes.add((m.weight.dtype, a[0].dtype)))
    opt = make_opt(model.parameters(), "adamw")
    ref_opt = OPTS["adamw"][0](ref.parameters(), **OPTS["adamw"][1])
    losses, ref_losses = [], []
    for x, y in batches("gpt", steps, 2 * world):
        loss = model(micro(x, rank, world), micro(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        rl = ref(x, y)
        rl.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(rl.item())
    masters = {n: p.dtype for n, p in model.named_parameters()}
    grads_fp32 = all(mp_.buffer.grad_shard.dtype == torch.float32
                     for _, mp_ in param_fqn_map(model).values())
    return losses, ref_losses, seen_dtypes, masters, grads_fp32


def test_bf16_params_track_fp32(worlds):
    losses, ref_losses, seen, masters, grads_fp32 = worlds(2).run(_bf16_body, 4)[0]
    # stated tolerance: bf16 compute (8-bit mantissa) keeps the loss within 2% of fp32
    rel = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    assert rel < 2e-2, (losses, ref_losses)
    assert rel > 0  # it really computed in bf16
    assert seen == {(torch.bfloat16, torch.bfloat16)}
    assert set(masters.values()) == {torch.float32} and grads_fp32


# -- one group with parameters of two dtypes (one DBuffer per dtype); output_dtype ---------------
class _TwoDtypes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3).double()

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).double()).float()


def _two_dtypes_body():
    from lightning_vescale.fsdp import MixedPrecisionPolicy, fully_shard, get_state

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _TwoDtypes()
    ref = copy.deepcopy(model)
    fully_shard(model)
    dtypes = sorted(str(d) for d, _trainable in get_state(model).group.buffers)
    x = torch.randn(2 * world, 5)
    model(micro(x, rank, world)).square().mean().backward()
    ref(x).square().mean().backward()
    grads = {n: (p.grad.to_local().clone(), tuple(p.shape)) for n, p in model.named_parameters()}
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    lin = torch.nn.Linear(4, 4)
    fully_shard(lin, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    output_dtype=torch.float32))
    out_dtype = lin(torch.randn(2, 4)).dtype
    return dtypes, grads, ref_grads, out_dtype


def test_one_group_two_dtypes_and_output_dtype(worlds):
    res = worlds(2).run(_two_dtypes_body)
    dtypes, _, ref_grads, out_dtype = res[0]
    assert dtypes == ["torch.float32", "torch.float64"]
    assert out_dtype == torch.float32
    got = assemble([r[1] for r in res])
    for n, g in ref_grads.items():
        assert got[n].dtype == g.dtype
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-6, msg=n)
