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
  range (one copy of the owned elements).

Values for tied parameters are converted under every alias.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vescale.fsdp._param_group import ParamGroup, make_dtensor

__all__ = ["register_load_hook", "to_param_layout"]


def to_param_layout(value: Any, sharded: DTensor, rank_range: tuple[int, int]) -> Any:
    """``value`` as a DTensor with ``sharded``'s mesh and placement (see the design note)."""
    if isinstance(value, DTensor):
        if value.placements == sharded.placements and value.device_mesh == sharded.device_mesh:
            return value
        return value.redistribute(sharded.device_mesh, sharded.placements)
    if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(sharded.shape):
        a, b = rank_range
        local = value.detach().reshape(-1)[a:b].to(device=sharded.device, dtype=sharded.dtype)
        return make_dtensor(local.clone(), sharded.device_mesh, sharded.placements[0],
                            tuple(sharded.shape))
    return value  # a shape mismatch: let nn.Module report it


def _reshard_at_rest(group: ParamGroup) -> None:
    """Make the module hold its sharded parameters again, unless a backward is running.

    Normally true already outside forward/backward; after a forward whose output never went
    through backward (design note [fsdp-schedule]) the group may still be unsharded, and
    ``state_dict()`` / ``load_state_dict`` must see (and write) the RaggedShard parameters.
    """
    if group.is_unsharded and torch._C._current_graph_task_id() == -1:
        group.reshard()


def register_load_hook(module: nn.Module, group: ParamGroup) -> Any:
    """Register ``group``'s ``state_dict`` hooks on ``module``.

    A ``state_dict`` pre-hook reshards (see :func:`_reshard_at_rest`); the ``load_state_dict``
    pre-hook reshards too, then converts values to the parameters' layout (design note
    [fsdp-state-dict]).
    """
    module.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: _reshard_at_rest(group))

    def hook(mod: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        _reshard_at_rest(group)
        for mp in group.params:
            assert mp.sharded is not None and mp.buffer is not None
            rng = mp.buffer.plan.local_range(mp.name, mp.buffer.rank)
            for alias in mp.aliases or [mp.name]:
                key = prefix + alias
                if key in state_dict:
                    state_dict[key] = to_param_layout(state_dict[key], mp.sharded, rng)

    return module.register_load_state_dict_pre_hook(hook)
