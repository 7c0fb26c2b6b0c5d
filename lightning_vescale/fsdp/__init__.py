"""Layer 3: ``fully_shard`` (FSDP2-style API) over RaggedShard DTensors and zero-copy DBuffers.

Public: :func:`fully_shard`, :class:`MixedPrecisionPolicy`, :class:`VeScaleFSDPModule`,
:func:`materialize`. Introspection for the strategy, optimizers and the memory profiler:
:func:`get_state`, :func:`iter_param_groups`, :func:`param_fqn_map`, :func:`dbuffers`,
:func:`memory_bytes`. Design notes: ``api.py`` [fsdp-api], ``_param_group.py``
[fsdp-param-objects] [fsdp-grads], ``_state.py`` [fsdp-schedule], ``_init.py`` [fsdp-init],
``lightning_vescale/dbuffer.py`` [dbuffer-memory] [dbuffer-views] [dbuffer-collectives].
"""

from lightning_vescale.fsdp._init import materialize
from lightning_vescale.fsdp._param_group import ManagedParam, ParamGroup
from lightning_vescale.fsdp._state import FSDPState, get_state
from lightning_vescale.fsdp.api import (
    MixedPrecisionPolicy,
    VeScaleFSDPModule,
    dbuffers,
    default_mesh,
    fully_shard,
    iter_param_groups,
    memory_bytes,
    param_fqn_map,
)

__all__ = [
    "FSDPState",
    "ManagedParam",
    "MixedPrecisionPolicy",
    "ParamGroup",
    "VeScaleFSDPModule",
    "dbuffers",
    "default_mesh",
    "fully_shard",
    "get_state",
    "iter_param_groups",
    "materialize",
    "memory_bytes",
    "param_fqn_map",
]
