"""The CPU-offload collective rows of ``python -m benchmarks.gpu_check`` (issue 28).

With CPU offload the shards, gradients and optimizer states live on the CPU while the mesh is a
CUDA one, and plain NCCL refuses CPU tensors: every collective that can meet them goes through
``lightning_vescale.mesh``'s ``*_anywhere`` helpers (design note [mesh-device]). The CPU test
(``tests/unit/test_offload_collectives.py``) emulates NCCL with fake tensors; these rows run the
real thing and check values:

1. **the helpers on NCCL**: all-to-all (synchronous and asynchronous), broadcast,
   reduce-scatter and all-reduce of CPU tensors, and ``full_tensor()`` / ``redistribute`` of an
   offloaded ``RaggedShard`` DTensor, against the values they must give. Also whether the
   backend itself refuses a CPU tensor (plain NCCL: it should; ``cpu:gloo,cuda:nccl`` and gloo
   take it, and the helpers then pass the caller's tensors through, copy-free). Runs a real
   collective at any world size, world 1 included.
2. **Muon / SOAP / AdamW8bit with offload**: the small GPT trained with ``CPUOffloadPolicy``
   against the same run without offload (the optimizer steps on the CPU vs on the GPU: rounding
   differences only), and every optimizer state still on the CPU afterwards (before: states
   were moved to the GPU and the next step mixed devices). Muon's and SOAP's owner all-to-alls
   only run with 2+ GPUs (at world 1 each rank holds every matrix whole).
3. **optimizer-state reshard + load with offload** (2+ GPUs): each optimizer's state dict moved
   to another ``RaggedShard`` layout (an all-to-all of CPU tensors) and loaded into a fresh
   optimizer (a gather of CPU tensors) must give back the same states, bitwise, on the CPU.

Device-agnostic, so ``tests/unit/test_gpu_check.py`` runs them on CPU/gloo too.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


def _g() -> Any:
    from benchmarks import gpu_check  # imported here: gpu_check imports this module

    return gpu_check


def _helpers(mesh, rank: int, world: int) -> dict[str, bool]:
    """Each helper on CPU tensors against its expected values (every rank, same order)."""
    from lightning_vescale import mesh as m

    group = mesh.get_group(0)
    ok: dict[str, bool] = {}
    send = torch.tensor([float(rank * 100 + d) for d in range(world) for _ in range(2)])
    want = torch.tensor([float(s * 100 + rank) for s in range(world) for _ in range(2)])
    out = torch.empty(2 * world)
    m.all_to_all_single_anywhere(out, send, [2] * world, [2] * world, group=group, mesh=mesh)
    ok["all-to-all"] = torch.equal(out, want)
    out = torch.empty(2 * world)
    m.all_to_all_single_anywhere(out, send, [2] * world, [2] * world, group=group, mesh=mesh,
                                 async_op=True).wait()
    ok["async all-to-all"] = torch.equal(out, want)
    t = torch.full((3,), float(rank))
    m.broadcast_anywhere(t, group_src=0, group=group, mesh=mesh)
    ok["broadcast"] = torch.equal(t, torch.zeros(3))
    piece = torch.empty(3)
    m.reduce_scatter_anywhere(piece, torch.arange(3.0 * world) + rank, [3] * world, group=group,
                              mesh=mesh)
    total = sum(range(world))
    ok["reduce-scatter"] = torch.equal(piece, world * torch.arange(3.0) + 3 * rank * world + total)
    t = torch.full((2,), float(rank + 1))
    m.all_reduce_anywhere(t, group=group, mesh=mesh)
    ok["all-reduce"] = torch.equal(t, torch.full((2,), float(world * (world + 1) // 2)))
    return ok


def _ragged(mesh, rank: int, world: int) -> dict[str, bool]:
    """``full_tensor()`` / ``redistribute`` of an offloaded (CPU) RaggedShard DTensor."""
    from torch.distributed.tensor import Shard

    from lightning_vescale.placement import RaggedShard, ragged_from_local

    rows = 3 * world + 1
    full = torch.arange(rows * 4.0).view(rows, 4)
    units = [2] * (world - 1) + [rows - 2 * (world - 1)]  # uneven: the padded all-gather
    placement = RaggedShard((0,), units)
    a, b = placement.local_range(full.shape, rank)
    x = ragged_from_local(full.view(-1)[a:b].clone(), mesh, placement, full.shape,
                          autograd=False)
    got = x.full_tensor()
    shard = x.redistribute(mesh, (Shard(0),)).to_local()
    return {"full_tensor": torch.equal(got, full) and got.device.type == "cpu",
            "to Shard(0)": torch.equal(shard, full.chunk(world)[rank])
            and shard.device.type == "cpu"}


def check_offload_collectives(device: torch.device) -> dict[str, Any]:
    """Row 1 of the module docstring."""
    from torch.distributed.device_mesh import init_device_mesh

    g = _g()
    name = "offloaded (CPU) tensors in collectives (mesh.*_anywhere)"
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    try:  # every rank takes the same branch: the backend decides, not the rank
        dist.all_reduce(torch.zeros(1))
        refused = False
    except RuntimeError:
        refused = True
    ok = {**_helpers(mesh, rank, world), **_ragged(mesh, rank, world)}
    bad = [k for k, v in ok.items() if not v]
    how = ("the backend refuses CPU tensors: staged through " + str(device)) if refused else \
        "the backend takes CPU tensors: no staging (copy-free)"
    return g._row(name, PASS if not bad else FAIL,
                  f"{how}; {len(ok) - len(bad)}/{len(ok)} give the expected values"
                  + (f"; wrong: {', '.join(bad)}" if bad else ""), refused_cpu=refused)


# -- optimizers with offload -------------------------------------------------------------------
def _optimizers() -> dict[str, Callable[[torch.nn.Module], torch.optim.Optimizer]]:
    from lightning_vescale.optim import SOAP, AdamW8bit, Muon

    return {"Muon": lambda model: Muon(list(model.named_parameters()), lr=0.02,
                                       adamw_lr=1e-3),
            "SOAP": lambda model: SOAP(model.parameters(), lr=3e-3, precondition_frequency=2),
            "AdamW8bit": lambda model: AdamW8bit(model.parameters(), lr=1e-3,
                                                 min_8bit_size=0)}


def _train(model, make_opt, device, steps: int) -> tuple[list[float], Any]:
    g = _g()
    opt = make_opt(model)
    world = dist.get_world_size()
    losses = []
    for x, y in g._batches(steps, 2 * world, g.SMALL["block_size"], g.SMALL["vocab_size"]):
        loss = model(g._micro(x).to(device), g._micro(y).to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(value.item() / world)
    return losses, opt


def _state_devices(opt) -> set[str]:
    from torch.distributed.tensor import DTensor

    out = set()
    for st in opt.state.values():
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and key != "step":
                out.add((v.to_local() if isinstance(v, DTensor) else v).device.type)
    return out


def _offloaded(device: torch.device) -> torch.nn.Module:
    from lightning_vescale.fsdp import CPUOffloadPolicy

    g = _g()
    return g._shard(g._small(device), "vescale", device, offload_policy=CPUOffloadPolicy())


def check_offload_optimizers(device: torch.device, steps: int = 3,
                             tol: float = 1e-3) -> dict[str, Any]:
    """Row 2 of the module docstring (tolerance: CPU vs GPU rounding of the optimizer maths)."""
    g = _g()
    name = "Muon / SOAP / AdamW8bit + CPU offload"
    parts, worst, bad, muon_bytes = [], 0.0, [], 0
    for opt_name, make in _optimizers().items():
        ref, _ = _train(g._shard(g._small(device), "vescale", device), make, device, steps)
        got, opt = _train(_offloaded(device), make, device, steps)
        d = g._rel(got, ref)
        where = _state_devices(opt)
        worst = max(worst, d)
        parts.append(f"{opt_name} {d:.1e} (states on {sorted(where)})")
        muon_bytes = getattr(opt, "comm_bytes", 0) if opt_name == "Muon" else muon_bytes
        if not (d <= tol and where == {"cpu"} and all(math.isfinite(v) for v in got)):
            bad.append(opt_name)
    world = dist.get_world_size()
    note = (f"Muon's owner all-to-alls moved {muon_bytes} bytes" if world > 1 else
            "world 1: no owner all-to-all (2+ GPUs)")
    return g._row(name, FAIL if bad else PASS, f"max relative loss difference vs the same run "
                  f"without offload: {'; '.join(parts)} (tolerance {tol:g}); {note}",
                  max_rel=worst)


def _elsewhere(sd: dict[str, Any], mesh) -> dict[str, Any]:
    """Every DTensor state of ``sd`` on the last rank only (an all-to-all of its shards)."""
    from torch.distributed.tensor import DTensor

    from lightning_vescale.placement import RaggedShard

    last = mesh.size() - 1

    def move(v: Any) -> Any:
        if not isinstance(v, DTensor) or v.dim() == 0:
            return v
        units = [0] * last + [v.shape[0]]
        return v.redistribute(mesh, (RaggedShard((0,), units),))
    return {"param_groups": sd["param_groups"],
            "state": {k: {key: move(v) for key, v in st.items()}
                      for k, st in sd["state"].items()}}


def check_offload_state_reshard(device: torch.device, steps: int = 2) -> dict[str, Any]:
    """Row 3 of the module docstring."""
    from torch.distributed.tensor import DTensor

    g = _g()
    name = "optimizer-state reshard + load with offload"
    if dist.get_world_size() < 2:
        return g._row(name, SKIP, "needs 2+ devices (at world 1 a redistribution is local)")
    parts, bad = [], []
    for opt_name, make in _optimizers().items():
        model = _offloaded(device)
        _, opt = _train(model, make, device, steps)
        sd = opt.state_dict()
        mesh = next(v for st in sd["state"].values() for v in st.values()
                    if isinstance(v, DTensor)).device_mesh
        fresh = make(model)
        fresh.load_state_dict(_elsewhere(sd, mesh))
        same = all(torch.equal(_local(opt.state[p][k]), _local(fresh.state[p][k]))
                   for p in opt.state for k in opt.state[p]
                   if isinstance(opt.state[p][k], torch.Tensor))
        where = _state_devices(fresh)
        parts.append(f"{opt_name}: {'bitwise' if same else 'DIFFER'}, on {sorted(where)}")
        if not same or where != {"cpu"}:
            bad.append(opt_name)
    return g._row(name, FAIL if bad else PASS, "; ".join(parts))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().cpu()


CHECKS = (check_offload_collectives, check_offload_optimizers, check_offload_state_reshard)
