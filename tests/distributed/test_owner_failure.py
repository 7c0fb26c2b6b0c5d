"""A rank whose owner-side work raises does not leave its peers hanging (design note
[owner-failure] in ``lightning_vescale/optim/_owner_failure.py``).

SOAP/Shampoo (split matrices stepped on their owner ranks) and Muon (Newton–Schulz on the
owner) run a collective after the owner's computation. Here that computation raises on some
ranks only (``eigh`` / Newton–Schulz patched on those ranks): every rank must raise the same
``RuntimeError`` naming the failing rank(s), the parameter and the original error, and the
process group must still work afterwards. Each world gets a 30 s gloo timeout: a peer left
blocked in the return all-to-all comes back with gloo's timeout text, not the named error, so
a regression fails (slowly) instead of hanging, and no duration is asserted.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import lightning_vescale.optim._muon_dist as muon_dist
import lightning_vescale.optim.shampoo as shampoo_mod
import lightning_vescale.optim.soap as soap_mod
from lightning_vescale.optim import SOAP, Muon, Shampoo
from lightning_vescale.placement import RaggedShard, ragged_from_local
from tests.harness import World

PG_TIMEOUT_S = 30.0
# (5, 6, 4): five 6x4 matrices; even element cuts at 2-3 ranks split some of them, and every
# rank owns at least one (so the patched function runs on the failing ranks).
SHAPE = (5, 6, 4)


def _raise_linalg(*args, **kwargs):
    raise torch.linalg.LinAlgError("injected eigh failure")


def _raise_ns(*args, **kwargs):
    raise RuntimeError("injected Newton-Schulz failure")


def _param(shape, mesh):
    """The same full tensor on every rank, cut into even element ranges (matrices split)."""
    world, rank = mesh.size(), mesh.get_local_rank()
    numel = torch.Size(shape).numel()
    bounds = [numel * r // world for r in range(world + 1)]
    placement = RaggedShard(tuple(range(len(shape))),
                            [b - a for a, b in zip(bounds, bounds[1:])])
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    local = full.reshape(-1)[bounds[rank]:bounds[rank + 1]].clone()
    return torch.nn.Parameter(ragged_from_local(local, mesh, placement, shape)), bounds


def _set_grad(p, bounds, step, mesh):
    rank = mesh.get_local_rank()
    g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 + step))
    p.grad = ragged_from_local(g.reshape(-1)[bounds[rank]:bounds[rank + 1]].clone(), mesh,
                               p.placements, p.shape)


def _failing_step_body(kind, function, failing, fail_at_step):
    """Step until ``fail_at_step``, where ``function`` of ``kind``'s module raises on the
    ``failing`` ranks; return (error type, message, type of its cause, step) and the value of an
    all-reduce run afterwards."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    p, bounds = _param(SHAPE, mesh)
    if kind == "soap":
        opt, target = SOAP([p], precondition_frequency=2), (soap_mod, function, _raise_linalg)
    elif kind == "shampoo":
        opt = Shampoo([p], precondition_frequency=2, start_preconditioning_step=2)
        target = (shampoo_mod, function, _raise_linalg)
    else:
        opt = Muon([("blocks.0.experts", p)])
        target = (muon_dist, function, _raise_ns)
    outcome = None
    for step in range(fail_at_step + 1):
        _set_grad(p, bounds, step, mesh)
        patch = mock.patch.object(*target) if step == fail_at_step and \
            dist.get_rank() in failing else contextlib.nullcontext()
        try:
            with patch:
                opt.step()
        except Exception as err:  # noqa: BLE001 - what each rank raised is the result
            cause = type(err.__cause__).__name__ if err.__cause__ is not None else None
            outcome = (type(err).__name__, str(err), cause, step)
            break
    after = torch.ones(1)
    dist.all_reduce(after)  # every rank left the step at the same point: the group still works
    return outcome, float(after)


# SOAP: eigh at its initialising step 0 (no update goes back), the QR refresh at step 2;
# Shampoo: the inverse roots at step 1 (its first preconditioned step); Muon: Newton-Schulz.
CASES = [("soap", "eigenbasis", 0), ("soap", "refresh_eigenbasis_qr", 2),
         ("shampoo", "inverse_root", 1), ("muon", "newton_schulz", 0),
         ("muon", "newton_schulz", 1)]


@pytest.mark.parametrize("kind, function, fail_at_step", CASES)
@pytest.mark.parametrize("world, failing", [(2, (1,)), (3, (0, 2))])
def test_one_rank_failure_raises_everywhere(kind, function, fail_at_step, world, failing):
    with World(world, pg_timeout_s=PG_TIMEOUT_S, run_timeout_s=3 * PG_TIMEOUT_S) as w:
        outs = w.run(_failing_step_body, kind, function, failing, fail_at_step)
    assert all(outcome is not None for outcome, _ in outs), outs  # no rank stepped on alone
    messages = {msg for (_, msg, _, _), _ in outs}
    assert len(messages) == 1, messages  # the same error text on every rank
    for rank, ((etype, msg, cause, step), after) in enumerate(outs):
        assert etype == "RuntimeError", (rank, etype, msg)
        assert step == fail_at_step, (rank, step)
        for r in failing:
            assert f"rank {r} " in msg, (rank, msg)
        assert "injected" in msg and ("blocks.0.experts" if kind == "muon" else "#0 of group 0") \
            in msg, msg
        if rank in failing:  # the original error is chained where it was raised
            assert cause == ("RuntimeError" if kind == "muon" else "_LinAlgError"), (rank, cause)
        assert after == float(world)


