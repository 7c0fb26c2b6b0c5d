"""State dicts of a sharded module and its optimizers: built for a save, applied on a load.

Both formats of design note [checkpoint-formats] are keyed by FQNs (``state_dict()`` names).
Building: :func:`model_state` / :func:`optimizer_state`, sharded (``DTensor`` values, no
communication) or full (gathered to rank 0 one tensor at a time, CPU tensors there; design note
[full-state-gather] in :func:`_gather_to_rank0`). Applying a *full*
state dict to a sharded module or optimizer slices every tensor down to this rank's part
(:func:`load_full_model_state`, :func:`load_full_optimizer_state`), so at most one full tensor
exists at a time. The file formats themselves live in ``_sharded.py`` and ``_full.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.nn import Module
from torch.optim import Optimizer

from lightning_vescale.checkpoint._files import rank
from lightning_vescale.mesh import collective_device
from lightning_vescale.placement import (
    RaggedShard,
    ragged_from_local,
    ragged_ranges,
)
from lightning_vescale.placement._ragged_tp import copy_runs_, rank_flat_runs

__all__ = [
    "model_state",
    "optimizer_state",
    "load_full_model_state",
    "load_full_optimizer_state",
]


# ------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------
def _full(t: Any, keep: bool) -> Any:
    """The full CPU tensor of a ``DTensor`` (collective over its mesh) or tensor; else ``t``.

    ``keep=False`` (the ranks whose full state dict is ``{}``): take part in the collective and
    hold no full tensor (design note [full-state-gather]).
    """
    if isinstance(t, DTensor):
        gathered = _gather_to_rank0(t, keep)
        t = _on_collective_device(t).full_tensor() if gathered is _NOT_RAGGED else gathered
    if not keep:
        return None
    if isinstance(t, Tensor):
        t = t.detach().cpu()
    return t


#: :func:`_gather_to_rank0`'s answer for a layout it leaves to ``full_tensor()``.
_NOT_RAGGED = object()


@torch.no_grad()
def _gather_to_rank0(t: DTensor, keep: bool) -> Any:
    """``t`` gathered on global rank 0 only (``None`` elsewhere), for this package's layouts
    (one ``RaggedShard`` mesh dim, the others ``Replicate``; rank 0 at the mesh's origin);
    :data:`_NOT_RAGGED` for any other layout (the caller uses ``full_tensor()``).

    Design note [full-state-gather]
    -------------------------------
    A full state dict is kept on rank 0 only. ``full_tensor()``
    is an all-gather (or a broadcast from a sole owner): every other rank received a full copy of
    each tensor only to drop it, and that copy was the collective's output buffer, which the
    backend's worker thread (gloo's) still references for a moment after the collective returns:
    the next gather could begin while the previous full tensor was alive (2 at once on rank 1 in
    20-50 % of runs here, every run on another machine). Instead every rank that holds elements
    sends its shard (a contiguous flat range) to rank 0, which receives each straight into its
    range of the one full tensor it allocates: no other rank allocates anything (a CPU-offloaded
    shard on a GPU-only group: one copy of the shard on the device), rank 0 one full tensor (as
    ``full_tensor()`` did, and no padding or concatenation), and the bytes cross the network
    once. Ranks of other replicas (HSDP) hold the same shards as rank 0's replica and take no
    part; so does a rank that holds no element of the tensor.
    """
    mesh, placements = t.device_mesh, t.placements
    ragged_dims = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    coord = mesh.get_coordinate()
    if (len(ragged_dims) != 1 or coord is None
            or not all(isinstance(p, (RaggedShard, Replicate)) for p in placements)
            or int(mesh.mesh.reshape(-1)[0]) != 0):
        return _NOT_RAGGED
    d = ragged_dims[0]
    if any(c != 0 for i, c in enumerate(coord) if i != d):
        return None  # another replica: rank 0's shard group gathers without it
    assert (coord[d] == 0) == keep, (coord, keep)  # rank 0, the mesh's origin, keeps
    ranges = ragged_ranges(t.shape, placements[d])
    local = t._local_tensor.reshape(-1)
    group = mesh.get_group(d)
    where = collective_device(group, local.device, mesh)
    if not keep:
        if local.numel():
            dist.send(local.to(where), group=group, group_dst=0)
        return None
    out = torch.empty(t.numel(), dtype=local.dtype, device=where)
    for r, (start, end) in enumerate(ranges):
        if end == start:
            continue
        if r == 0:
            out[start:end].copy_(local)
        else:
            dist.recv(out[start:end], group=group, group_src=r)
    return out.view(t.shape)


def _full_values(sd: Mapping[str, Any], keep: bool) -> dict[str, Any]:
    """``sd`` with every tensor made full (one collective per DTensor, on every rank); ``{}``
    where not ``keep`` (the gathers still run, their results are dropped one by one)."""
    out = {}
    for k, v in sd.items():
        v = _full(v, keep) if isinstance(v, Tensor) else v
        if keep:
            out[k] = v
    return out


def _on_collective_device(t: DTensor) -> DTensor:
    """``t``, or with its local tensor moved to where its mesh's collectives run: a CPU-offloaded
    parameter or optimizer state on an NCCL mesh is gathered on the GPU (design note
    [mesh-device]; FSDP2's full state dicts move to the mesh's device first too)."""
    local, mesh = t._local_tensor, t.device_mesh
    where = collective_device(mesh.get_group(0), local.device, mesh)
    if where == local.device:
        return t
    local = local.to(where)
    if _is_ragged(t):
        return ragged_from_local(local, mesh, tuple(t.placements), t.shape, t.stride(),
                                 autograd=False, check=False)
    return DTensor.from_local(local, mesh, t.placements, run_check=False, shape=t.shape,
                              stride=t.stride())


def _is_ragged(t: DTensor) -> bool:
    """This package's parameters and states: ``(RaggedShard,)`` or HSDP's ``(Replicate(),
    RaggedShard)``. Their local tensor depends only on the rank's coordinate on the ragged dim
    (design note [ragged-nd]), so slicing a full tensor needs no communication on any mesh."""
    return any(isinstance(p, RaggedShard) for p in t.placements)


@torch.no_grad()
def _copy_full_into(target: Tensor, full: Tensor, name: str) -> None:
    """Write the rank's part of ``full`` into ``target`` (a DTensor or a plain tensor)."""
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {tuple(full.shape)} but the model/optimizer "
            f"expects {tuple(target.shape)}; was the checkpoint written for another model?"
        )
    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    local = target.to_local()
    mesh, placements = target.device_mesh, target.placements
    if _is_ragged(target):
        # the rank's runs of the flat full tensor: one range for (RaggedShard,) / HSDP's
        # (Replicate(), RaggedShard); the RaggedShard range of the TP-local box for FSDP + TP's
        # (..., RaggedShard, Shard(k)) (design note [ragged-tp])
        copy_runs_(local.view(-1), full, rank_flat_runs(
            tuple(target.shape), mesh, placements,
            "loading a full checkpoint into a RaggedShard DTensor"))
        return
    src = DTensor.from_local(full.to(device=local.device, dtype=local.dtype), mesh,
                             [Replicate()] * mesh.ndim, run_check=False)
    local.copy_(src.redistribute(mesh, placements).to_local())


