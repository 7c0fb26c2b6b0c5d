"""Layer 5 (private): checkpoint helpers shared by the Trainer strategy and the Fabric strategy.

Design note [checkpoint-formats]
--------------------------------
Two formats, both keyed by the module's ``state_dict()`` names (FQNs):

*Sharded* (default) — a directory written by every rank in parallel with
``torch.distributed.checkpoint`` (DCP), no gather anywhere:

* ``<dir>/.metadata`` + ``<dir>/__<rank>_0.distcp``: the tensors. Top-level keys are
  ``"state_dict"`` (the module's state dict: ``RaggedShard`` ``DTensor`` parameters, whose DCP
  chunks are the at most ``2d - 1`` rectangles of each rank's flat range, see
  ``placement/_dtensor.py`` E3) and ``"optimizer_<i>"`` (the optimizer's own ``state_dict()``
  re-keyed from parameter indices to FQNs, so the file does not depend on parameter order).
  DCP records global shapes and chunk offsets, so any world size / layout can load it
  (resharding is DCP's read planning).
* ``<dir>/meta.pt``: everything else of the Lightning checkpoint (loops, callbacks, schedulers,
  precision scaler, hyper-parameters), written by rank 0 — Lightning's own sharded layout.

*Full* — one ``torch.save`` file from rank 0 in the plain single-process format: ``state_dict``
holds full tensors under the same FQNs, optimizer states are the optimizer's ``state_dict()``
with full tensors and integer keys (parameter order). A plain ``nn.Module``/DDP run can load it.

Loading either format into a sharded module never materialises more than one full tensor per
rank at a time (full files are ``mmap``-ed and sliced to the rank's range).

Atomicity: a save writes into a hidden temporary sibling (``.<name>.tmp-<token>``); after a
barrier, rank 0 renames it onto the final name (a file: one ``os.replace``; a directory: the old
one is first renamed aside to ``.<name>.old-<token>``, then removed; if the second rename fails
the old one is renamed back). An interrupted save therefore leaves the previous checkpoint at
that path untouched. Only a process killed between the two directory renames leaves the name
empty; loading then points to the ``.old-``.

Cleanup of failed saves: a save that *fails* (raises) removes its temporary itself, on rank 0
and without any extra collective: DCP reports a write failure of any rank to every rank through
its own gather/broadcast, so when ``dcp.save`` raises on rank 0 every rank has finished writing
(or its process is gone); the full format and the publish step are rank 0's alone. A save that
is *killed* cannot clean up: its hidden temporary is removed by the next save to the same name
or by :func:`remove_checkpoint` (which the strategy's ``remove_checkpoint`` uses, so rotating
``ModelCheckpoint`` names do not pile them up).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_vescale.placement import RaggedShard

__all__ = [
    "METADATA_FILENAME",
    "is_sharded_checkpoint",
    "is_full_checkpoint",
    "check_checkpoint_path",
    "model_state",
    "optimizer_state",
    "save_sharded",
    "save_full",
    "load_sharded",
    "load_full_model_state",
    "load_full_optimizer_state",
    "consolidate",
    "remove_checkpoint",
]

METADATA_FILENAME = "meta.pt"  # same name as Lightning's ModelParallel/FSDP strategies
_DCP_METADATA = ".metadata"


# ------------------------------------------------------------------------------------------------
# Paths
# ------------------------------------------------------------------------------------------------
def is_sharded_checkpoint(path: Path) -> bool:
    """A directory with DCP metadata and Lightning's ``meta.pt``."""
    path = Path(path)
    return path.is_dir() and (path / _DCP_METADATA).is_file()


def is_full_checkpoint(path: Path) -> bool:
    return Path(path).is_file()


