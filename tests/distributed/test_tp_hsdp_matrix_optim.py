"""Muon, SOAP and Shampoo on HSDP + TP (design note [tp-matrix-optim]): world 8 as a
(dp_replicate 2, dp_shard 2, tp 2) mesh, test_tp_hsdp.py's model and plan.

Parameters are ``(Replicate(), RaggedShard, Shard(k))`` (attention and MLP matrices),
``(Replicate(), RaggedShard, Replicate())`` (the row-parallel bias) on the 3-D mesh and plain
HSDP ``(Replicate(), RaggedShard)`` (embedding, norms, output). Each replica runs the 2-D
scheme over its own (dp_shard, tp) ranks, the replicas computing the same update, so:

* *exact*: one process fed the sharded model's own gradients (``full_tensor``) must equal it
  bitwise after every step, as at (dp 2, tp 2) in test_tp_matrix_optim.py (same ops on the same
  whole matrices on the owner);
* Muon's bytes are a 2-D (dp_shard, tp) exchange's (a TP matrix's plan spans the 4 ranks of
  one replica, a plain HSDP one's the 2 of its dp_shard group: nothing crosses replicas);
* owned states (SOAP/Shampoo factors, moments of split matrices) are ``Replicate()`` on
  dp_replicate, the others in the parameter's placements;
* ``save_sharded`` after 2 steps -> a fresh model and optimizer at (2, 2, 2): step 3 bitwise
  the uninterrupted run's; the full state to one process: its step 3 bitwise one process's.

Also torchtitan's sequence-parallel plan on the strategies' dim names (with their flattened
``data_parallel`` dim) and a matrix ``Replicate()`` on tp that dp_shard splits: its owner
exchange runs on the replica's dp_shard ranks and its owned states are ``(Replicate(),
RaggedShard, Replicate())`` on the 3-D mesh.

World 8 on 2 cores (fork): ~4-6 s per optimizer (measured 2026-11), so no slow mark;
``(2, 1, 2)`` (a dp_shard of 1) runs at world 4 beside it.
"""

from __future__ import annotations

import copy

import pytest
import torch

# imported before the ranks fork (they inherit them): see test_tp_hsdp.py
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
from torch.distributed.tensor import DTensor, Replicate

import lightning_vescale.checkpoint  # noqa: F401
import lightning_vescale.fsdp  # noqa: F401
import lightning_vescale.optim  # noqa: F401
from tests.distributed.test_tp_fsdp import _build, _full_params
from tests.distributed.test_tp_hsdp import _mesh3, _ours
from tests.distributed.test_tp_matrix_optim import (
    _exact_steps,
    _muon_bytes_per_step,
    _optimizer,
    _step,
)

SHAPE = (2, 2, 2)
STEPS = 3


def _placements(state: dict) -> list[tuple]:
    """The mesh dims and placements of every DTensor of a sharded optimizer state."""
    return [(v.device_mesh.mesh_dim_names, tuple(v.placements))
            for per in state["state"].values() for v in per.values() if isinstance(v, DTensor)]


def _case(name: str, path: str, shape: tuple[int, int, int] = SHAPE) -> dict:
    import torch.distributed as dist

    from lightning_vescale import checkpoint as ckpt

    mesh = _mesh3(shape)
    model = _ours(_build(), mesh)
    opt = _optimizer(name, model.named_parameters())
    ref = _build()
    ref_opt = _optimizer(name, ref.named_parameters())
    out: dict = {"exact": _exact_steps(model, opt, ref, ref_opt, range(2))}
    state = ckpt.optimizer_state(model, opt, full=False)
    out["placements"] = _placements(state)
    ckpt.save_sharded(path, {"state_dict": ckpt.model_state(model, full=False),
                             "optimizer_0": state}, {})
    full_state = copy.deepcopy(ckpt.optimizer_state(model, opt, full=True))  # rank 0's
    want_one = None
    if dist.get_rank() == 0:  # one process at step 2 with the full state, its own gradients
        one = _build()
        one.load_state_dict(ref.state_dict())
        one_opt = _optimizer(name, one.named_parameters())
        one_opt.load_state_dict(full_state)
        plain = copy.deepcopy(ref)
        plain_opt = _optimizer(name, plain.named_parameters())
        plain_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        _step(one, one_opt, 2)
        _step(plain, plain_opt, 2)
        want_one = _full_params(plain)
        out["to_one_process"] = max((p - want_one[n]).abs().max().item()
                                    for n, p in _full_params(one).items())
    out["exact"] += _exact_steps(model, opt, ref, ref_opt, [2])
    if name == "muon":
        out["comm_bytes"] = opt.comm_bytes
        out["expected_bytes"] = STEPS * _muon_bytes_per_step(opt)
        out["plan_worlds"] = sorted({plan.world_size for plan in opt._plans.values()})
    want = _full_params(model)
    fresh = _ours(_build(), mesh)
    fresh_opt = _optimizer(name, fresh.named_parameters())
    ckpt.load_sharded(path, fresh, {"optimizer_0": fresh_opt})
    # step 3 on the resumed run's own gradients: bitwise the uninterrupted run's (same
    # parameters, same batch, every rank the full batch)
    _step(fresh, fresh_opt, 2)
    got = _full_params(fresh)
    out["resumed"] = max((got[n] - want[n]).abs().max().item() for n in want)
    return out