def _zero_grad_for(param: Tensor) -> Tensor:
    """A zero gradient for ``param``, built from its local tensor (no DTensor op needed)."""
    if not isinstance(param, DTensor):
        return torch.zeros_like(param)
    zeros = torch.zeros_like(param.to_local())
    if _is_ragged(param):
        return ragged_from_local(zeros, param.device_mesh, tuple(param.placements), param.shape,
                                 param.stride(), autograd=False, check=False)
    return DTensor.from_local(zeros, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


# ------------------------------------------------------------------------------------------------
# Building state dicts
# ------------------------------------------------------------------------------------------------
def model_state(module: Module, *, full: bool) -> dict[str, Any]:
    """The module's state dict: sharded (DTensors, no communication) or full.

    ``full=True`` gathers one tensor at a time (a collective: call on every rank) and returns
    CPU tensors on rank 0 and ``{}`` elsewhere.
    """
    sd = module.state_dict()
    if not full:
        return sd
    return _full_values(sd, keep=rank() == 0)


def params_of(optimizer: Optimizer) -> list[Tensor]:
    """The optimizer's parameters in index order (the keys of its ``state_dict()``)."""
    return list(itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups))


def index_to_fqn(module: Module, optimizer: Optimizer) -> dict[int, str]:
    """Optimizer parameter index -> the parameter's FQN in ``module`` (first name if tied)."""
    fqns = {id(p): name for name, p in module.named_parameters()}
    mapping: dict[int, str] = {}
    for idx, p in enumerate(params_of(optimizer)):
        if id(p) not in fqns:
            raise ValueError(
                "An optimizer holds a parameter that is not a parameter of the model; create the "
                "optimizer from the sharded model's parameters (in `configure_optimizers`, or "
                "after `setup_module` with Fabric)."
            )
        mapping[idx] = fqns[id(p)]
    return mapping


def optimizer_state(module: Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """The optimizer's ``state_dict()``, sharded (keyed by FQN) or full (keyed by index).

    Sharded: ``{"state": {fqn: {...DTensors...}}, "param_groups": [{..., "params": [fqn]}]}``.
    Full: the plain torch format with full CPU tensors on rank 0 (``{}`` elsewhere); a
    collective, call on every rank.
    """
    sd = optimizer.state_dict()
    if full:
        keep = rank() == 0
        state = {idx: _full_values(s, keep) for idx, s in sd["state"].items()}
        return {"state": state, "param_groups": sd["param_groups"]} if keep else {}
    fqn = index_to_fqn(module, optimizer)
    return {
        "state": {fqn[idx]: dict(s) for idx, s in sd["state"].items()},
        "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]}
                         for g in sd["param_groups"]],
    }