def check_checkpoint_path(path: Path) -> Path:
    """Raise a clear error unless ``path`` is a checkpoint in one of our two formats."""
    path = Path(path)
    if not path.exists():
        aside = _hidden_siblings(path, "old")
        hint = (f" A previous checkpoint moved aside by an interrupted save exists at "
                f"{str(aside[-1])!r}: rename it to {path.name!r} to use it.") if aside else ""
        raise FileNotFoundError(
            f"Checkpoint path {str(path)!r} does not exist. Pass the path of a checkpoint file "
            f"(state_dict_type='full') or directory (state_dict_type='sharded').{hint}"
        )
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise ValueError(
            f"The path {str(path)!r} is a directory but not a sharded checkpoint (it has no "
            f"{_DCP_METADATA!r} file). Point to a directory written by the vescale_fsdp strategy "
            "or to a single full checkpoint file."
        )
    return path


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_object(obj: Any) -> Any:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _hidden_siblings(path: Path, kind: str) -> list[Path]:
    """The ``.<name>.<kind>-<token>`` siblings of ``path`` (``kind``: ``"tmp"`` or ``"old"``)."""
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.{kind}-*"))


def _remove_path(path: Path) -> None:
    """Remove a file, link or directory tree; a missing path is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _discard(path: Path) -> None:
    """Best-effort :func:`_remove_path` (cleanup must never mask the error being handled)."""
    try:
        _remove_path(path)
    except OSError:
        pass


def remove_checkpoint(path: Any) -> None:
    """Remove the checkpoint at ``path`` (a full file or a sharded directory) together with the
    hidden ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings that failed or interrupted saves to
    that name left behind.

    Not a collective: call it on one rank (global rank 0), like Lightning's
    ``Strategy.remove_checkpoint``. A missing ``path`` is not an error; an error removing
    ``path`` itself is raised, the siblings are removed on a best-effort basis.
    """
    path = Path(path)
    siblings = _hidden_siblings(path, "tmp") + _hidden_siblings(path, "old")
    _remove_path(path)
    for stale in siblings:
        _discard(stale)


def _temp_sibling(path: Path, kind: str) -> Path:
    token = _broadcast_object(uuid.uuid4().hex[:10])
    return path.with_name(f".{path.name}.{kind}-{token}")


def _publish(tmp: Path, final: Path) -> None:
    """Rank 0: move the finished ``tmp`` onto ``final`` without ever corrupting ``final``."""
    if final.exists() and (final.is_dir() or tmp.is_dir()):
        old = _temp_sibling_local(final, "old")
        os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            os.replace(old, final)  # put the previous checkpoint back: never leave the name empty
            raise
        _discard(old)
    else:
        os.replace(tmp, final)  # atomic for files (and for a new directory name)
    try:  # leftovers of killed saves; best effort: this must not fail a save that succeeded
        for stale in _hidden_siblings(final, "tmp"):
            _discard(stale)
    except OSError:
        pass


def _temp_sibling_local(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{uuid.uuid4().hex[:10]}")


# ------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------
def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: Any, cpu: bool = True) -> Any:
    """The full tensor of a ``DTensor`` (collective over its mesh), else ``t`` itself."""
    if _is_dtensor(t):
        t = t.full_tensor()
    if cpu and isinstance(t, Tensor):
        t = t.detach().cpu()
    return t


@torch.no_grad()
def _copy_full_into(target: Tensor, full: Tensor, name: str) -> None:
    """Write the rank's part of ``full`` into ``target`` (a DTensor or a plain tensor)."""
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {tuple(full.shape)} but the model/optimizer "
            f"expects {tuple(target.shape)}; was the checkpoint written for another model?"
        )
    if not _is_dtensor(target):
        target.copy_(full)
        return
    from torch.distributed.tensor import DTensor, Replicate

    local = target.to_local()
    mesh, placements = target.device_mesh, target.placements
    if mesh.ndim == 1 and isinstance(placements[0], RaggedShard):
        start, end = placements[0].local_range(tuple(target.shape), mesh.get_local_rank(0))
        local.view(-1).copy_(full.reshape(-1)[start:end])
        return
    src = DTensor.from_local(full.to(device=local.device, dtype=local.dtype), mesh,
                             [Replicate()] * mesh.ndim, run_check=False)
    local.copy_(src.redistribute(mesh, placements).to_local())


