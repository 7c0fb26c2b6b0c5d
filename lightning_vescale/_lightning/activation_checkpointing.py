"""``activation_checkpointing_policy`` of both strategies: which layers recompute their forward in
backward, and how they are made to.

Design note [activation-checkpointing]
--------------------------------------
The value means what it means for Lightning's ``FSDPStrategy``: a set (or list, or tuple) of
layer classes, or of class names as YAML/LightningCLI write them (``[Block]``,
``"torch.nn.TransformerEncoderLayer"``; matched as ``sharding_units`` entries are), a
``torch.distributed.fsdp.wrap.ModuleWrapPolicy``, or a callable. A callable takes a module and
returns whether to checkpoint it; Lightning's ``auto_wrap_policy`` form ``(module, recurse,
nonwrapped_numel) -> bool`` is called with ``recurse=False``. Each class entry must match a
submodule (a typo is an error naming the entry and the classes of the model, not a silent
no-op). The root module is never checkpointed, and a selected module inside a selected module is
left alone (the outer recompute runs it again anyway).

How: the selected module's ``forward`` is replaced, on the instance, by
``torch.utils.checkpoint.checkpoint(forward, ..., use_reentrant=False)`` (a ``functools.partial``,
so ``deepcopy``/pickle keep working). This is FSDP2's order, "checkpoint, then shard": the
checkpointed region is the module's ``forward`` only, while ``fully_shard``'s hooks sit around
it in ``__call__``, so the all-gather runs outside the region and the recompute inside backward
finds the parameters the pre-backward gathered (design note [fsdp-final-callback]). Unlike
``checkpoint_wrapper`` it changes no parameter name (checkpoints, optimizer names and Hugging
Face keys stay as they are), and unlike ``torch.distributed._composable.checkpoint`` it survives
``torch.compile`` (dynamo traces ``torch.utils.checkpoint`` as one region and recomputes it; the
composable hooks were compiled away, measured: no recompute). Nested ``fully_shard`` groups
inside a checkpointed module run their pre-forward again in the recompute, which only unshards.
With grad disabled (validation, ``no_grad``) the original forward runs as it is. A model that
already holds torch ``CheckpointWrapper`` modules is left alone with a warning, as Lightning's
``FSDPStrategy`` does.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
from collections.abc import Callable
from typing import Any, Optional, Union

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_vescale._lightning.sharding import _unit_matches

__all__ = [
    "ActivationCheckpointingPolicy",
    "CheckpointSelection",
    "apply_activation_checkpointing",
    "is_checkpointed",
    "validate_activation_checkpointing_policy",
]

#: What ``activation_checkpointing_policy`` accepts (design note [activation-checkpointing]);
#: a ``ModuleWrapPolicy`` works too. (``str`` before ``Callable``: a YAML scalar such as
#: ``Block`` or ``pkg.mod.Block`` is a class name, never an object jsonargparse builds.)
ActivationCheckpointingPolicy = Optional[Union[
    set[Union[str, type[Module]]], list[Union[str, type[Module]]], str, Callable[..., bool]]]

_FIX = ("e.g. activation_checkpointing_policy={Block} (classes), ['Block'] (class names, as in "
        "YAML) or a callable (module) -> bool")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointSelection:
    """Which modules recompute their forward in backward: any of ``classes`` (classes or class
    names), or those ``predicate`` accepts. Build it with
    :func:`validate_activation_checkpointing_policy`."""

    classes: tuple[Union[type[Module], str], ...] = ()
    predicate: Optional[Callable[[Module], bool]] = None

    def selects(self, module: Module) -> bool:
        if any(_unit_matches(module, c) for c in self.classes):
            return True
        return self.predicate is not None and bool(self.predicate(module))


def validate_activation_checkpointing_policy(value: Any) -> Optional[CheckpointSelection]:
    """Check ``activation_checkpointing_policy`` at construction; ``None`` (or an empty set):
    no checkpointing.

    Raises:
        TypeError: not a class, a class name, a collection of those or a callable; an entry of
            a collection is neither a module class nor a non-empty string.
    """
    if value is None:
        return None
    classes = getattr(value, "_module_classes", None)  # FSDP1's ModuleWrapPolicy
    if classes is not None:
        value = set(classes)
    if isinstance(value, (str, type)):
        value = [value]
    if isinstance(value, (set, frozenset, list, tuple)):
        entries = list(value)
        for e in entries:
            if not ((isinstance(e, str) and e.strip())
                    or (isinstance(e, type) and issubclass(e, Module))):
                raise TypeError(
                    f"activation_checkpointing_policy entries must be nn.Module classes or class "
                    f"names, got {e!r} in {value!r}; {_FIX}.")
        entries = sorted(set(entries), key=lambda e: e if isinstance(e, str) else e.__qualname__)
        return CheckpointSelection(classes=tuple(entries)) if entries else None
    if isinstance(value, Module):
        raise TypeError(f"activation_checkpointing_policy got a module instance "
                        f"({type(value).__name__}); pass its class instead: "
                        f"activation_checkpointing_policy={{{type(value).__name__}}}.")
    lambda_fn = getattr(value, "_lambda_fn", None)  # FSDP1's CustomPolicy
    if lambda_fn is not None:
        return CheckpointSelection(predicate=lambda_fn)
    if callable(value):
        return CheckpointSelection(predicate=_as_predicate(value))
    raise TypeError(f"activation_checkpointing_policy must be a set of nn.Module classes or class "
                    f"names, or a callable, got {value!r} ({type(value).__name__}); {_FIX}.")


def _as_predicate(fn: Callable[..., Any]) -> Callable[[Module], bool]:
    """``fn(module)``, or Lightning's auto-wrap form ``fn(module, recurse, nonwrapped_numel)``."""
    try:
        inspect.signature(fn).bind(None)
        return fn
    except TypeError:
        pass
    except ValueError:  # no signature (a builtin): call it with the module alone
        return fn

    def auto_wrap_form(module: Module) -> bool:
        numel = sum(p.numel() for p in module.parameters())
        return bool(fn(module=module, recurse=False, nonwrapped_numel=numel))
    return auto_wrap_form


