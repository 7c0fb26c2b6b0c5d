"""Parameters ``fully_shard`` replaced, and the check that no optimizer steps on one.

Design note [fsdp-replaced]
---------------------------
``fully_shard`` registers new parameter objects (RaggedShard DTensors) in the modules; the
user's original ``nn.Parameter`` objects are no longer part of the model. A rebuild (``to``,
``to_empty``, a dtype move) replaces the DTensors once more. Anything that still holds a
replaced object is silently detached from training, and the one such holder that matters is an
optimizer built before sharding (in a LightningModule's ``__init__``, or before ``fully_shard``
/ ``model.to_empty(...)``): it would step on tensors nothing reads, and the model would never
change. FSDP2 is silent here; this module is not:

* every replaced parameter is recorded (by id, with a weak reference and a label such as
  ``"Linear.weight"``), so a later ``fully_shard`` call finding one of the originals in another
  module knows the parameter is tied across groups (:func:`taken_by`);
* one global optimizer step pre-hook (``register_optimizer_step_pre_hook``,
  installed by the first ``fully_shard`` call) raises ``RuntimeError`` naming the parameter and
  the fix when an optimizer holds a replaced parameter. An optimizer's parameters are checked
  on its first step and again only when its parameter count changes (``add_param_group``): the
  steady-state cost is one length sum per step;
* :func:`find_replaced` lets the Lightning strategies reject such an optimizer at set-up, as
  Lightning's ``FSDPStrategy`` does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["check_optimizer", "find_replaced", "install_optimizer_check", "mark_replaced",
           "taken_by"]


class _Entry(NamedTuple):
    ref: weakref.ref
    label: str  #: e.g. "Linear.weight"
    original: bool  #: the user's parameter (True) or a DTensor an ``_apply`` rebuild replaced


_REPLACED: dict[int, _Entry] = {}


def _forget(key: int) -> Callable[[weakref.ref], None]:
    def callback(ref: weakref.ref) -> None:
        entry = _REPLACED.get(key)
        if entry is not None and entry.ref is ref:
            del _REPLACED[key]
    return callback


def mark_replaced(param: torch.Tensor, label: str, *, original: bool) -> None:
    """Record that ``param`` (named ``label``) is no longer part of its model."""
    _REPLACED[id(param)] = _Entry(weakref.ref(param, _forget(id(param))), label, original)


def _entry(param: Any) -> _Entry | None:
    entry = _REPLACED.get(id(param))
    if entry is None or entry.ref() is not param:
        return None
    return entry


def taken_by(param: nn.Parameter) -> str | None:
    """The label of the group an earlier ``fully_shard`` call put ``param`` in, or ``None``."""
    entry = _entry(param)
    return entry.label if entry is not None and entry.original else None


def find_replaced(params: Iterable[Any]) -> tuple[str, bool] | None:
    """``(label, original)`` of the first of ``params`` that ``fully_shard`` replaced, or
    ``None`` if none was."""
    for p in params:
        entry = _entry(p)
        if entry is not None:
            return entry.label, entry.original
    return None


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Any]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def replaced_message(what: str, label: str, original: bool) -> str:
    """The error text for ``what`` (e.g. ``"optimizer.step()"``) holding a replaced parameter."""
    if original:
        cause = ("the optimizer was built over the parameters before fully_shard replaced them "
                 "with sharded ones (e.g. in a LightningModule's __init__, or before calling "
                 "fully_shard)")
    else:
        cause = ("the optimizer was built before the sharded module was moved or re-created "
                 "(module.to(...), .to_empty(...), a dtype change), which replaces its sharded "
                 "parameters")
    return (f"{what}: parameter {label!r} is no longer part of the model: "
            f"{cause}, so stepping it would train nothing. Build the optimizer from the sharded "
            "model's parameters after sharding (and after moving it): "
            "optimizer = torch.optim.AdamW(model.parameters(), ...); in a LightningModule, "
            "create it in configure_optimizers() from self.parameters().")


_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()


def check_optimizer(optimizer: torch.optim.Optimizer, what: str = "optimizer.step()") -> None:
    """Raise if ``optimizer`` holds a parameter ``fully_shard`` replaced (design note).

    Raises:
        RuntimeError: naming the parameter and the fix.
    """
    found = find_replaced(_optimizer_params(optimizer))
    if found is not None:
        raise RuntimeError(replaced_message(what, *found))


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _REPLACED:
        return
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _CHECKED.get(optimizer) == count:
        return
    check_optimizer(optimizer)
    _CHECKED[optimizer] = count


_HOOK: list[Any] = []


def install_optimizer_check() -> None:
    """Install the global optimizer step pre-hook (once per process; ``fully_shard`` calls it)."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_step_pre_hook))