# ------------------------------------------------------------------------------------------------
# State dicts
# ------------------------------------------------------------------------------------------------
def _param_fqns(module: Module) -> dict[int, str]:
    """``id(param) -> FQN`` (first name of tied parameters, as ``named_parameters`` gives it)."""
    return {id(p): name for name, p in module.named_parameters()}


def model_state(module: Module, *, full: bool) -> dict[str, Any]:
    """The module's state dict: sharded (DTensors, no communication) or full.

    ``full=True`` gathers one tensor at a time (a collective: call on every rank) and returns
    CPU tensors on rank 0 and ``{}`` elsewhere.
    """
    sd = module.state_dict()
    if not full:
        return sd
    out = {k: _full(v) if isinstance(v, Tensor) else v for k, v in sd.items()}
    return out if _rank() == 0 else {}


def _index_to_fqn(module: Module, optimizer: Optimizer) -> dict[int, str]:
    fqns = _param_fqns(module)
    mapping: dict[int, str] = {}
    for idx, p in enumerate(itertools.chain.from_iterable(g["params"] for g in
                                                          optimizer.param_groups)):
        if id(p) not in fqns:
            raise ValueError(
                "An optimizer holds a parameter that is not a parameter of the model; create the "
                "optimizer from the sharded model's parameters (in `configure_optimizers`, or "
                "after `setup_module` with Fabric)."
            )
        mapping[idx] = fqns[id(p)]
    return mapping


def optimizer_state(module: Module, optimizer: Optimizer, *, full: bool) -> dict[str, Any]:
    """The optimizer's ``state_dict()``, sharded (keyed by FQN) or full (keyed by index).

    Sharded: ``{"state": {fqn: {...DTensors...}}, "param_groups": [{..., "params": [fqn]}]}``.
    Full: the plain torch format with full CPU tensors on rank 0 (``{}`` elsewhere); a
    collective, call on every rank.
    """
    sd = optimizer.state_dict()
    if full:
        state = {idx: {k: _full(v) if isinstance(v, Tensor) else v for k, v in s.items()}
                 for idx, s in sd["state"].items()}
        return {"state": state, "param_groups": sd["param_groups"]} if _rank() == 0 else {}
    fqn = _index_to_fqn(module, optimizer)
    return {
        "state": {fqn[idx]: dict(s) for idx, s in sd["state"].items()},
        "param_groups": [{**g, "params": [fqn[i] for i in g["params"]]}
                         for g in sd["param_groups"]],
    }