# ------------------------------------------------------------------------------------------------
# Applying state dicts
# ------------------------------------------------------------------------------------------------
def strict_check(missing: Iterable[str], unexpected: Iterable[str], strict: bool,
                 what: str = "the model") -> None:
    """Under ``strict``, raise if the checkpoint and ``what`` do not have the same keys."""
    missing, unexpected = sorted(missing), sorted(unexpected)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading the checkpoint into {what} (strict=True):\n"
            f"  missing keys: {missing}\n  unexpected keys: {unexpected}\n"
            "Pass strict_loading=False (LightningModule.strict_loading / Fabric "
            "load(strict=False)) "
            "to ignore them."
        )


def missing_optimizer_error(key: str, saved: Iterable[str]) -> KeyError:
    """The error for a requested optimizer whose key has no state in the checkpoint (strict);
    ``saved``: the keys the checkpoint does hold optimizer states under."""
    return KeyError(
        f"The checkpoint has no optimizer state under {key!r} (it has optimizer states under "
        f"{sorted(saved)}). Load the optimizer under the key it was saved with, or pass "
        "strict=False to leave the optimizer as it is."
    )


def init_optim_state(optimizer: Optimizer) -> None:
    """Create the optimizer's states: its own ``init_state()`` if it has one, else a
    zero-gradient, zero-lr step (as DCP does).

    Zero gradients are built from each parameter's local tensor, so this needs no DTensor op
    support beyond wrapping a local tensor.
    """
    if optimizer.state:
        return
    init_state = getattr(optimizer, "init_state", None)  # e.g. lightning_vescale.optim.Muon
    if callable(init_state):
        init_state()
        return
    params = [p for p in params_of(optimizer) if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = _zero_grad_for(p)
    lrs = []
    for g in optimizer.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = lrs.pop(0)
        optimizer.zero_grad(set_to_none=True)


def load_into_optimizer(optimizer: Optimizer, state: dict[int, Any],
                        param_groups: list[dict[str, Any]]) -> None:
    """``optimizer.load_state_dict`` that also drops the states of parameters not in ``state``
    (``init_optim_state`` created them; a parameter with no saved state starts fresh)."""
    dropped = [p for i, p in enumerate(params_of(optimizer))
               if i not in state and p in optimizer.state]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
    for p in dropped:
        optimizer.state.pop(p, None)


@torch.no_grad()
def load_full_model_state(state_dict: Mapping[str, Any], module: Module, *,
                          strict: bool = True) -> None:
    """Load a full (single-process) state dict into a sharded module, slicing per rank."""
    msd = module.state_dict()
    missing = [k for k in msd if k not in state_dict]
    unexpected = [k for k in state_dict if k not in msd]
    strict_check(missing, unexpected, strict)
    for name, target in msd.items():
        if name in state_dict and isinstance(target, Tensor):
            _copy_full_into(target, state_dict[name], name)


@torch.no_grad()
def load_full_optimizer_state(opt_state: Mapping[str, Any], module: Module,
                              optimizer: Optimizer) -> None:
    """Load a full optimizer state dict (plain torch format, index keys) into a sharded
    optimizer."""
    init_optim_state(optimizer)
    sd = optimizer.state_dict()
    saved_state = opt_state.get("state", {})
    if saved_state and isinstance(next(iter(saved_state)), str):  # FQN-keyed (consolidated)
        fqn2idx = {v: k for k, v in index_to_fqn(module, optimizer).items()}
        saved_state = {fqn2idx[k]: v for k, v in saved_state.items()}
    state = {}
    for idx, st in sd["state"].items():
        if idx not in saved_state:
            continue
        new = {}
        for sk, sv in st.items():
            if sk not in saved_state[idx]:
                new[sk] = sv
                continue
            value = saved_state[idx][sk]
            if isinstance(sv, Tensor) and (isinstance(sv, DTensor) or sv.dim() > 0):
                _copy_full_into(sv, value, f"optimizer state {sk} of parameter #{idx}")
                new[sk] = sv
            elif isinstance(sv, Tensor) and isinstance(value, Tensor):
                new[sk] = value.to(device=sv.device, dtype=sv.dtype).reshape(sv.shape)
            else:
                new[sk] = value
        state[idx] = new
    saved_groups = opt_state.get("param_groups", sd["param_groups"])
    if len(saved_groups) != len(sd["param_groups"]):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups but the "
            f"optimizer has {len(sd['param_groups'])}; configure the same parameter groups."
        )
    groups = [{**saved, "params": cur["params"]} for saved, cur in
              zip(saved_groups, sd["param_groups"])]
    load_into_optimizer(optimizer, state, groups)
