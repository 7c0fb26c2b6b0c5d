"""Buffers of a module built on the meta device: what materialising it does with them.

Torch-only (no layer of this package below it), used by ``fsdp.materialize`` (layer 3) and by
``checkpoint.load_safetensors`` (beside layer 2, which must not import layer 3):
:func:`allocate` is ``materialize(..., init_params=False)`` for both.

Design note [meta-buffers]
--------------------------
``module.to_empty(device=...)`` gives *every* tensor fresh, uninitialised storage. For
parameters that is the point (they are initialised or loaded next); buffers are different: a
*non-persistent* buffer (the rotary ``inv_freq`` of Llama-style models, a causal mask) is in no
checkpoint, so a model built on meta that only gets its weights loaded would compute with
garbage. The contract of :func:`~lightning_vescale.fsdp.materialize` for buffers:

* a buffer that was *not* on meta (a model built with its buffers on a real device) keeps its
  value: it is saved before ``to_empty`` and copied back (:func:`save_real_buffers`);
* a buffer that *was* on meta is recomputed by, in this order, (1) the ``reset_parameters()`` of
  the module that owns it, if it has one (torch's convention for meta init; it runs as part of
  the default parameter init, or here when parameters are not initialised), then (2) for a
  module of a Hugging Face ``transformers`` model that owns no parameter of its own (rotary
  embeddings), the nearest ancestor's ``_init_weights(module)`` — what ``transformers`` itself
  calls after building on meta (it recomputes ``inv_freq`` from the config);
* floating-point buffers that were on meta are filled with NaN right after ``to_empty``, so one
  that nothing recomputed is detected: a *non-persistent* one gets a warning naming it and the
  fix (give the module a ``reset_parameters()`` that sets it, or build the buffers on a real
  device); a persistent one is expected to come from the checkpoint loaded next.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MetaBuffer", "allocate", "meta_buffers", "poison", "recompute",
           "restore_real_buffers", "save_real_buffers"]


@dataclass(frozen=True, kw_only=True)
class MetaBuffer:
    """A buffer that was on the meta device: its owner, attribute, FQN and persistence."""

    owner: nn.Module
    attr: str
    fqn: str
    persistent: bool

    @property
    def tensor(self) -> torch.Tensor | None:
        return self.owner._buffers.get(self.attr)


def _named_buffers(module: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    out = []
    for prefix, m in module.named_modules(remove_duplicate=True):
        for attr, b in m._buffers.items():
            if b is not None:
                out.append((f"{prefix}.{attr}" if prefix else attr, m, attr, b))
    return out


def meta_buffers(module: nn.Module) -> list[MetaBuffer]:
    """The buffers of ``module`` (recursively) that are on the meta device."""
    return [MetaBuffer(owner=m, attr=attr, fqn=fqn,
                       persistent=attr not in m._non_persistent_buffers_set)
            for fqn, m, attr, b in _named_buffers(module) if b.is_meta]


def save_real_buffers(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The buffers that are not on meta, with their values, to restore after ``to_empty``."""
    return [(m, attr, b) for _, m, attr, b in _named_buffers(module) if not b.is_meta]


def restore_real_buffers(saved: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Copy the values :func:`save_real_buffers` kept into the (new) buffers."""
    with torch.no_grad():
        for m, attr, value in saved:
            new = m._buffers.get(attr)
            if new is not None and new is not value:
                new.copy_(value)


def poison(buffers: list[MetaBuffer]) -> None:
    """Fill the floating-point ones with NaN (see the design note: detects a missed one)."""
    with torch.no_grad():
        for b in buffers:
            t = b.tensor
            if t is not None and t.is_floating_point():
                t.fill_(float("nan"))


def _still_poisoned(b: MetaBuffer) -> bool:
    t = b.tensor
    return t is not None and t.is_floating_point() and t.numel() > 0 and bool(t.isnan().all())


def _hf_init_owner(root: nn.Module, buffer: MetaBuffer) -> nn.Module | None:
    """The nearest ancestor of ``buffer``'s owner (itself included) with ``_init_weights`` (a
    Hugging Face ``PreTrainedModel``)."""
    parts = buffer.fqn.split(".")[:-1]
    for n in range(len(parts), -1, -1):
        m = root.get_submodule(".".join(parts[:n]))
        if callable(getattr(m, "_init_weights", None)):
            return m
    return None


@torch.no_grad()
def recompute(root: nn.Module, buffers: list[MetaBuffer], *, reset_ran: bool) -> None:
    """Recompute the buffers that were on meta (design note [meta-buffers]).

    ``reset_ran``: the default parameter init already called every ``reset_parameters()``.
    """
    owners: dict[int, nn.Module] = {}
    for b in buffers:
        owners.setdefault(id(b.owner), b.owner)
    for owner in owners.values():
        mine = [b for b in buffers if b.owner is owner]
        if not any(_still_poisoned(b) for b in mine):
            continue
        if not reset_ran and callable(getattr(owner, "reset_parameters", None)) \
                and not any(True for _ in owner.parameters(recurse=False)):
            owner.reset_parameters()
        if any(_still_poisoned(b) for b in mine) \
                and not any(True for _ in owner.parameters(recurse=False)):
            hf = _hf_init_owner(root, mine[0])
            if hf is not None:
                hf._init_weights(owner)
    missed = [b.fqn for b in buffers if not b.persistent and _still_poisoned(b)]
    if missed:
        warnings.warn(
            f"materialize: the non-persistent buffer(s) {missed} were created on the meta device "
            "and nothing recomputed them, so they hold NaN (no checkpoint has them). Give their "
            "module a reset_parameters() that sets them, or build the model with its buffers on "
            "a real device (design note [meta-buffers]).", stacklevel=3)


def allocate(module: nn.Module, device: torch.device) -> nn.Module:
    """Storage on ``device`` for every tensor of ``module`` (``to_empty``; a ``fully_shard``
    module re-creates its DBuffers there), parameters left uninitialised (to be loaded next),
    buffers kept or recomputed as the design note says."""
    on_meta = meta_buffers(module)
    real = save_real_buffers(module)
    module.to_empty(device=device)
    restore_real_buffers(real)
    poison(on_meta)
    recompute(module, on_meta, reset_ran=False)
    return module