# -- the same rule elsewhere: save_safetensors' gathers of non-RaggedShard DTensors ----------------
def _save_with_failing_write_body(path, failing):
    """Two ``Shard(0)`` DTensors (each gathered with ``full_tensor()``, then written by rank 0):
    rank 0's first write raises; returns (error type, message) per rank and an all-reduce."""
    from torch.distributed.tensor import Shard, distribute_tensor

    import lightning_vescale.checkpoint._hf_save as hf_save
    from lightning_vescale.checkpoint import save_safetensors

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sd = {f"w{i}": distribute_tensor(torch.full((4, 3), float(i)), mesh, [Shard(0)])
          for i in range(2)}

    def fail(*args, **kwargs):
        raise OSError(5, "injected: input/output error")  # ENOSPC: test_checkpoint_disk_full

    patch = mock.patch.object(hf_save, "_pwrite", fail) if dist.get_rank() in failing else \
        contextlib.nullcontext()
    outcome = None
    try:
        with patch:
            save_safetensors(sd, path)
    except Exception as err:  # noqa: BLE001
        outcome = (type(err).__name__, str(err))
    after = torch.ones(1)
    dist.all_reduce(after)
    return outcome, float(after)


def test_save_safetensors_write_failure_on_one_rank_raises_everywhere(tmp_path):
    with World(2, pg_timeout_s=PG_TIMEOUT_S, run_timeout_s=3 * PG_TIMEOUT_S) as w:
        outs = w.run(_save_with_failing_write_body, str(tmp_path / "hf"), (0,))
    (e0, m0), _ = outs[0]
    (e1, m1), _ = outs[1]
    assert e0 == "OSError" and "injected" in m0, outs
    assert e1 == "RuntimeError" and "failed on rank(s) [0]" in m1, outs
    assert [after for _, after in outs] == [2.0, 2.0]
    assert not any(p.name.startswith(".") for p in (tmp_path / "hf").iterdir())  # temps removed


# -- and a check that must give the same answer on every rank before a gather ----------------------
def _load_outcome(opt, sd) -> tuple[str | None, float]:
    """``opt.load_state_dict(sd)``'s ValueError text (None if it loaded), then an all-reduce
    that only completes if every rank got this far (a rank left in a gather would hang it)."""
    outcome = None
    try:
        opt.load_state_dict(sd)
    except ValueError as err:
        outcome = str(err)
    after = torch.ones(1)
    dist.all_reduce(after)
    return outcome, float(after)


def _load_factor_of_another_model_body():
    """SOAP's split (5, 6, 4) parameter at 2 ranks: owners hold 2 and 3 matrices. A saved
    ``GG0`` DTensor of 2 matrices (another model) must be refused on both ranks, before the
    gathers of the next states (rank 0 alone used to take it as its own slice)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    p, bounds = _param(SHAPE, mesh)
    opt = SOAP([p])
    _set_grad(p, bounds, 0, mesh)
    opt.step()
    sd = opt.state_dict()
    wrong = ragged_from_local(torch.zeros(36), mesh, [RaggedShard((0,), [1, 1])], (2, 6, 6))
    sd["state"][0]["GG0"] = wrong
    return _load_outcome(SOAP([p]), sd)


def _adamw8bit_load_wrong_size_body():
    """A (12,) parameter cut 4 + 8: a saved ``exp_avg`` DTensor of 4 elements matches rank 0's
    part only; both ranks must refuse it before any gather."""
    from lightning_vescale.optim import AdamW8bit

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placement = RaggedShard((0,), [4, 8])
    a, b = placement.local_range((12,), dist.get_rank())
    p = torch.nn.Parameter(ragged_from_local(torch.arange(12.0)[a:b].clone(), mesh, placement,
                                             (12,)))
    opt = AdamW8bit([p])
    p.grad = ragged_from_local(torch.ones(b - a), mesh, placement, (12,))
    opt.step()
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = ragged_from_local(torch.zeros(2), mesh,
                                                  [RaggedShard((0,), [1, 1])], (4,))
    return _load_outcome(AdamW8bit([p]), sd)


def _shampoo_load_other_tiles_body():
    """Shampoo's (2, 6, 5) stack, both experts on rank 0 (rank 1 owns no matrix), saved with
    tiles of at most 4, its groups edited to 5: the factors do not fit the tiles, and both ranks
    must refuse them (rank 1, holding 0 elements of every factor, used to accept and go on
    alone)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    placement = RaggedShard((0,), [1, 0])
    full = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(0))
    local = full.reshape(-1) if dist.get_rank() == 0 else full.reshape(-1)[:0]
    p = torch.nn.Parameter(ragged_from_local(local.clone(), mesh, [placement], (2, 6, 5)))
    opt = Shampoo([p], max_preconditioner_dim=4, precondition_frequency=1)
    for _ in range(2):
        p.grad = ragged_from_local(torch.ones_like(local), mesh, [placement], (2, 6, 5))
        opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["max_preconditioner_dim"] = 5  # the group's value is restored
    return _load_outcome(Shampoo([p], max_preconditioner_dim=5), sd)


@pytest.mark.parametrize("body,words", [
    (_load_factor_of_another_model_body, ("'GG0'", "holds 2 matrices, expected 5")),
    (_adamw8bit_load_wrong_size_body, ("'exp_avg'", "has 4 elements")),
    (_shampoo_load_other_tiles_body, ("another max_preconditioner_dim",)),
], ids=["soap-factor-count", "adamw8bit-state-size", "shampoo-tiles"])
def test_a_state_one_rank_could_accept_is_refused_on_every_rank(body, words):
    with World(2, pg_timeout_s=PG_TIMEOUT_S, run_timeout_s=3 * PG_TIMEOUT_S) as w:
        outs = w.run(body)
    for msg, after in outs:
        assert msg is not None and all(word in msg for word in words), outs
        assert after == 2.0