# ------------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------------
def _rank0_agreed(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 and make every rank agree on whether it worked.

    A failure on rank 0 must not leave the other ranks waiting in a later collective: the
    outcome is all-reduced, rank 0 re-raises its error and the others raise a pointer to it.
    """
    out, error = None, None
    if _rank() == 0:
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the agreement
            error = e
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        if dist.get_backend() == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    else:
        failed = error is not None
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"Rank 0 failed to {what}; see its traceback.")
    return out


def _serialize(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save_sharded(path: Path, tensors: dict[str, Any], metadata: dict[str, Any]) -> None:
    """Collective: write ``tensors`` with DCP and ``metadata`` to ``meta.pt``, atomically."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint(path) and any(path.iterdir()):
        raise IsADirectoryError(
            f"The checkpoint path {str(path)!r} is an existing non-empty directory that is not a "
            "sharded checkpoint; refusing to replace it. Choose another path."
        )
    tmp = _temp_sibling(path, "tmp")

    def prepare() -> bytes:
        data = _serialize(metadata)  # fail early (before any file is written) if unpicklable
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        return data

    meta_bytes = _rank0_agreed(prepare, f"prepare the checkpoint directory {tmp}")
    try:  # DCP propagates any rank's write error to all ranks (as a BaseException)
        dcp.save(tensors, checkpoint_id=tmp)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise  # raised outside DCP's agreement: other ranks may still be writing into tmp
        # DCP raises only after its gather of every rank's write result and the broadcast of
        # the outcome, so no live rank writes into tmp any more: rank 0 (DCP's coordinator)
        # removes it, no collective needed (see the design note above).
        if _rank() == 0:
            _discard(tmp)
        raise RuntimeError(
            f"Saving the sharded checkpoint {str(path)!r} failed; any previous checkpoint at that "
            f"path is untouched and the partial write was removed. Cause: {e}"
        ) from e

    def publish() -> None:
        try:
            (tmp / METADATA_FILENAME).write_bytes(meta_bytes)
            _publish(tmp, path)
        except BaseException:
            _discard(tmp)  # only rank 0 touches tmp now (DCP finished on every rank)
            raise

    _rank0_agreed(publish, f"publish the checkpoint at {path}")


def save_full(path: Path, checkpoint: dict[str, Any]) -> None:
    """Collective: rank 0 writes ``checkpoint`` (already gathered) to one file, atomically."""
    path = Path(path)
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
    tmp = _temp_sibling(path, "tmp")

    def write() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.save(checkpoint, tmp)
            _publish(tmp, path)
        except BaseException:
            _discard(tmp)  # rank 0 alone writes the full format
            raise

    _rank0_agreed(write, f"write the checkpoint {path}")


# ------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------
def _strict_check(missing: Iterable[str], unexpected: Iterable[str], strict: bool,
                  what: str = "the model") -> None:
    missing, unexpected = sorted(missing), sorted(unexpected)
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading the checkpoint into {what} (strict=True):\n"
            f"  missing keys: {missing}\n  unexpected keys: {unexpected}\n"
            "Pass strict_loading=False (LightningModule.strict_loading / Fabric "
            "load(strict=False)) "
            "to ignore them."
        )


def _init_optim_state(optimizer: Optimizer) -> None:
    """Create the optimizer's states: its own ``init_state()`` if it has one, else a
    zero-gradient, zero-lr step (as DCP does).

    Zero gradients are built from each parameter's local tensor, so this needs no DTensor op
    support beyond ``from_local``.
    """
    from torch.distributed.tensor import DTensor

    if optimizer.state:
        return
    init_state = getattr(optimizer, "init_state", None)  # e.g. lightning_vescale.optim.Muon
    if callable(init_state):
        init_state()
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        if isinstance(p, DTensor):
            p.grad = DTensor.from_local(torch.zeros_like(p.to_local()), p.device_mesh,
                                        p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
        else:
            p.grad = torch.zeros_like(p)
    lrs = []
    for g in optimizer.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = lrs.pop(0)
        optimizer.zero_grad(set_to_none=True)


def _dcp_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys())


def _flatten(prefix: str, obj: Any, out: dict[str, Any]) -> None:
    """DCP's key flattening (dicts by ``.``-joined keys; lists of non-tensors are leaves)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({prefix: obj})
    out.update(flat)


def missing_optimizer_error(key: str, saved: Iterable[str]) -> KeyError:
    """The error for a requested optimizer whose key has no state in the checkpoint (strict);
    ``saved``: the keys the checkpoint does hold optimizer states under."""
    return KeyError(
        f"The checkpoint has no optimizer state under {key!r} (it has optimizer states under "
        f"{sorted(saved)}). Load the optimizer under the key it was saved with, or pass "
        "strict=False to leave the optimizer as it is."
    )


def _top_level_keys(flat_keys: Iterable[str], requested: Iterable[str]) -> set[str]:
    """The ``requested`` keys that have at least one entry among DCP's flattened keys."""
    flat_keys = list(flat_keys)
    return {k for k in requested if any(f == k or f.startswith(f"{k}.") for f in flat_keys)}


def sharded_checkpoint_has(path: Path, keys: Iterable[str]) -> set[str]:
    """Which of ``keys`` (top-level state keys) a sharded checkpoint holds tensors/objects for."""
    return _top_level_keys(_dcp_keys(Path(path)), keys)


