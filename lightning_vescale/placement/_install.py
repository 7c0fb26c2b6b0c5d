"""``install()``: the one place that registers ``RaggedShard`` support with torch's DTensor.

The package's other modules only *define* the extensions (design notes [ragged-dtensor] in
``_dtensor`` and [ragged-ops] in ``_ops``); importing them changes nothing in torch. This
function binds them, and ``lightning_vescale.placement`` calls it once on import, so every user
of ``RaggedShard`` (which imports the package anyway) gets redistribution, ``to_local``
backward, DCP chunks and operator support with no side-effect import of its own.

What is patched (process-wide, not undone):

* E1: ``redistribute_local_tensor`` in torch's ``_redistribute``, ``_api`` and ``_dispatch``
  modules (each imported it by name) -> :func:`~._dtensor.wrap_redistribute`;
* E2: ``_api._ToTorchTensor`` -> :func:`~._dtensor.make_to_torch_tensor`;
* E3: DCP's ``_Checkpointable`` methods of ``DTensor`` -> :func:`~._dtensor.wrap_checkpoint_hook`;
* operators: ``DTensor._op_dispatcher._propagate_op_sharding_dispatch_slow_path`` ->
  :func:`~._ops.wrap_slow_path`, and torch's custom handlers of ``GUARDED_CUSTOM_OPS`` ->
  :func:`~._ops.guard_custom_handler`;
* E4: ``distribute_tensor`` in ``torch.distributed.tensor``, its ``_api`` module and
  ``torch.distributed._state_dict_utils`` -> :func:`~._compat.wrap_distribute_tensor`, and
  ``_state_dict_utils._distribute_tensors`` -> :func:`~._compat.wrap_distribute_tensors`
  (design note [ragged-compat]).

Idempotent: every installed object carries a marker attribute, and a binding that already holds
a marked object is left alone, so a second call (or a re-import) wraps nothing twice.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed._state_dict_utils as _sd_utils
import torch.distributed.tensor as _dt
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as _dt_api
from torch.distributed.tensor import _dispatch as _dt_dispatch
from torch.distributed.tensor import _redistribute as _dt_redistribute

from lightning_vescale.placement._compat import wrap_distribute_tensor, wrap_distribute_tensors
from lightning_vescale.placement._dtensor import (
    CHECKPOINT_HOOKS,
    make_to_torch_tensor,
    wrap_checkpoint_hook,
    wrap_redistribute,
)
from lightning_vescale.placement._ops import (
    GUARDED_CUSTOM_OPS,
    guard_custom_handler,
    wrap_slow_path,
)

__all__ = ["install"]

_MARK = "__lightning_vescale_ragged__"
_T = TypeVar("_T")


def _is_installed(obj: object) -> bool:
    return getattr(obj, _MARK, False)


def _marked(obj: _T) -> _T:
    setattr(obj, _MARK, True)
    return obj


def install() -> None:
    """Register RaggedShard's redistribution, ``to_local`` backward, DCP chunks and operator
    support with torch's DTensor (idempotent; ``lightning_vescale.placement`` calls it on import).

    Raises:
        RuntimeError: this torch has no ``_propagate_op_sharding_dispatch_slow_path`` (the C++
            DTensor dispatch of torch >= 2.13), which operator support needs.
    """
    dispatcher = DTensor._op_dispatcher
    slow_path = getattr(dispatcher, "_propagate_op_sharding_dispatch_slow_path", None)
    if slow_path is None:
        raise RuntimeError(
            "lightning_vescale RaggedShard ops need torch's C++ DTensor dispatch "
            "(OpDispatcher._propagate_op_sharding_dispatch_slow_path, torch >= 2.13); "
            f"torch {torch.__version__} does not have it. Upgrade torch."
        )
    # E1: every binding of redistribute_local_tensor that can see a RaggedShard spec.
    for module in (_dt_redistribute, _dt_api, _dt_dispatch):
        current = module.redistribute_local_tensor
        if not _is_installed(current):
            module.redistribute_local_tensor = _marked(wrap_redistribute(current))
    # E2: the autograd function behind to_local()/full_tensor().
    if not _is_installed(_dt_api._ToTorchTensor):
        _dt_api._ToTorchTensor = _marked(make_to_torch_tensor(_dt_api._ToTorchTensor))
    # E3: DCP's _Checkpointable protocol on DTensor.
    for name in CHECKPOINT_HOOKS:
        current = getattr(DTensor, name)
        if not _is_installed(current):
            setattr(DTensor, name, _marked(wrap_checkpoint_hook(name, current)))
    # Operators: the dispatcher's slow path, and torch's handlers that assume Shard/Replicate.
    if not _is_installed(slow_path):
        dispatcher._propagate_op_sharding_dispatch_slow_path = _marked(wrap_slow_path(slow_path))
    handlers = dispatcher._custom_op_handlers
    for op in GUARDED_CUSTOM_OPS:
        handler = handlers.get(op)
        if handler is not None and not _is_installed(handler):
            handlers[op] = _marked(guard_custom_handler(handler))
    # E4: distribute_tensor and the state-dict utilities' full -> shard cut.
    for module in (_dt, _dt_api, _sd_utils):
        current = getattr(module, "distribute_tensor", None)
        if current is not None and not _is_installed(current):
            module.distribute_tensor = _marked(wrap_distribute_tensor(current))
    current = getattr(_sd_utils, "_distribute_tensors", None)
    if current is not None and not _is_installed(current):
        _sd_utils._distribute_tensors = _marked(wrap_distribute_tensors(current))
