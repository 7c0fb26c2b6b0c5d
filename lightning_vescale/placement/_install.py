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
* E4: torch's ``distribute_tensor`` function object is taught ragged placements in place
  (:func:`~._compat.teach_distribute_tensor`: every name bound to it, whatever the import
  order), and ``_state_dict_utils._distribute_tensors`` ->
  :func:`~._compat.wrap_distribute_tensors` (design note [ragged-compat]).
* the flat optimizer step: a custom handler (:func:`~._flat_step.flat_list_op`) for every
  element-wise ``_foreach_*`` op and the fused optimizer kernels (design note [flat-step]),
  unless another handler is registered for the op; registered by the operator hook at the
  process's first RaggedShard op, not here. :func:`set_flat_step_enabled` /
  :func:`flat_step_enabled` remove and restore exactly these entries.

Idempotent: every installed object carries a marker attribute, and a binding that already holds
a marked object is left alone, so a second call (or a re-import) wraps nothing twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TypeVar

import torch
import torch.distributed._state_dict_utils as _sd_utils
import torch.distributed.tensor as _dt
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as _dt_api
from torch.distributed.tensor import _dispatch as _dt_dispatch
from torch.distributed.tensor import _redistribute as _dt_redistribute

from lightning_vescale.placement._compat import (
    teach_distribute_tensor,
    wrap_distribute_tensor,
    wrap_distribute_tensors,
)
from lightning_vescale.placement._dtensor import (
    CHECKPOINT_HOOKS,
    make_to_torch_tensor,
    wrap_checkpoint_hook,
    wrap_redistribute,
)
from lightning_vescale.placement._flat_step import is_enabled as flat_is_enabled
from lightning_vescale.placement._flat_step import set_enabled as flat_set_enabled
from lightning_vescale.placement._pickle import wrap_deepcopy, wrap_reduce_ex
from lightning_vescale.placement._ops import (
    GUARDED_CUSTOM_OPS,
    guard_custom_handler,
    wrap_slow_path,
)

__all__ = ["flat_step_enabled", "install", "is_flat_step_enabled", "set_flat_step_enabled"]

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
    # One function object behind torch.distributed.tensor, _api and _state_dict_utils (and any
    # name a user bound before importing us): taught in place, so the import order is moot.
    if not teach_distribute_tensor(_dt_api.distribute_tensor):  # another torch: rebind names
        for module in (_dt, _dt_api, _sd_utils):
            current = getattr(module, "distribute_tensor", None)
            if current is not None and not _is_installed(current):
                module.distribute_tensor = _marked(wrap_distribute_tensor(current))
    current = getattr(_sd_utils, "_distribute_tensors", None)
    if current is not None and not _is_installed(current):
        _sd_utils._distribute_tensors = _marked(wrap_distribute_tensors(current))
    # E5: pickling / deep-copying DTensors over views at a storage offset (DBuffer views).
    for name, wrap in (("__reduce_ex__", wrap_reduce_ex), ("__deepcopy__", wrap_deepcopy)):
        current = getattr(DTensor, name)
        if not _is_installed(current):
            setattr(DTensor, name, _marked(wrap(current)))


# ---------------------------------------------------------------------------------------------
# The flat optimizer step's handlers (design note [flat-step]): on by default, switchable.
# ---------------------------------------------------------------------------------------------
def set_flat_step_enabled(enabled: bool) -> None:
    """Turn the flat optimizer step (design note [flat-step]) on or off, process-wide.

    On (the default) its DTensor custom handlers are registered at the process's first
    RaggedShard op (at once when switched on here). Off removes them, so every
    ``_foreach_*``/fused op takes DTensor's per-tensor path again (nothing of this package runs
    for them). Results are bitwise the same either way; only speed differs. Handlers another
    library registered are left alone.
    """
    flat_set_enabled(enabled)


def is_flat_step_enabled() -> bool:
    """Whether the flat optimizer step is on (see :func:`set_flat_step_enabled`)."""
    return flat_is_enabled()


@contextlib.contextmanager
def flat_step_enabled(enabled: bool) -> Iterator[None]:
    """Context manager: the flat optimizer step on/off inside, the previous setting after.

    E.g. ``with flat_step_enabled(False): opt.step()`` times the per-tensor path.
    """
    before = flat_is_enabled()
    flat_set_enabled(enabled)
    try:
        yield
    finally:
        flat_set_enabled(before)