def count_sharded_optimizers(path: Path) -> int:
    keys = _dcp_keys(path)
    return len({k.split(".", 1)[0] for k in keys if k.startswith("optimizer_")})


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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    path = Path(path)
    available = _dcp_keys(path)
    present = _top_level_keys(available, list(optimizers) + list(modules or {}))
    for key in optimizers:
        if key not in present and strict:
            raise missing_optimizer_error(
                key, {k.split(".param_groups", 1)[0] for k in available if ".param_groups" in k})
    optimizers = {k: v for k, v in optimizers.items() if k in present}

    # -- model: load straight into the parameters' local shards (state_dict() shares storage) --
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
    _strict_check(missing, unexpected, strict)

    # -- other (unsharded) modules: their plain state dicts, loaded like the model -------------
    extra: dict[str, tuple[Module, dict[str, tuple[dict[str, Any], Any]]]] = {}
    for key, mod in (modules or {}).items():
        if key not in present:
            if strict:
                raise KeyError(f"The checkpoint has no state for the module {key!r}; pass "
                               "strict=False to ignore it.")
            continue
        entries, covered, m_missing = {}, set(), []
        for name, value in mod.state_dict().items():
            flat_e, mapping = flatten_state_dict({f"{key}.{name}": value})
            covered.update(flat_e)
            if flat_e and all(k in available for k in flat_e):
                entries[name] = (flat_e, mapping)
                flat.update(flat_e)
            else:
                m_missing.append(name)
        m_unexpected = [k[len(key) + 1:] for k in available
                        if k.startswith(f"{key}.") and k not in covered]
        _strict_check(m_missing, m_unexpected, strict, what=f"the module {key!r}")
        extra[key] = (mod, entries)

    # -- optimizers: templates from their own state_dict(), keyed by FQN ----------------------
    templates: dict[str, tuple[Optimizer, dict[str, Any], dict[int, str]]] = {}
    for key, opt in optimizers.items():
        _init_optim_state(opt)
        sd = opt.state_dict()
        idx2fqn = _index_to_fqn(module, opt)
        templates[key] = (opt, sd, idx2fqn)
        for idx, st in sd["state"].items():
            for sk, sv in st.items():
                fk = f"{key}.state.{idx2fqn[idx]}.{sk}"
                if fk in available:
                    flat[fk] = sv
        groups = {f"{key}.param_groups": [dict(g) for g in sd["param_groups"]]}
        gflat: dict[str, Any] = {}
        _flatten(f"{key}.param_groups", groups[f"{key}.param_groups"], gflat)
        flat.update({k: v for k, v in gflat.items() if k in available})

    dcp.load(flat, checkpoint_id=path)

    for key, (mod, entries) in extra.items():  # tensors were loaded in place; this also sets
        loaded = {name: unflatten_state_dict({k: flat[k] for k in flat_e}, mapping)[  # objects
            f"{key}.{name}"] for name, (flat_e, mapping) in entries.items()}
        mod.load_state_dict(loaded, strict=False)  # strictness was checked above

    # -- write back non-in-place values and hand the templates to the optimizers --------------
    for key, (opt, sd, idx2fqn) in templates.items():
        state = {}
        for idx, st in sd["state"].items():
            prefix = f"{key}.state.{idx2fqn[idx]}."
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
        dropped = [p for i, p in enumerate(_params(opt)) if i not in state and p in opt.state]
        opt.load_state_dict({"state": state, "param_groups": groups})
        for p in dropped:
            opt.state.pop(p, None)

    return torch.load(path / METADATA_FILENAME, weights_only=weights_only)


