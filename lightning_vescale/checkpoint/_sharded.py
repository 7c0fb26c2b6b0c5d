"""The sharded format: a DCP directory written by every rank in parallel, read at any world size.

``<dir>/.metadata`` + ``<dir>/__<rank>_0.distcp`` hold the tensors (top-level keys: the model's
key, e.g. ``"state_dict"``, and one key per optimizer, e.g. ``"optimizer_0"``, whose states are
keyed by FQN); ``<dir>/meta.pt`` holds everything else, written by rank 0. See design note
[checkpoint-formats] (``lightning_vescale/checkpoint``) for atomicity and cleanup.

Loading is safe and verified (design note [checkpoint-trust] in ``_trust.py``): restricted
unpickling of ``.metadata``, ``weights_only`` byte entries and ``meta.pt``, and the CRC-32s of
``.integrity.json`` checked; ``weights_only=False`` is the opt-out for trusted files.

Loading reads straight into the parameters' local shards: a sharded module's ``state_dict()``
shares storage with its parameters, so DCP's read planning (resharding from any layout) writes
into them in place. Optimizers get templates from their own ``state_dict()`` (states created
first), filled by DCP and handed back through ``load_state_dict``.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.nn import Module
from torch.optim import Optimizer

from lightning_vescale.checkpoint._files import (
    METADATA_FILENAME,
    discard,
    raise_if_no_space,
    is_sharded_checkpoint,
    publish,
    rank,
    rank0_agreed,
    serialize,
    temp_sibling,
)
from lightning_vescale.checkpoint._trust import (
    CheckpointLoadError,
    CheckpointRefusedError,
    checksum_items,
    load,
    read_metadata,
    read_verified_file,
    safe_torch_load,
    write_manifest,
)
from lightning_vescale.checkpoint._state_dicts import (
    index_to_fqn,
    init_optim_state,
    load_into_optimizer,
    missing_optimizer_error,
    strict_check,
)

__all__ = ["save_sharded", "load_sharded", "sharded_checkpoint_has", "count_sharded_optimizers"]


# ------------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------------
def save_sharded(path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Collective: write ``tensors`` with DCP and ``metadata`` to ``meta.pt``, atomically."""
    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint(path) and any(path.iterdir()):
        raise IsADirectoryError(
            f"The checkpoint path {str(path)!r} is an existing non-empty directory that is not a "
            "sharded checkpoint; refusing to replace it. Choose another path."
        )
    tmp = temp_sibling(path)

    def prepare() -> None:
        data = serialize(metadata)  # fail early (before any file is written) if unpicklable
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        try:
            (tmp / METADATA_FILENAME).write_bytes(data)
        except BaseException as e:
            discard(tmp)
            raise_if_no_space(e, path, "saving the sharded checkpoint",
                              "any previous checkpoint at that path is untouched")
            raise

    rank0_agreed(prepare, f"prepare the checkpoint directory {tmp}")
    try:  # DCP propagates any rank's write error to all ranks (as a BaseException)
        dcp.save(tensors, checkpoint_id=tmp)
        items = checksum_items(tmp)  # collective; raises on every rank if any rank failed
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise  # raised outside DCP's agreement: other ranks may still be writing into tmp
        # DCP (and checksum_items) raise only after gathering every rank's outcome, so no live
        # rank writes into tmp any more: rank 0 (DCP's coordinator) removes it, no collective
        # needed (see the design note).
        if rank() == 0:
            discard(tmp)
            cleanup = "the partial write was removed"
        else:
            cleanup = (f"rank 0 removes the partial write {tmp.name!r}; if rank 0 died, the next "
                       "save to this path (or remove_checkpoint) removes it")
        aftermath = f"any previous checkpoint at that path is untouched and {cleanup}"
        raise_if_no_space(e, path, "saving the sharded checkpoint", aftermath)
        raise RuntimeError(
            f"Saving the sharded checkpoint {str(path)!r} failed; {aftermath}. Cause: {e}"
        ) from e

    def write_manifest_and_publish() -> None:
        try:
            write_manifest(tmp, items, extra_files=(METADATA_FILENAME,))
            publish(tmp, path)
        except BaseException as e:
            discard(tmp)  # only rank 0 touches tmp now (DCP finished on every rank)
            raise_if_no_space(e, path, "publishing the sharded checkpoint",
                              "any previous checkpoint at that path is untouched")
            raise

    rank0_agreed(write_manifest_and_publish, f"publish the checkpoint at {path}")