def _check(results: list[dict], name: str, plan_worlds: list[int]) -> None:
    for r in results:
        assert r["exact"] == [0.0] * STEPS, r["exact"]
        assert r["resumed"] == 0.0, r
        assert r["placements"], r
        for names, pl in r["placements"]:  # the replicas hold the same states
            assert names[0] == "dp_replicate" and pl[0] == Replicate(), r["placements"]
        if name == "muon":  # exchanges stay inside one replica: its dp_shard x tp ranks (TP
            # matrices), its dp_shard ranks (the plain HSDP embedding and output)
            assert r["plan_worlds"] == plan_worlds, r
            assert r["comm_bytes"] == r["expected_bytes"] > 0, r
    assert results[0]["to_one_process"] == 0.0, results[0]
    if name != "muon":  # owned states (factors) on the (dp_replicate, dp_shard x tp) mesh
        owned = ("dp_replicate", "dp_shard_tp")
        assert any(names == owned for names, _ in results[0]["placements"]), results[0]


@pytest.mark.parametrize("name", ["muon", "soap", "shampoo"])
def test_tp_hsdp_matrix_optimizer_equals_one_process_and_resumes(worlds, tmp_path, name):
    """(2, 2, 2) at world 8. Measured: 0.0 (bitwise) after every step and every way, for all
    three; ~4-6 s each."""
    _check(worlds(8).run(_case, name, str(tmp_path / "ckpt")), name, [2, 4])


def test_tp_hsdp_single_shard_matrix_optimizer(worlds, tmp_path):
    """(2, 1, 2) at world 4: a dp_shard of 1, so the TP matrices are split over tp alone (an
    exchange of 2 ranks per replica) and the plain HSDP ones are whole (no exchange).
    Measured: 0.0 (bitwise)."""
    _check(worlds(4).run(_case, "muon", str(tmp_path / "ckpt"), (2, 1, 2)), "muon", [2])


def _sp_case(name: str, path: str) -> dict:
    """SOAP on torchtitan's plan at (2, 2, 2), named as the strategies name the mesh, plus a
    (256, 96) matrix ``Replicate()`` on tp (split over dp_shard, fed by a forward hook): 2
    steps, ``save_sharded``, a fresh optimizer ``load_sharded``, a third step; bitwise one
    process fed the same gradients throughout."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_vescale import checkpoint as ckpt
    from lightning_vescale.fsdp import fully_shard
    from tests.distributed.test_tp_fsdp import _sp_plan

    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp_replicate", "dp_shard",
                                                          "tensor_parallel"))
    dp = mesh["dp_replicate", "dp_shard"]
    dp._flatten("data_parallel")  # as the strategies do
    tp = mesh["tensor_parallel"]
    model, ref = _build(), _build()
    extra = torch.randn(256, 96, generator=torch.Generator().manual_seed(2))
    ref.extra = nn.Parameter(extra.clone())
    model.extra = nn.Parameter(distribute_tensor(extra, tp, [Replicate()]))

    def hook(module, args, out):
        e = module.extra
        return out + (e.to_local() if isinstance(e, DTensor) else e).pow(2).sum() * 1e-3

    block_plan, root_plan = _sp_plan()
    for b in model.blocks:
        parallelize_module(b, tp, block_plan)
        fully_shard(b, mesh=dp)
    parallelize_module(model, tp, root_plan)
    fully_shard(model, mesh=dp)
    for m in (model, ref):
        m.register_forward_hook(hook)
    opt = _optimizer(name, model.named_parameters())
    ref_opt = _optimizer(name, ref.named_parameters())
    exact = _exact_steps(model, opt, ref, ref_opt, range(2))
    state = ckpt.optimizer_state(model, opt, full=False)
    ckpt.save_sharded(path, {"optimizer_0": state}, {})
    fresh_opt = _optimizer(name, model.named_parameters())
    ckpt.load_sharded(path, model, {"optimizer_0": fresh_opt}, strict=False)
    exact += _exact_steps(model, fresh_opt, ref, ref_opt, [2])
    return {"exact": exact, "extra": tuple(model.extra.placements),
            "extra_state": {k: tuple(v.placements) for k, v in state["state"]["extra"].items()
                            if isinstance(v, DTensor)}}


def test_tp_hsdp_matrix_optimizer_sequence_parallel_plan(worlds, tmp_path):
    """Measured: 0.0 (bitwise) after every step, across the checkpoint."""
    from lightning_vescale.placement import RaggedShard

    for r in worlds(8).run(_sp_case, "soap", str(tmp_path / "ckpt")):
        assert r["exact"] == [0.0] * STEPS, r
        ragged = r["extra"][1]
        assert isinstance(ragged, RaggedShard) and all(ragged.local_units), r  # split
        assert r["extra_state"]["GG0"][0] == Replicate(), r  # owned: on the 3-D mesh
        assert r["extra_state"]["GG0"][2] == Replicate(), r