def _checkpointed_forward(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The forward of a checkpointed module: recomputed in backward when grad is on."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` made ``module`` recompute its forward."""
    fwd = module.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is _checkpointed_forward


def apply_activation_checkpointing(root: Module,
                                   selection: Optional[CheckpointSelection]) -> list[str]:
    """Make the modules of ``root`` that ``selection`` picks recompute their forward in
    backward (design note [activation-checkpointing]); returns their names. Call it before
    ``fully_shard`` (FSDP2's order), though the hooks do not depend on the order.

    Raises:
        ValueError: a class entry matches no submodule of ``root`` (the message lists the
            model's classes and the closest names).
    """
    if selection is None:
        return []
    if _has_checkpoint_wrapper(root):
        rank_zero_warn("activation_checkpointing_policy is set, but the model already contains "
                       "torch CheckpointWrapper layers; the policy is ignored. Remove one of the "
                       "two.")
        return []
    modules = [(n, m) for n, m in root.named_modules() if m is not root]
    for entry in selection.classes:
        if not any(_unit_matches(m, entry) for _, m in modules):
            raise _unmatched_error(root, entry)
    chosen: list[str] = []
    for name, module in modules:
        if any(name.startswith(c + ".") for c in chosen) or not selection.selects(module):
            continue
        chosen.append(name)
        if not is_checkpointed(module):
            module.forward = functools.partial(_checkpointed_forward, module.forward)
    return chosen


def _has_checkpoint_wrapper(root: Module) -> bool:
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointWrapper,
        )
    except ImportError:  # pragma: no cover - torch builds without distributed
        return False
    return any(isinstance(m, CheckpointWrapper) for m in root.modules())


def _unmatched_error(root: Module, entry: Union[type, str]) -> ValueError:
    classes = sorted({type(m).__name__ for m in root.modules() if m is not root})
    label = entry if isinstance(entry, str) else entry.__name__
    short = label.rpartition(".")[2]
    close = difflib.get_close_matches(short, classes, n=3, cutoff=0.5)
    hint = f" Closest: {close}." if close else ""
    root_note = (f" ({type(root).__name__} is the root module, which is never checkpointed.)"
                 if _unit_matches(root, entry) else "")
    return ValueError(
        f"activation_checkpointing_policy entry {label!r} matches no submodule of "
        f"{type(root).__name__}.{hint}{root_note} Module classes in the model: "
        f"{classes} (a class name, its qualified name such as "
        f"'torch.nn.TransformerEncoderLayer', or the class itself).")
