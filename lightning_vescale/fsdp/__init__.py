"""Layer 3: ``fully_shard`` (FSDP2-style API) over RaggedShard DTensors and zero-copy DBuffers.

Public: :func:`fully_shard`, :class:`MixedPrecisionPolicy`, :class:`CPUOffloadPolicy`,
:class:`CommPolicy` (quantized all-gather, gradient wire dtype),
:class:`VeScaleFSDPModule` (a torch ``FSDPModule``), :func:`register_fsdp_forward_method`,
:func:`materialize`, :func:`check_optimizer` / :func:`find_replaced` (an optimizer over
parameters ``fully_shard`` replaced). Introspection for the strategy, optimizers and the memory
profiler: :func:`get_state`, :func:`iter_param_groups`, :func:`param_fqn_map`, :func:`dbuffers`,
:func:`memory_bytes`, :class:`ParamGroup`, :class:`ManagedParam`, :class:`FSDPState`,
:class:`TrainingState`, :class:`ReshardPolicy` / :func:`reshard_policy`.

Design notes of layer 3 (the package's convention and the other layers' notes:
``lightning_vescale/NOTES.md``): each is a block in the docstring of the module it describes.

* ``api.py``: [fsdp-api] (what ``fully_shard`` builds) [fsdp-state-accessor]
  (``fully_shard.state``, containers without forward, deepcopy)
* ``_extensions.py``: [fsdp-all-gather-extension] (FSDP2's ``fsdp_pre_all_gather``: refused)
* ``_comm_policy.py``: [comm-policy] (what the collectives carry: int8/fp8 all-gather, wire
  dtype)
* ``_reshard.py``: [fsdp-reshard-policy] (``reshard_after_forward``, decided once)
* ``_outside_call.py``: [fsdp-outside-call] (a submodule called outside its group's forward)
* ``_shard_placement.py``: [fsdp-shard-placement] (FSDP2's ``shard_placement_fn``,
  ``dp_mesh_dims``)
* ``_managed_param.py``: [fsdp-param-objects] (the two parameter objects, swapping)
* ``_tp.py``: [fsdp-tp] (tensor-parallel parameters: FSDP2 + TP's contract)
* ``_param_mesh.py``: [fsdp-param-mesh] (parameters on a mesh of their own: expert parallelism)
* ``_param_group.py``: [fsdp-buffer-order] (matrices first; frozen parameters apart)
* ``_param_group_grads.py``: [fsdp-grads] (grad buffer, reduce-scatter, publication)
  [fsdp-post-acc-grad-hooks] (optimizer in backward: the sharded parameters' hooks)
* ``_state.py``: [fsdp-schedule] (the hooks, prefetch) [fsdp-backward-completion] (when a
  group's backward is over, on every rank) [fsdp-multi-forward] (several forwards before one
  backward) [fsdp-reentrant] [fsdp-profiling] [fsdp-compile]
* ``_root.py``: [fsdp-final-callback] (the end of a backward, the gradient flags)
  [fsdp-gloo-fusion] (the schedule that lets small gloo collectives leave together)
* ``_collective_check.py``: [fsdp-collective-check] (opt-in: every rank runs the same group)
* ``_training_state.py``: [fsdp-training-state]
* ``_materialize.py``: [fsdp-materialize] [fsdp-list-apply] (a list group under ``_apply``);
  ``_state_dict.py``: [fsdp-state-dict];
  ``_module.py``: [fsdp-module]; ``_replaced.py``: [fsdp-replaced]

Modules import one way: ``api`` -> ``_module`` / ``_collect`` / ``_state_dict`` / ``_subgroups``
-> ``_materialize`` -> ``_state`` -> ``_root`` -> ``_param_group`` -> ``_param_group_grads`` ->
``_managed_param``; below them ``_comm_policy`` / ``_policy`` / ``_reshard`` /
``_training_state`` / ``_tree`` / ``_replaced`` / ``_subgroups`` / ``_collective_check`` /
``_shard_placement`` / ``_param_mesh`` / ``_outside_call`` / ``_extensions``.
"""

from lightning_vescale.fsdp._training_state import TrainingState
from lightning_vescale.fsdp._materialize import materialize
from lightning_vescale.fsdp._param_group import ManagedParam, ParamGroup
from lightning_vescale.fsdp._replaced import check_optimizer, find_replaced
from lightning_vescale.fsdp._reshard import ReshardPolicy, reshard_policy
from lightning_vescale.fsdp._state import FSDPState, get_state
from lightning_vescale.fsdp.api import (
    CPUOffloadPolicy,
    CommPolicy,
    MixedPrecisionPolicy,
    VeScaleFSDPModule,
    dbuffers,
    fully_shard,
    iter_param_groups,
    memory_bytes,
    param_fqn_map,
    register_fsdp_forward_method,
)

__all__ = [
    "CPUOffloadPolicy",
    "CommPolicy",
    "FSDPState",
    "ManagedParam",
    "MixedPrecisionPolicy",
    "ParamGroup",
    "ReshardPolicy",
    "TrainingState",
    "VeScaleFSDPModule",
    "check_optimizer",
    "dbuffers",
    "find_replaced",
    "fully_shard",
    "get_state",
    "iter_param_groups",
    "materialize",
    "memory_bytes",
    "param_fqn_map",
    "register_fsdp_forward_method",
    "reshard_policy",
]
