"""Layer 3: ``fully_shard`` (FSDP2-style API) over RaggedShard DTensors and zero-copy DBuffers.

Public: :func:`fully_shard`, :class:`MixedPrecisionPolicy`, :class:`CPUOffloadPolicy`,
:class:`VeScaleFSDPModule` (a torch ``FSDPModule``), :func:`register_fsdp_forward_method`,
:func:`materialize`, :func:`check_optimizer` / :func:`find_replaced` (an optimizer over
parameters ``fully_shard`` replaced). Introspection for the strategy, optimizers and the memory
profiler: :func:`get_state`, :func:`iter_param_groups`, :func:`param_fqn_map`, :func:`dbuffers`,
:func:`memory_bytes`, :class:`ParamGroup`, :class:`ManagedParam`, :class:`FSDPState`,
:class:`TrainingState`. Design notes: ``api.py`` [fsdp-api], ``_param_group.py``
[fsdp-param-objects] [fsdp-grads], ``_state.py`` [fsdp-schedule] [fsdp-reentrant] [fsdp-profiling],
``_common.py`` [fsdp-training-state], ``_materialize.py`` [fsdp-materialize],
``_state_dict.py`` [fsdp-state-dict], ``_module.py`` [fsdp-module], ``_replaced.py``
[fsdp-replaced], ``lightning_vescale/dbuffer.py`` [dbuffer-memory] [dbuffer-views]
[dbuffer-collectives] [dbuffer-offload].

Modules import one way: ``api`` -> ``_module`` / ``_collect`` / ``_state_dict`` / ``_subgroups``
-> ``_materialize`` -> ``_state`` -> ``_param_group`` -> ``_policy`` / ``_common`` / ``_tree`` /
``_replaced`` / ``_subgroups``.
"""

from lightning_vescale.fsdp._common import TrainingState
from lightning_vescale.fsdp._materialize import materialize
from lightning_vescale.fsdp._param_group import ManagedParam, ParamGroup
from lightning_vescale.fsdp._replaced import check_optimizer, find_replaced
from lightning_vescale.fsdp._reshard import ReshardPolicy, reshard_policy
from lightning_vescale.fsdp._state import FSDPState, get_state
from lightning_vescale.fsdp.api import (
    CPUOffloadPolicy,
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
