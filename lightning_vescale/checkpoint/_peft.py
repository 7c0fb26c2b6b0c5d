"""peft adapters of a sharded model: ``save_peft_adapter(model, dir)``.

Design note [peft-adapter-save]
-------------------------------
``PeftModel.save_pretrained()`` on a sharded model fails on rank 0 (``Attempted to access the
data pointer on an invalid python storage``: peft reads the storage of each value to find
aliases, and a ``DTensor`` has none of its own) and writes nothing; torch's FSDP2 fails the
same way. :func:`save_peft_adapter` keeps peft's own saving and feeds it full tensors:

1. rank 0 asks peft which state-dict entries the adapter files hold
   (``get_peft_model_state_dict`` over the sharded state dict: peft only selects entries, so
   the selected values are the state dict's own objects) and broadcasts their names. Which
   entries that is can depend on rank 0's view of the base model's config (peft's
   ``save_embedding_layers="auto"``), so one rank decides;
2. every rank gathers those entries, one ``full_tensor()`` at a time, in that order (the
   adapter tensors, not the base model: LoRA's are a few percent of it);
3. rank 0 calls ``PeftModel.save_pretrained(dir, state_dict=<those full tensors>)``: the same
   files, names and ``adapter_config.json`` as in one process, which
   ``PeftModel.from_pretrained`` loads.

A failure of rank 0 in steps 1 or 3 (a peft error, a full disk) is raised on every rank
(:func:`~lightning_vescale.checkpoint._files.rank0_agreed`), so none is left waiting in a
collective. Should a peft method ever return a value that is not one of the state dict's own
tensors (computed from several), rank 0 selects the whole state dict instead: slower, still the
files peft would write.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

from torch.nn import Module

from lightning_vescale.checkpoint._files import _broadcast_object, rank, rank0_agreed
from lightning_vescale.checkpoint._state_dicts import _full_values

__all__ = ["save_peft_adapter"]


def save_peft_adapter(model: Module, save_directory: Union[str, os.PathLike], *,
                      selected_adapters: Optional[list[str]] = None,
                      safe_serialization: bool = True, **save_pretrained_kwargs: Any) -> None:
    """Write the peft adapter(s) of a sharded (or plain) model as ``PeftModel.save_pretrained``
    does in one process: files that ``PeftModel.from_pretrained(base, save_directory)`` loads.

    A collective: call it on every rank, at the same point (a Trainer hook or callback, e.g.
    ``on_train_end``, or after ``trainer.fit`` under the default launcher; with Fabric after
    training). Only the adapter tensors are gathered; rank 0 writes (design note
    [peft-adapter-save]).

    Args:
        model: a ``peft.PeftModel``, or a module holding exactly one (a ``LightningModule``
            whose attribute is the ``PeftModel``, Fabric's wrapped module).
        save_directory: the adapter directory (created by rank 0).
        selected_adapters, safe_serialization, save_pretrained_kwargs: passed on to
            ``PeftModel.save_pretrained`` (``is_main_process`` and ``state_dict`` are set here).
    """
    for key in ("state_dict", "is_main_process"):
        if key in save_pretrained_kwargs:
            raise TypeError(f"save_peft_adapter sets {key}= itself (rank 0 saves the gathered "
                            f"adapter tensors); got {key}={save_pretrained_kwargs[key]!r}. "
                            "Drop it.")
    peft_model = _find_peft_model(model)
    state_dict = peft_model.state_dict()
    names = _broadcast_object(rank0_agreed(
        lambda: _adapter_entries(peft_model, state_dict, selected_adapters,
                                 save_pretrained_kwargs.get("save_embedding_layers", "auto")),
        "select the peft adapter tensors"))
    full = _full_values({name: state_dict[name] for name in names}, keep=rank() == 0)
    rank0_agreed(lambda: peft_model.save_pretrained(
        str(save_directory), safe_serialization=safe_serialization,
        selected_adapters=selected_adapters, is_main_process=True, state_dict=full,
        **save_pretrained_kwargs), f"write the peft adapter to {str(save_directory)!r}")


def _peft_model_class() -> type:
    try:
        from peft import PeftModel
    except ImportError as e:  # pragma: no cover - the caller has a PeftModel, so peft imports
        raise ImportError("save_peft_adapter needs the `peft` package: pip install peft") from e
    return PeftModel


def _find_peft_model(model: Module) -> Module:
    """``model`` if it is a ``PeftModel``, else the one ``PeftModel`` among its submodules."""
    peft_cls = _peft_model_class()
    if isinstance(model, peft_cls):
        return model
    if not isinstance(model, Module):
        raise TypeError(f"save_peft_adapter(model=...) takes a torch.nn.Module holding a "
                        f"peft.PeftModel; got {type(model).__name__}.")
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, peft_cls)]
    outer = [(n, m) for n, m in found
             if not any(n != o and n.startswith(f"{o}.") for o, _ in found)]
    if len(outer) != 1:
        where = ", ".join(repr(n) for n, _ in outer) or "none"
        raise ValueError(
            f"save_peft_adapter(model=...) needs a peft.PeftModel or a module holding exactly one; "
            f"{type(model).__name__} holds {len(outer)} ({where}). Pass the PeftModel itself "
            "(e.g. `save_peft_adapter(lightning_module.model, dir)`).")
    return outer[0][1]


def _adapter_entries(peft_model: Module, state_dict: dict[str, Any],
                     selected_adapters: Optional[list[str]],
                     save_embedding_layers: Union[str, bool]) -> list[str]:
    """The state-dict names whose values peft's ``save_pretrained`` writes (in state-dict
    order), or every name if peft returns a value that is not one of the entries."""
    from peft import get_peft_model_state_dict

    adapters = (list(peft_model.peft_config) if selected_adapters is None
                else list(selected_adapters))
    wanted: set[int] = set()
    for adapter in adapters:
        if adapter not in peft_model.peft_config:
            raise ValueError(f"save_peft_adapter(selected_adapters=...) names {adapter!r}, which "
                             "the model does not have; its adapters: "
                             f"{list(peft_model.peft_config)}.")
        selected = get_peft_model_state_dict(peft_model, state_dict=state_dict,
                                             adapter_name=adapter,
                                             save_embedding_layers=save_embedding_layers)
        wanted.update(id(v) for v in selected.values())
    ours = {id(v) for v in state_dict.values()}
    if not wanted <= ours:
        return list(state_dict)
    return [name for name, value in state_dict.items() if id(value) in wanted]