def _params(optimizer: Optimizer) -> list[Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


@torch.no_grad()
def load_full_model_state(state_dict: Mapping[str, Any], module: Module, *,
                          strict: bool = True) -> None:
    """Load a full (single-process) state dict into a sharded module, slicing per rank."""
    msd = module.state_dict()
    missing = [k for k in msd if k not in state_dict]
    unexpected = [k for k in state_dict if k not in msd]
    _strict_check(missing, unexpected, strict)
    for name, target in msd.items():
        if name in state_dict and isinstance(target, Tensor):
            _copy_full_into(target, state_dict[name], name)


@torch.no_grad()
def load_full_optimizer_state(opt_state: Mapping[str, Any], module: Module,
                              optimizer: Optimizer) -> None:
    """Load a full optimizer state dict (plain torch format, index keys) into a sharded
    optimizer."""
    _init_optim_state(optimizer)
    sd = optimizer.state_dict()
    saved_state = opt_state.get("state", {})
    if saved_state and isinstance(next(iter(saved_state)), str):  # FQN-keyed (consolidated)
        fqn2idx = {v: k for k, v in _index_to_fqn(module, optimizer).items()}
        saved_state = {fqn2idx[k]: v for k, v in saved_state.items()}
    state = {}
    for idx, st in sd["state"].items():
        if idx not in saved_state:
            continue
        new = {}
        for sk, sv in st.items():
            if sk not in saved_state[idx]:
                new[sk] = sv
                continue
            value = saved_state[idx][sk]
            if isinstance(sv, Tensor) and (_is_dtensor(sv) or sv.dim() > 0):
                _copy_full_into(sv, value, f"optimizer state {sk} of parameter #{idx}")
                new[sk] = sv
            elif isinstance(sv, Tensor) and isinstance(value, Tensor):
                new[sk] = value.to(device=sv.device, dtype=sv.dtype).reshape(sv.shape)
            else:
                new[sk] = value
        state[idx] = new
    saved_groups = opt_state.get("param_groups", sd["param_groups"])
    if len(saved_groups) != len(sd["param_groups"]):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups but the "
            f"optimizer has {len(sd['param_groups'])}; configure the same parameter groups."
        )
    groups = [{**saved, "params": cur["params"]} for saved, cur in
              zip(saved_groups, sd["param_groups"])]
    dropped = [p for i, p in enumerate(_params(optimizer)) if i not in state]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    for p in dropped:
        optimizer.state.pop(p, None)


# ------------------------------------------------------------------------------------------------
# Offline conversion
# ------------------------------------------------------------------------------------------------
def consolidate(path: Path, *, weights_only: Optional[bool] = False) -> dict[str, Any]:
    """Read a sharded checkpoint directory into one full, plain checkpoint dict (no process group).

    Model tensors come back full under ``"state_dict"``; optimizer states become the plain torch
    format (integer keys in parameter-group order) under ``"optimizer_states"``, so the result can
    be ``torch.save``-d and loaded by a single-process or DDP run. Runs in one process.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = check_checkpoint_path(Path(path))
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is already a single-file (full) checkpoint.")
    md = FileSystemReader(str(path)).read_metadata()
    flat: dict[str, Any] = {}
    for key, meta in md.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            flat[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            flat[key] = None
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    _load_state_dict(flat, storage_reader=FileSystemReader(str(path)),
                     planner=DefaultLoadPlanner(), no_dist=True)
    nested = unflatten_state_dict(flat, md.planner_data) if md.planner_data else flat
    checkpoint = dict(torch.load(path / METADATA_FILENAME, weights_only=weights_only))
    checkpoint["state_dict"] = nested.pop("state_dict", {})
    opt_keys = sorted((k for k in nested if k.startswith("optimizer_")),
                      key=lambda k: int(k.split("_", 1)[1]))
    states = []
    for key in opt_keys:
        osd = nested[key]
        order = [fqn for g in osd["param_groups"] for fqn in g["params"]]
        index = {fqn: i for i, fqn in enumerate(order)}
        groups, start = [], 0
        for g in osd["param_groups"]:
            n = len(g["params"])
            groups.append({**g, "params": list(range(start, start + n))})
            start += n
        states.append({"state": {index[f]: s for f, s in osd.get("state", {}).items()},
                       "param_groups": groups})
    if opt_keys:
        checkpoint["optimizer_states"] = states
    return checkpoint