# ------------------------------------------------------------------------------------------------
# What a checkpoint holds
# ------------------------------------------------------------------------------------------------
def _dcp_keys(path: Path, weights_only: bool = True) -> set[str]:
    return set(read_metadata(path, weights_only=weights_only).state_dict_metadata.keys())


def _top_level_keys(flat_keys: Iterable[str], requested: Iterable[str]) -> set[str]:
    """The ``requested`` keys that have at least one entry among DCP's flattened keys."""
    flat_keys = list(flat_keys)
    return {k for k in requested if any(f == k or f.startswith(f"{k}.") for f in flat_keys)}


def sharded_checkpoint_has(path: Path, keys: Iterable[str], *,
                           weights_only: Optional[bool] = None) -> set[str]:
    """Which of ``keys`` (top-level state keys) a sharded checkpoint holds tensors/objects for."""
    return _top_level_keys(_dcp_keys(Path(path), _safe(weights_only)), keys)


def count_sharded_optimizers(path: Path, *, weights_only: Optional[bool] = None) -> int:
    """How many ``optimizer_<i>`` entries (the Trainer's keys) a sharded checkpoint holds."""
    keys = _dcp_keys(path, _safe(weights_only))
    return len({k.split(".", 1)[0] for k in keys if k.startswith("optimizer_")})


# ------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------
class _ModuleEntries(NamedTuple):
    """An unsharded module's entries to read: ``{name: (flat DCP entries, unflatten mapping)}``."""

    module: Module
    entries: dict[str, tuple[dict[str, Any], Any]]


class _OptimizerTemplate(NamedTuple):
    """An optimizer's own ``state_dict()`` (DCP fills it) and its index -> FQN map."""

    optimizer: Optimizer
    state_dict: dict[str, Any]
    fqns: dict[int, str]


def _model_entries(module: Module, model_key: str, available: set[str],
                   strict: bool) -> dict[str, Any]:
    """The sharded model's flat entries (its ``state_dict()`` shares storage: read in place)."""
    msd = module.state_dict()
    flat: dict[str, Any] = {}
    missing = []
    for name, value in msd.items():
        key = f"{model_key}.{name}"
        if key in available:
            flat[key] = value
        else:
            missing.append(name)
    prefix = f"{model_key}."
    unexpected = [k[len(prefix):] for k in available if k.startswith(prefix)
                  and k[len(prefix):] not in msd]
    strict_check(missing, unexpected, strict)
    return flat


def _module_entries(key: str, module: Module, available: set[str],
                    strict: bool) -> _ModuleEntries:
    """An unsharded module's plain state dict, checked against the checkpoint like the model."""
    entries, covered, missing = {}, set(), []
    for name, value in module.state_dict().items():
        flat, mapping = flatten_state_dict({f"{key}.{name}": value})
        covered.update(flat)
        if flat and all(k in available for k in flat):
            entries[name] = (flat, mapping)
        else:
            missing.append(name)
    unexpected = [k[len(key) + 1:] for k in available
                  if k.startswith(f"{key}.") and k not in covered]
    strict_check(missing, unexpected, strict, what=f"the module {key!r}")
    return _ModuleEntries(module=module, entries=entries)


def _optimizer_template(key: str, optimizer: Optimizer, module: Module,
                        available: set[str]) -> tuple[_OptimizerTemplate, dict[str, Any]]:
    """The optimizer's template and its flat entries that the checkpoint holds."""
    init_optim_state(optimizer)
    sd = optimizer.state_dict()
    template = _OptimizerTemplate(optimizer=optimizer, state_dict=sd,
                                  fqns=index_to_fqn(module, optimizer))
    flat: dict[str, Any] = {}
    for idx, st in sd["state"].items():
        for sk, sv in st.items():
            fk = f"{key}.state.{template.fqns[idx]}.{sk}"
            if fk in available:
                flat[fk] = sv
    groups, _ = flatten_state_dict({f"{key}.param_groups": [dict(g) for g in sd["param_groups"]]})
    flat.update({k: v for k, v in groups.items() if k in available})
    return template, flat


