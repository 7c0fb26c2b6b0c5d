"""Buffers of a module built on the meta device: what materialising it does with them.

Torch-only (no layer of this package below it), used by ``fsdp.materialize`` (layer 3) and by
``checkpoint.load_safetensors`` (beside layer 2, which must not import layer 3):
:func:`allocate` is ``materialize(..., init_params=False)`` for both.

Design note [meta-buffers]
--------------------------
``module.to_empty(device=...)`` gives *every* tensor fresh, uninitialised storage. For
parameters that is the point (they are initialised or loaded next); buffers are different: a
*non-persistent* buffer (the rotary ``inv_freq`` of Llama-style models, Gemma's ``embed_scale``,
Bert's ``position_ids``) is in no checkpoint, so a model built on meta that only gets its weights
loaded would compute with garbage. The contract of :func:`~lightning_vescale.fsdp.materialize`
for buffers:

* a buffer that was *not* on meta (a model built with its buffers on a real device) keeps its
  value: it is saved before ``to_empty`` and copied back (:func:`save_real_buffers`);
* no buffer that was on meta ever holds uninitialised memory: right after ``to_empty`` it is
  filled (:func:`poison`: NaN for floating-point and complex dtypes, zero for the others);
* every buffer that was on meta is then recomputed, *whatever its owner holds*, by, in this
  order, (1) the ``reset_parameters()`` of the module that owns it (torch's convention for meta
  init; it runs as part of the default parameter init, or here when parameters are not
  initialised), then (2) for a module of a Hugging Face ``transformers`` model, the nearest
  ancestor's ``_init_weights(module)`` — what ``transformers`` itself runs after building on meta
  (``initialize_weights``: it sets ``inv_freq``, ``embed_scale``, ``position_ids``...);
* neither call may touch a parameter (some are loaded already, or about to be; the RNG stream
  must not move): an owner that has parameters of its own is recomputed through a *throwaway
  copy* (:func:`_throwaway`) whose parameters, and whose other buffers, are meta tensors of the
  same shapes (initialising them costs nothing and draws no random number) while the buffers
  being recomputed are the real ones. ``transformers`` gets the same effect by flagging loaded
  tensors ``_is_hf_initialized``; a copy needs no cooperation from the init code, and works for
  ``reset_parameters()`` too;
* a buffer counts as recomputed when its tensor was written in place (its version counter moved)
  or replaced (its value is copied into the real buffer). A *non-persistent* buffer that nothing
  recomputed is an error naming it and the fix, raised before any step (a persistent one is
  expected from the checkpoint loaded next).
"""

from __future__ import annotations

import copy
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


Poisoned = dict[str, tuple[torch.Tensor, int]]


def poison(buffers: list[MetaBuffer]) -> Poisoned:
    """Fill each one: NaN where the dtype has it, else zero (see the design note: no buffer keeps
    uninitialised memory, and a float one nothing recomputes cannot pass for a value). Returns
    each one's tensor and version counter after the fill: what :func:`recompute` compares with
    to see which ones were written since."""
    out: Poisoned = {}
    with torch.no_grad():
        for b in buffers:
            t = b.tensor
            if t is not None:
                t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else 0)
                out[b.fqn] = (t, t._version)
    return out


def _hf_init_owner(root: nn.Module, buffer: MetaBuffer) -> nn.Module | None:
    """The nearest ancestor of ``buffer``'s owner (itself included) with ``_init_weights`` (a
    Hugging Face ``PreTrainedModel``)."""
    parts = buffer.fqn.split(".")[:-1]
    for n in range(len(parts), -1, -1):
        m = root.get_submodule(".".join(parts[:n]))
        if callable(getattr(m, "_init_weights", None)):
            return m
    return None


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A plain meta tensor of ``t``'s (global, for a DTensor) shape and dtype."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def _throwaway(module: nn.Module, real: set[str]) -> nn.Module:
    """A copy of ``module`` (its submodules copied too) whose parameters and buffers are meta
    tensors, except its own buffers named in ``real``, which are ``module``'s own tensors: init
    code run on the copy writes those and nothing else (design note [meta-buffers])."""
    clone = copy.copy(module)
    clone._parameters = {k: None if p is None else nn.Parameter(_meta_like(p), p.requires_grad)
                         for k, p in module._parameters.items()}
    clone._buffers = {k: None if b is None else (b if k in real else _meta_like(b))
                      for k, b in module._buffers.items()}
    clone._modules = {k: None if c is None else _throwaway(c, set())
                      for k, c in module._modules.items()}
    return clone


