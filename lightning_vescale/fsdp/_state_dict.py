"""``load_state_dict`` into sharded modules: accept sharded *and* full state dicts.

Design note [fsdp-state-dict]
-----------------------------
``module.state_dict()`` needs nothing special: at rest the modules hold the RaggedShard DTensor
parameters, so the state dict holds them (detached, still views of the DBuffer shard).

``load_state_dict`` copies each value into the existing parameter with ``param.copy_(value)``;
for RaggedShard DTensors that is an element-wise op on the local views (``placement._ops``), so the
data lands in the DBuffer shard and the parameters are never replaced. A pre-hook on each
sharded module converts values first, so that the copy always sees the parameter's own layout:

* a RaggedShard DTensor with the same placement: as is;
* any other DTensor: ``redistribute`` to the parameter's placement (``placement._dtensor``);
* a plain tensor of the global shape (a full, unsharded checkpoint): each rank takes its own
  range (``placement.local_slice``; one copy of the owned elements).

Values for tied parameters are converted under every alias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_vescale.fsdp._training_state import in_backward
from lightning_vescale.fsdp._param_group import ParamGroup
from lightning_vescale.placement import local_slice, ragged_from_local, ragged_shard_and_rank
from lightning_vescale.placement._compat import distribute_ragged

__all__ = ["register_state_dict_hooks", "to_param_layout"]


def to_param_layout(value: Any, sharded: DTensor) -> Any:
    """``value`` as a DTensor with ``sharded``'s mesh and placements (see the design note).

    ``sharded`` is a RaggedShard parameter: ``(RaggedShard,)`` on a 1-D mesh or HSDP's
    ``(Replicate(), RaggedShard)``. A full tensor is cut to this rank's slice on the ragged mesh
    dim (the shard group: every replica takes the same slice; design note [ragged-nd]).
    """
    if isinstance(value, DTensor):
        if value.placements == sharded.placements and value.device_mesh == sharded.device_mesh:
            return value
        return value.redistribute(sharded.device_mesh, sharded.placements)
    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(sharded.shape):
        mesh, placements = sharded.device_mesh, tuple(sharded.placements)
        if len(placements) > 1 and any(type(p) is Shard for p in placements):
            # tensor parallelism (design note [fsdp-tp]): the TP-local region's ranges
            local = distribute_ragged(value.detach(), mesh, placements, src_data_rank=None)
            return local.to(device=sharded.device, dtype=sharded.dtype)
        ragged, r = ragged_shard_and_rank(mesh, placements,
                                          "loading a full state dict into a sharded module")
        local = local_slice(value.detach(), ragged, r)
        local = local.to(device=sharded.device, dtype=sharded.dtype).clone()
        return ragged_from_local(local, mesh, placements, tuple(sharded.shape),
                                 autograd=False, check=False)
    return value  # a shape mismatch: let nn.Module report it


def _reshard_at_rest(group: ParamGroup) -> None:
    """Make the module hold its sharded parameters again, unless a backward is running.

    Normally true already outside forward/backward; after a forward whose output never went
    through backward (design note [fsdp-schedule]) the group may still be unsharded, and
    ``state_dict()`` / ``load_state_dict`` must see (and write) the RaggedShard parameters.
    """
    if group.is_unsharded and not in_backward():
        group.reshard()


def register_state_dict_hooks(module: nn.Module, group: ParamGroup, index: int = 0) -> None:
    """Register ``group``'s ``state_dict`` and ``load_state_dict`` pre-hooks on ``module``.

    ``index``: the position of ``module`` in a ``fully_shard([...])`` list (each module of the
    list gets the hooks for the names relative to it). A ``state_dict`` pre-hook reshards (see
    :func:`_reshard_at_rest`); the ``load_state_dict`` pre-hook reshards too, then converts
    values to the parameters' layout (design note [fsdp-state-dict]).
    """
    module.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: _reshard_at_rest(group))

    def names(mp: Any) -> list[str]:
        if mp.scoped_aliases:
            return [n for k, n in mp.scoped_aliases if k == index]
        return mp.aliases or [mp.name]

    def hook(mod: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        _reshard_at_rest(group)
        for mp in group.params:
            assert mp.sharded is not None and mp.buffer is not None
            for alias in names(mp):
                key = prefix + alias
                if key in state_dict:
                    state_dict[key] = to_param_layout(state_dict[key], mp.sharded)

    module.register_load_state_dict_pre_hook(hook)