def _apply_optimizer(key: str, template: _OptimizerTemplate, flat: Mapping[str, Any],
                     available: set[str]) -> None:
    """Hand the filled template to the optimizer (values DCP did not load in place included)."""
    sd = template.state_dict
    state = {}
    for idx, st in sd["state"].items():
        prefix = f"{key}.state.{template.fqns[idx]}."
        if not any(k.startswith(prefix) for k in available):
            continue  # no state for this parameter in the checkpoint: start fresh
        state[idx] = {sk: flat.get(prefix + sk, sv) for sk, sv in st.items()}
    groups = []
    for gi, g in enumerate(sd["param_groups"]):
        ng = dict(g)
        for hk in g:
            if hk == "params":
                continue
            fk = f"{key}.param_groups.{gi}.{hk}"
            if fk in flat:
                ng[hk] = flat[fk]
        groups.append(ng)
    load_into_optimizer(template.optimizer, state, groups)


def load_sharded(
    path: Path,
    module: Module,
    optimizers: Mapping[str, Optimizer],
    *,
    strict: bool = True,
    model_key: str = "state_dict",
    weights_only: Optional[bool] = None,
    modules: Optional[Mapping[str, Module]] = None,
) -> dict[str, Any]:
    """Collective: load a sharded checkpoint in place into ``module`` and ``optimizers``.

    ``optimizers`` maps checkpoint keys (``"optimizer_0"``, or Fabric's state keys) to optimizers;
    under ``strict`` a key with no state in the checkpoint raises a ``KeyError``, otherwise that
    optimizer is left as it is. ``modules`` maps keys to other, unsharded modules (Fabric state
    entries saved next to the sharded model: their plain state dicts are in the DCP tensors
    too); they are loaded with the same ``strict`` rules as the model.
    Returns the contents of ``meta.pt``.
    """
    path = Path(path)
    safe = _safe(weights_only)
    modules = modules or {}
    available = _dcp_keys(path, safe)
    present = _top_level_keys(available, list(optimizers) + list(modules))
    for key in optimizers:
        if key not in present and strict:
            raise missing_optimizer_error(
                key, {k.split(".param_groups", 1)[0] for k in available if ".param_groups" in k})

    flat = _model_entries(module, model_key, available, strict)
    extra: dict[str, _ModuleEntries] = {}
    for key, mod in modules.items():
        if key not in present:
            if strict:
                raise KeyError(f"The checkpoint has no state for the module {key!r}; pass "
                               "strict=False to ignore it.")
            continue
        extra[key] = _module_entries(key, mod, available, strict)
        for flat_entries, _ in extra[key].entries.values():
            flat.update(flat_entries)
    templates: dict[str, _OptimizerTemplate] = {}
    for key, opt in optimizers.items():
        if key in present:
            templates[key], opt_flat = _optimizer_template(key, opt, module, available)
            flat.update(opt_flat)

    load(flat, path, weights_only=safe)

    for key, found in extra.items():  # tensors were loaded in place; this also sets objects
        loaded = {name: unflatten_state_dict({k: flat[k] for k in flat_entries}, mapping)[
            f"{key}.{name}"] for name, (flat_entries, mapping) in found.entries.items()}
        found.module.load_state_dict(loaded, strict=False)  # strictness was checked above
    for key, template in templates.items():
        _apply_optimizer(key, template, flat, available)
    return read_side_file(path, weights_only=safe)


def _safe(weights_only: Optional[bool]) -> bool:
    """``None`` (Lightning's and torch's default) means safe loading."""
    return True if weights_only is None else bool(weights_only)


def read_side_file(path: Path, *, weights_only: bool = True) -> dict[str, Any]:
    """``meta.pt`` (the non-tensor part of the checkpoint), verified against the manifest."""
    data = read_verified_file(path, METADATA_FILENAME, what="non-tensor state")
    try:
        return safe_torch_load(io.BytesIO(data), map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        raise CheckpointRefusedError(
            f"Refusing to load {path / METADATA_FILENAME}: {err}. If you trust this checkpoint, "
            "load it with weights_only=False.") from err
    except Exception as err:
        raise CheckpointLoadError(f"{path / METADATA_FILENAME} is damaged "
                                  f"({type(err).__name__}: {err}).") from err