class _Watch:
    """Which of one owner's buffers have been written (version counter) or replaced since."""

    def __init__(self, owner: nn.Module, mine: list[MetaBuffer], poisoned: Poisoned) -> None:
        self.owner, self.mine = owner, mine
        self.start = {b.attr: poisoned[b.fqn] for b in mine if b.fqn in poisoned}
        self.done: set[str] = set()

    def collect(self, source: nn.Module) -> None:
        """Mark what ``source`` (the owner or its throwaway copy) recomputed; a replaced buffer's
        new value is copied into the real one (a meta or misshapen one does not count)."""
        for attr, (real, version) in self.start.items():
            if attr in self.done:
                continue
            now = source._buffers.get(attr)
            if now is real:
                if real._version != version:
                    self.done.add(attr)
            elif isinstance(now, torch.Tensor) and not now.is_meta \
                    and now.shape == real.shape:
                with torch.no_grad():
                    real.copy_(now)
                self.owner._buffers[attr] = real
                self.done.add(attr)

    @property
    def pending(self) -> list[MetaBuffer]:
        return [b for b in self.mine if b.attr in self.start and b.attr not in self.done]


def _run(step: str, fn, errors: list[str]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported with the buffers left, if any
        errors.append(f"{step}: {type(err).__name__}: {err}")


@torch.no_grad()
def recompute(root: nn.Module, buffers: list[MetaBuffer], poisoned: Poisoned, *,
              reset_ran: bool) -> None:
    """Recompute every buffer that was on meta (design note [meta-buffers]).

    ``poisoned``: what :func:`poison` returned for ``buffers``. ``reset_ran``: the default
    parameter init already called every ``reset_parameters()`` since (what it wrote counts).

    Raises:
        RuntimeError: a non-persistent buffer that nothing recomputed (named, with the fix).
    """
    owners: dict[int, nn.Module] = {}
    for b in buffers:
        owners.setdefault(id(b.owner), b.owner)
    missed: list[str] = []
    errors: list[str] = []
    for owner in owners.values():
        mine = [b for b in buffers if b.owner is owner]
        watch = _Watch(owner, mine, poisoned)
        watch.collect(owner)  # what the default init wrote
        own_params = any(p is not None for p in owner._parameters.values())
        reset = getattr(owner, "reset_parameters", None)
        if callable(reset) and watch.pending and not reset_ran:
            if own_params:
                clone = _throwaway(owner, {b.attr for b in watch.pending})
                _run(f"{type(owner).__name__}.reset_parameters()", clone.reset_parameters,
                     errors)
                watch.collect(clone)
            else:
                _run(f"{type(owner).__name__}.reset_parameters()", reset, errors)
                watch.collect(owner)
        if watch.pending:
            hf = _hf_init_owner(root, mine[0])
            if hf is not None:
                clone = _throwaway(owner, {b.attr for b in watch.pending})
                _run(f"{type(hf).__name__}._init_weights({type(owner).__name__})",
                     lambda: hf._init_weights(clone), errors)
                watch.collect(clone)
        missed += [b.fqn for b in watch.pending if not b.persistent]
    if missed:
        raise RuntimeError(
            f"The non-persistent buffer(s) {missed} were created on the meta device and nothing "
            "recomputed them (no checkpoint has them: they would hold NaN or zeros). Give their "
            "module a reset_parameters() that sets them (a Hugging Face model's _init_weights "
            "is used too), or build the model with its buffers on a real device (design note "
            "[meta-buffers])." + (f" Errors on the way: {errors}" if errors else ""))


def allocate(module: nn.Module, device: torch.device) -> nn.Module:
    """Storage on ``device`` for every tensor of ``module`` (``to_empty``; a ``fully_shard``
    module re-creates its DBuffers there), parameters left uninitialised (to be loaded next),
    buffers kept or recomputed as the design note says."""
    on_meta = meta_buffers(module)
    real = save_real_buffers(module)
    module.to_empty(device=device)
    restore_real_buffers(real)
    recompute(module, on_meta, poison(on_meta), reset_ran=False)
    return module
