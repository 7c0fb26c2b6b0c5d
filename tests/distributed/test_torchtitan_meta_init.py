"""torchtitan 0.3.0's real trainer flow on the engine: meta device -> ``apply_fsdp_to_decoder``
(with ``lightning_vescale.fully_shard``) -> ``to_empty()`` -> ``init_weights()`` (issue 33).

torchtitan's own Llama3 ``debugmodel`` and its own FSDP function run unchanged; only the
``fully_shard`` it calls is ours (``tests/distributed/_torchtitan_helpers.py``). Its init draws
``trunc_normal_``/``normal_`` on the sharded parameters and builds the fused ``wqkv`` from
``t.new_empty(...)`` Replicate DTensors copied into the shard (``_fused_qkv_param_init``).

References, all with the same seed and on each rank: the same model built, ``to_empty``'d and
initialised without sharding (one process), and torch's FSDP2 in the same flow on a 1-rank mesh
(world 1, where its ``Shard(0)`` draws are the full tensor's). Ours at world 2 must equal both
**bitwise**, parameter by parameter, and leave the default generator where one process leaves
it. (Measured, torch 2.13 on CPU: FSDP2 at world 2 in this flow differs from one process in
all 32 randomly initialised parameters, because CPU has no DTensor RNG tracker and each
``Shard(0)`` shard draws its own numel from the start of the stream; design note
[ragged-random] in ``lightning_vescale/placement/_random_ops.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, init_device_mesh

pytest.importorskip("torchtitan")
pytestmark = pytest.mark.slow  # torchtitan.models.llama3 imports for ~8 s in each rank

SEED = 7


def _run(engine: str | None, mesh, unsharded: bool = False):
    from tests.distributed._torchtitan_helpers import llama3_debugmodel, meta_init_flow

    model = meta_init_flow(llama3_debugmodel, engine, mesh, seed=SEED,
                           device=torch.device("cpu"))
    after = torch.rand(4)  # where init left the default generator
    params = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
              for n, p in model.named_parameters()}
    forward_params = None
    if unsharded:  # what the forward reads: every group gathered (FSDPModule.unshard)
        groups = [m for m in model.modules() if callable(getattr(m, "unshard", None))]
        for m in groups:
            m.unshard()
        forward_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        for m in groups:
            m.reshard()
    return params, after, forward_params


def _flows():
    """On each rank of 2: one process (no sharding), FSDP2 on a 1-rank mesh of its own (world
    1: its shards are the whole tensors), ours on both ranks; torchtitan imported once."""
    rank, world = dist.get_rank(), dist.get_world_size()
    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    return {
        "one_process": _run(None, None),
        "fsdp2_world1": _run("fsdp2", DeviceMesh.from_group(own, "cpu")),
        "ours": _run("vescale", init_device_mesh("cpu", (world,)), unsharded=True),
    }


@pytest.fixture(scope="module")
def titan_runs(worlds):
    """The three runs of torchtitan's flow on each rank of a world of 2."""
    return worlds(2).run(_flows)


def _assert_same(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), (what, sorted(set(got) ^ set(ref)))
    bad = [n for n in ref if got[n].dtype != ref[n].dtype or not torch.equal(got[n], ref[n])]
    assert not bad, f"{what}: {len(bad)} of {len(ref)} parameters differ: {bad}"


def test_llama3_meta_init_matches_one_process(titan_runs):
    for rank, runs in enumerate(titan_runs):
        ref, ref_after, _ = runs["one_process"]
        assert len(ref) == 45 and sum(t.numel() for t in ref.values()) == 6_163_712
        fsdp2, fsdp2_after, _ = runs["fsdp2_world1"]
        _assert_same(fsdp2, ref, "FSDP2 at world 1")  # the reference sides agree
        assert torch.equal(fsdp2_after, ref_after)
        params, after, _ = runs["ours"]
        _assert_same(params, ref, f"ours, rank {rank} of 2")
        assert torch.equal(after, ref_after), "the generator must end where one process's does"


def test_llama3_meta_init_reaches_what_forward_reads(titan_runs):
    for rank, runs in enumerate(titan_runs):
        _assert_same(runs["ours"][2], runs["one_process"][0], f"ours unsharded, rank {rank} of 2")
