"""Quantized communication (issue 25): ``fully_shard(comm_policy=CommPolicy(...))``.

The reference (``_quant_helpers``) is a single process that fake-quantizes the same blocks and
rounds each rank's gradient to the wire dtype, so the engine must match it up to summation
order, not just "within quantization error": a wrong block, scale or slice shows as ~1e-3,
summation order as ~1e-7. Tolerances (1e-5 .. 1e-4) sit between; a flip of one rounding
decision after a 1e-7 difference moves one element by a step at most, which SGD's next
update turns into ~1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.gpt import GPT, GPTConfig
from lightning_vescale._gloo_exchange import unfused
from tests.distributed._fully_shard_helpers import (
    assert_params_match_reference,
    batches,
    local_pieces,
    micro,
    shard,
)
from tests.distributed._quant_helpers import (
    Rows,
    default_quantized,
    fake_quant,
    reference_step,
    rows_batches,
)

GPT_CFG = dict(n_embd=64, n_head=2, n_layer=2)
SGD = dict(lr=0.1, momentum=0.9)


def _build(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        return GPT(GPTConfig(**GPT_CFG))
    rows, cols = kind
    return Rows(rows, cols)


def _data(kind, steps: int, batch: int):
    if kind == "gpt":
        return batches("gpt", steps, batch)
    return rows_batches(*kind, steps, batch)


def _shard(model: nn.Module, **kw) -> None:
    from lightning_vescale.fsdp import fully_shard

    if isinstance(model, GPT):
        shard(model, **kw)
    else:
        fully_shard(model, **kw)


def _train(kind, policy_kw: dict, steps: int = 3, *, shard_kw: dict | None = None,
           per_rank: int = 2, opt_factory=None, ref_opt_factory=None, replicas: int = 1):
    """Train the engine and the reference on ranks; return (pieces, reference params, losses)."""
    from lightning_vescale import CommPolicy
    from tests.distributed._fully_shard_helpers import LocalOpt

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build(kind)
    ref = copy.deepcopy(model)
    policy = CommPolicy(**policy_kw)
    shard_kw = dict(shard_kw or {})
    prefetch = shard_kw.pop("prefetch", False)
    _shard(model, comm_policy=policy, **shard_kw)
    if prefetch:  # explicit prefetching: async quantized all-gathers, dequantized at wait
        a, b = model.blocks
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])
    opt = (opt_factory(model) if opt_factory is not None
           else LocalOpt(model.parameters(), torch.optim.SGD, **SGD))
    ref_opt = (ref_opt_factory(ref) if ref_opt_factory is not None
               else torch.optim.SGD(ref.parameters(), **SGD))
    q = policy.quantize
    quantized = ({n for n, v in q.items() if v} | default_quantized(ref, policy.min_numel)
                 if isinstance(q, dict) else default_quantized(ref, policy.min_numel))
    if isinstance(q, dict):
        quantized -= {n for n, v in q.items() if not v}
    losses = []
    for x, y in _data(kind, steps, per_rank * world):
        loss = model(micro(x, rank, world), micro(y, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = reference_step(ref, ref_opt, x, y, world=world, fmt=policy.all_gather,
                                  block=policy.block_size or 256, quantized=quantized,
                                  wire=policy.reduce_scatter_dtype, replicas=replicas)
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append((g.item() / world, ref_loss))
    return local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}, \
        losses


def _check(res, tol: float = 5e-5) -> None:
    assert_params_match_reference([r[:2] for r in res], rtol=tol, atol=tol)
    for got, want in res[0][2]:
        assert abs(got - want) <= tol * max(1.0, abs(want)), (got, want)


# -- parity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_int8_gpt_matches_fake_quant_reference(worlds, world):
    _check(worlds(world).run(_train, "gpt", dict(all_gather="int8")))


@pytest.mark.parametrize("policy", [dict(all_gather="fp8"), dict(reduce_scatter_dtype="bf16"),
                                    dict(all_gather="int8", reduce_scatter_dtype=torch.bfloat16,
                                         block_size=128)])
def test_fp8_and_wire_dtype_match_reference(worlds, policy):
    _check(worlds(2).run(_train, "gpt", policy))


def test_wire_dtype_at_one_rank(worlds):
    # one rank: AVG over one rank needs no collective (it raised "supports op 'sum' and 'avg'
    # only" before: the average was not turned into a sum there)
    _check(worlds(1).run(_train, "gpt", INT8_BF16))


def _unquantized_gap(kind, steps: int):
    """The int8 run's parameters against the unquantized reference's (the quantization
    error itself, which the engine must not exceed by much)."""
    pieces, _, _ = _train(kind, dict(all_gather="int8"), steps)
    _, plain, _ = _train(kind, dict(), steps)
    return pieces, plain


def test_int8_stays_within_quantization_error_of_unquantized(worlds):
    from tests.distributed._fully_shard_helpers import assemble

    res = worlds(2).run(_unquantized_gap, "gpt", 3)
    got = assemble([r[0] for r in res])
    for n, want in res[0][1].items():
        torch.testing.assert_close(got[n], want, rtol=0, atol=5e-3, msg=n)


# -- hard shapes: uneven rows, more ranks than blocks, empty ranks ------------------------------
HARD = [((96, 256), 5), ((18, 2304), 8), ((1, 256), 4)]
FORMS = [dict(all_gather="int8"), dict(all_gather="fp8"), dict(reduce_scatter_dtype="bf16")]


@pytest.mark.parametrize("shape,world", HARD, ids=["96x256@5", "18x2304@8", "1x256@4"])
@pytest.mark.parametrize("form", FORMS, ids=["int8", "fp8", "bf16-wire"])
def test_hard_shapes_never_hang(worlds, shape, world, form):
    policy = dict(form, quantize={"w": True}) if "all_gather" in form else form
    _check(worlds(world).run(_train, shape, policy, 2, timeout=120))


# -- what forward sees -----------------------------------------------------------------------------
def _forward_values(fmt: str):
    from lightning_vescale import CommPolicy

    model = _build("gpt")
    ref = copy.deepcopy(model)
    _shard(model, comm_policy=CommPolicy(all_gather=fmt))
    seen = {}

    def grab(mod, args):
        seen["qkv"] = mod.weight.detach().clone()

    model.blocks[0].attn.qkv.register_forward_pre_hook(grab)
    x, y = batches("gpt", 1, 2)[0]
    model(x, y)
    return seen["qkv"], ref.blocks[0].attn.qkv.weight.detach().clone()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_forward_sees_params_within_one_quantization_step(worlds, fmt):
    for seen, true in worlds(2).run(_forward_values, fmt):
        blocks = true.reshape(-1, 256)
        step = (blocks.abs().amax(dim=1, keepdim=True) / (127 if fmt == "int8" else 448))
        err = (seen.reshape(-1, 256) - blocks).abs()
        if fmt == "int8":
            assert bool((err <= 0.5 * step * (1 + 1e-5)).all())
        else:
            assert bool((err <= blocks.abs() * 2**-4 + step * 2**-9).all())
        assert float(err.max()) > 0  # it really was quantized
        torch.testing.assert_close(seen, fake_quant(true, fmt, 256), rtol=0, atol=0)


# -- bytes -----------------------------------------------------------------------------------------
@unfused()  # bytes by collective kind (design note [gloo-fused-exchange])
def _step_bytes(policy_kw: dict):
    from lightning_vescale import CommPolicy
    from lightning_vescale.sharding_summary import sharding_summary
    from lightning_vescale.testing import CopyCommCounter

    model = _build("gpt")
    _shard(model, comm_policy=CommPolicy(**policy_kw) if policy_kw else None)
    x, y = batches("gpt", 1, 4)[0]
    x, y = micro(x, dist.get_rank(), 2), micro(y, dist.get_rank(), 2)
    model(x, y).backward()  # warm-up (lazy init)
    with CopyCommCounter() as c:
        model(x, y).backward()
    by = c.comm_bytes_by_op
    gather = sum(v for k, v in by.items() if "allgather" in k)
    reduce = sum(v for k, v in by.items() if "alltoall" in k or "reduce_scatter" in k)
    with CopyCommCounter() as c, torch.no_grad():
        model(x, y)  # one all-gather of every group
    once = sum(v for k, v in c.comm_bytes_by_op.items() if "allgather" in k)
    summary = sharding_summary(model)
    predicted = (sum(g.gather_bytes for g in summary.groups),
                 sum(g.reduce_bytes for g in summary.groups))
    from lightning_vescale.fsdp import dbuffers, memory_bytes
    held = memory_bytes(model)["comm"]  # between steps: the persistent send buffers only
    sends = sum(b.quantized.send.numel() for b in dbuffers(model) if b.quantized is not None)
    assert held == sends and (sends > 0) == bool(policy_kw.get("all_gather"))
    return gather, reduce, once, predicted, str(summary)


def test_bytes_per_step_are_counted_and_cut(worlds):
    w = worlds(2)
    g32, r32, _, _, _ = w.run(_step_bytes, {})[0]
    g8, r8, once8, predicted8, table = w.run(_step_bytes, dict(all_gather="int8"))[0]
    gbf, rbf, _, predicted_bf, _ = w.run(_step_bytes, dict(reduce_scatter_dtype="bf16"))[0]
    assert g8 <= 0.30 * g32, (g8, g32)
    # the sharding summary's figures are the counted ones
    assert predicted8[0] == once8 and predicted_bf[1] == rbf
    assert "comm policy: all-gather int8 (block 256)" in table and "0.2" in table
    assert abs(r8 - r32) <= 0.01 * r32  # (padding differs: quantized tensors plan apart)
    assert rbf <= 0.55 * r32, (rbf, r32)
    assert gbf == g32


# -- everything that exists, with int8 + bf16 wire -------------------------------------------------
INT8_BF16 = dict(all_gather="int8", reduce_scatter_dtype="bf16")


def _offload():
    from lightning_vescale.fsdp import CPUOffloadPolicy
    return CPUOffloadPolicy(pin_memory=False)


@pytest.mark.parametrize("option", ["keep", "reshard", "offload", "prefetch"])
def test_with_reshard_forms_prefetch_and_offload(worlds, option):
    kw = {"keep": dict(reshard_after_forward=False), "reshard": dict(reshard_after_forward=True),
          "offload": dict(offload_policy=_offload()), "prefetch": dict(prefetch=True)}[option]
    _check(worlds(2).run(_train, "gpt", INT8_BF16, shard_kw=kw))


def _hsdp_train(policy_kw, replicas: int = 2):
    from lightning_vescale.mesh import init_mesh
    return _train("gpt", policy_kw, shard_kw=dict(mesh=init_mesh("cpu", replicas=replicas)),
                  replicas=replicas)


def test_hsdp_and_partial_reshard(worlds):
    w = worlds(4)
    # one shard group's pieces (the replicas hold the same)
    _check(w.run(_hsdp_train, dict(all_gather="int8"))[:2])
    # bf16 wire: the replica stage rounds each shard group's sum and the total to bf16 once
    # (fp32 sums in between); the reference does the same
    _check(w.run(_hsdp_train, INT8_BF16)[:2])
    # 4 replicas of one rank: the four bf16 gradient shards are added in fp32, not in bf16
    _check(w.run(_hsdp_train, INT8_BF16, 4)[:1])
    _check(w.run(_train, "gpt", INT8_BF16, shard_kw=dict(reshard_after_forward=2)))


def _optimizer_gap(name: str):
    from lightning_vescale.optim import AdamW8bit, Muon

    def factory(model):
        if name == "adamw8bit":
            return AdamW8bit(model.parameters(), lr=1e-2)
        return Muon(list(model.named_parameters()), lr=1e-2, adamw_lr=1e-2)

    pieces, _, losses = _train("gpt", INT8_BF16, opt_factory=factory)
    plain, _, plain_losses = _train("gpt", {}, opt_factory=factory)
    return pieces, plain, [q for q, _ in losses], [p for p, _ in plain_losses]


@pytest.mark.parametrize("name", ["adamw8bit", "muon"])
def test_with_block_wise_and_matrix_optimizers(worlds, name):
    """Against the same optimizer unquantized: Adam-type and Muon updates flip on near-zero
    gradients, so single elements move by up to ~2 lr; the mean stays at quantization level."""
    from tests.distributed._fully_shard_helpers import assemble

    res = worlds(2).run(_optimizer_gap, name)
    got, plain = assemble([r[0] for r in res]), assemble([r[1] for r in res])
    for n in plain:
        assert bool(torch.isfinite(got[n]).all()), n
        assert float((got[n] - plain[n]).abs().mean()) <= 3e-3, n
    for q, p in zip(res[0][2], res[0][3]):
        assert abs(q - p) <= 0.02 * abs(p), (q, p)


def _flat_train():
    from lightning_vescale.optim import FlatParamOptimizer

    return _train("gpt", INT8_BF16,
                  opt_factory=lambda m: FlatParamOptimizer(torch.optim.AdamW(m.parameters(),
                                                                             lr=1e-2)),
                  ref_opt_factory=lambda r: torch.optim.AdamW(r.parameters(), lr=1e-2))


def test_with_flat_param_optimizer(worlds):
    # AdamW: elements with near-zero gradients differ by up to ~1e-4 (shared/TESTING.md)
    _check(worlds(2).run(_flat_train), tol=2e-4)


def _mixed_precision():
    from lightning_vescale.fsdp import MixedPrecisionPolicy
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    pieces, _, losses = _train("gpt", INT8_BF16, shard_kw=dict(mp_policy=mp))
    plain, _, plain_losses = _train("gpt", {}, shard_kw=dict(mp_policy=mp))
    return pieces, plain, losses, plain_losses


def test_with_mixed_precision(worlds):
    from tests.distributed._fully_shard_helpers import assemble

    res = worlds(2).run(_mixed_precision)
    got, plain = assemble([r[0] for r in res]), assemble([r[1] for r in res])
    for n in plain:
        torch.testing.assert_close(got[n], plain[n], rtol=0, atol=5e-3, msg=n)
    for (q, _), (p, _) in zip(res[0][2], res[0][3]):
        assert abs(q - p) <= 0.01 * abs(p)


# -- checkpoints hold the full-precision shards ----------------------------------------------------
def _state_dict_is_master():
    from lightning_vescale import CommPolicy

    model = _build("gpt")
    _shard(model, comm_policy=CommPolicy(all_gather="int8"))
    x, y = batches("gpt", 1, 4)[0]
    model(x, y).backward()
    sd = model.state_dict()
    out = {}
    for n, p in model.named_parameters():
        full = sd[n].full_tensor()
        out[n] = (torch.equal(full, p.full_tensor()),
                  torch.equal(full, fake_quant(full, "int8", 256)))
    plain = _build("gpt", seed=1)
    _shard(plain)
    plain.load_state_dict(sd)
    same = all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(plain.parameters(), model.parameters()))
    return out, same


def test_state_dict_holds_full_precision(worlds):
    out, same = worlds(2).run(_state_dict_is_master)[0]
    assert all(master for master, _ in out.values())
    assert not out["blocks.0.attn.qkv.weight"][1]  # not the quantized values
    assert same


# -- errors before training ------------------------------------------------------------------------
def _errors():
    from lightning_vescale import CommPolicy, fully_shard

    msgs = []
    m = Rows(96, 96)
    try:  # a user granularity (one row, 96) that the block (256) does not divide
        fully_shard(m, granularity="row", comm_policy=CommPolicy(all_gather="int8"))
    except ValueError as e:
        msgs.append(str(e))
    m = Rows(4, 64)
    m.idx = nn.Parameter(torch.arange(4096).view(64, 64), requires_grad=False)
    try:
        fully_shard(m, comm_policy={"all_gather": "int8", "quantize": {"idx": True}})
    except ValueError as e:
        msgs.append(str(e))
    m = Rows(4, 64)
    m.idx = nn.Parameter(torch.arange(4096).view(64, 64), requires_grad=False)
    fully_shard(m, comm_policy={"all_gather": "int8"})  # integer params are left alone
    return msgs


def test_bad_input_fails_at_fully_shard(worlds):
    msgs = worlds(2).run(_errors)[0]
    assert len(msgs) == 2
    assert "block_size=256" in msgs[0] and "'w'" in msgs[0] and "768" in msgs[0]
    assert "'idx'" in msgs[1] and "torch.int64" in msgs[1]


# -- torch.compile'd blocks: the engine's hooks (and the codec) stay eager -------------------------
def _compiled_vs_eager():
    from lightning_vescale import CommPolicy, fully_shard

    out = []
    for compiled in (False, True):
        model = _build("gpt")
        for block in model.blocks:
            fully_shard(block, comm_policy=CommPolicy(**INT8_BF16))
            if compiled:
                block.compile()
        fully_shard(model, comm_policy=CommPolicy(**INT8_BF16))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for x, y in batches("gpt", 3, 4):
            loss = model(micro(x, dist.get_rank(), 2), micro(y, dist.get_rank(), 2))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out.append(losses)
    return out


@pytest.mark.slow
def test_compiled_blocks_match_eager(worlds):
    for eager, compiled in worlds(2).run(_compiled_vs_eager, timeout=600):
        assert eager == pytest.approx(compiled, rel=1e-5)


# -- meta-device init and unsynced micro-batches ---------------------------------------------------
def _meta_init():
    from lightning_vescale import CommPolicy
    from lightning_vescale.fsdp import materialize

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(GPTConfig(**GPT_CFG))
    _shard(model, comm_policy=CommPolicy(all_gather="int8"))
    materialize(model, torch.device("cpu"))  # reset_parameters(), each rank keeps its ranges
    true = model.blocks[0].attn.qkv.weight.full_tensor()
    x, y = batches("gpt", 1, 4)[0]
    seen = {}
    model.blocks[0].attn.qkv.register_forward_pre_hook(
        lambda mod, args: seen.update(w=mod.weight.detach().clone()))  # returns None
    model(micro(x, dist.get_rank(), 2), micro(y, dist.get_rank(), 2)).backward()
    return seen["w"], fake_quant(true, "int8", 256)


def test_meta_init_then_materialize(worlds):
    for seen, want in worlds(2).run(_meta_init):
        torch.testing.assert_close(seen, want, rtol=0, atol=0)


def _unsynced(mp: bool):
    """Two micro-batches, the first without gradient sync, then one synced step: the wire cast
    happens once, on the fp32 sum of both (reduce_dtype accumulation under mixed precision)."""
    from lightning_vescale import CommPolicy
    from lightning_vescale.fsdp import MixedPrecisionPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build("gpt")
    ref = copy.deepcopy(model)
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                             reduce_dtype=torch.float32)) if mp else {}
    _shard(model, comm_policy=CommPolicy(reduce_scatter_dtype="bf16"), **kw)
    (x1, y1), (x2, y2) = batches("gpt", 2, 2 * world)
    model.set_requires_gradient_sync(False)
    model(micro(x1, rank, world), micro(y1, rank, world)).backward()
    model.set_requires_gradient_sync(True)
    model(micro(x2, rank, world), micro(y2, rank, world)).backward()
    got = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    want = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world):  # each rank: fp32 sum of its two micro-batches, one bf16 rounding
        ref.zero_grad()
        ref(micro(x1, r, world), micro(y1, r, world)).backward()
        ref(micro(x2, r, world), micro(y2, r, world)).backward()
        for n, p in ref.named_parameters():
            want[n] += p.grad.to(torch.bfloat16).float() / world
    return got, want


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16-mixed"])
def test_unsynced_micro_batches_cast_once(worlds, mp):
    got, want = worlds(2).run(_unsynced, mp)[0]
    for n in want:
        if mp:  # the reference computes in fp32: bf16 compute noise, 0.2-1.3 % of the largest
            assert float((got[n] - want[n]).abs().max()) <= 5e-2 * float(want[n].abs().max())
        else:  # summation order only (0.0 here)
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)


def _kept_grads():
    """Two synced backwards without zero_grad: the second reduce-scatter adds onto the kept
    sharded gradients (the accumulate path) through the wire dtype's fp32 output."""
    from lightning_vescale import CommPolicy

    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batches("gpt", 1, 2 * world)[0]
    x, y = micro(x, rank, world), micro(y, rank, world)
    grads = []
    for times in (1, 2):
        model = _build("gpt")
        _shard(model, comm_policy=CommPolicy(**INT8_BF16))
        for _ in range(times):
            model(x, y).backward()
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    return grads


def test_kept_gradients_accumulate_through_the_wire(worlds):
    once, twice = worlds(2).run(_kept_grads)[0]
    for n in once:
        torch.testing.assert_close(twice[n], 2 * once[n], rtol=0, atol=0, msg=n)
