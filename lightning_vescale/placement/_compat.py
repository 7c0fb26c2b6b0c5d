"""torch functions that build sharded values from full ones, taught ``RaggedShard``.

Design note [ragged-compat]
---------------------------
Two torch entry points cut a full tensor into DTensor shards by placement type, and know only
``Shard``/``Replicate``/``Partial``:

* ``distribute_tensor(full, mesh, placements, *, src_data_rank=0)`` raises "unsupported
  placements" for a ``RaggedShard``. :func:`wrap_distribute_tensor` answers ragged placements
  (``(RaggedShard,)``, or one ``RaggedShard`` and ``Replicate()`` elsewhere on an N-D mesh,
  design note [ragged-nd]) and passes every other call to torch unchanged: with
  ``src_data_rank`` set, that rank's ``full`` is broadcast first (along each mesh dim, as
  torch does; into a temporary on the other ranks: the caller's tensor is not overwritten),
  then every rank keeps the flat range of its coordinate on the ragged dim
  (:func:`local_slice`), as a new leaf DTensor with ``full``'s ``requires_grad``.
* ``torch.distributed._state_dict_utils._distribute_tensors`` (behind
  ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
  broadcast_from_rank0=True))``) cuts each broadcast full tensor with
  ``compute_local_shape_and_global_offset``, a box, which a ragged range is not.
  :func:`wrap_distribute_tensors` copies the ragged entries' ranges straight into the existing
  local tensors (for sharded parameters: the DBuffer shard; for FSDP + TP's ``(..., RaggedShard,
  Shard(k))`` the ranges of the TP-local box, design note [ragged-tp]) and leaves the rest to
  torch. torch
  broadcasts one full tensor at a time, so a rank holds at most one full tensor beside its
  shards, as with FSDP2.

``install()`` (``_install``) teaches torch's ``distribute_tensor`` *function object itself*
(:func:`teach_distribute_tensor`), so every name bound to it sees ragged placements, whatever
the import order: ``from torch.distributed.tensor import distribute_tensor`` at the top of a
script, before ``lightning_vescale`` is imported, is the usual order (FSDP2's rank-0 broadcast
recipe for meta-device init does exactly this), and rebinding module attributes is not seen by
such callers. Why not a hook on the placement: torch 2.13's ``distribute_tensor`` dispatches
with ``isinstance`` against ``Shard``/``_StridedShard``/``Replicate``/``Partial`` and calls no
method of any other placement (the one instance hook, ``Partial._partition_value``, is reached
only by a ``Partial``); making ``RaggedShard`` a ``Partial`` (or a ``Shard``,
``shared/TESTING.md``) subclass would make the rest of torch treat it as a pending reduction (or
a box shard) with no error. So the function's code is swapped for a two-line trampoline that
calls :func:`wrap_distribute_tensor` around a copy of torch's original code; signature,
defaults, name and identity (``torch.distributed.tensor.distribute_tensor is
_api.distribute_tensor``) are unchanged. ``_state_dict_utils._distribute_tensors`` is private
and looked up on its module, so rebinding that attribute (:func:`wrap_distribute_tensors`) is
seen by every caller.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_vescale.placement._common import has_ragged, has_ragged_placement
from lightning_vescale.placement._ragged_tp import is_tp_layout, tp_local_box
from lightning_vescale.placement._ragged_shard import (
    RaggedShard,
    local_slice,
    ragged_from_local,
    ragged_mesh_dim,
)

__all__ = [
    "distribute_ragged",
    "teach_distribute_tensor",
    "wrap_distribute_tensor",
    "wrap_distribute_tensors",
]


def _the_ragged(placements: Sequence[Any], mesh: DeviceMesh, what: str
                ) -> tuple[int, RaggedShard]:
    """The ragged mesh dim of ``placements`` and its ``RaggedShard`` (design note [ragged-nd]:
    one ``RaggedShard``, ``Replicate()`` on every other mesh dim)."""
    placements = tuple(placements)
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{what}: {len(placements)} placements {placements} for a {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)}; pass one placement per mesh dim.")
    dim = ragged_mesh_dim(placements, f"{what} with a RaggedShard placement")
    return dim, placements[dim]


def _local_piece(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Any, ...]
                 ) -> torch.Tensor:
    """This rank's flat range of ``full`` under ragged ``placements``: of the TP-local region
    for ``(..., RaggedShard, Shard(k))`` (design note [ragged-tp]), else of ``full``."""
    if len(placements) == mesh.ndim and is_tp_layout(placements, placements):
        dim = next(d for d, p in enumerate(placements) if isinstance(p, RaggedShard))
        region, offset = tp_local_box(tuple(full.shape), mesh, placements, dim)
        full = full[tuple(slice(o, o + n) for o, n in zip(offset, region))]
        placement = placements[dim]
    else:
        dim, placement = _the_ragged(placements, mesh, "set_model_state_dict")
    return local_slice(full, placement, mesh.get_local_rank(dim))


def distribute_ragged(tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Any], *,
                      src_data_rank: int | None = 0) -> DTensor:
    """``distribute_tensor`` for ragged placements (design note [ragged-compat]).

    ``placements`` holds one ``RaggedShard`` and ``Replicate()`` on every other mesh dim. As in
    torch, ``src_data_rank`` is a rank *within each mesh dim*: the data of the rank at mesh
    coordinate ``(src_data_rank, ..., src_data_rank)`` is broadcast along every dim in turn
    (torch replicates along a dim with a broadcast from ``group_src=src_data_rank`` and shards
    with a scatter from it, which reads the same data).
    """
    placements = tuple(placements)
    tp = len(placements) == mesh.ndim and is_tp_layout(placements, placements)
    if tp:  # (RaggedShard, Shard(k)): ranges of the TP-local region (design note [ragged-tp])
        dim = next(d for d, p in enumerate(placements) if isinstance(p, RaggedShard))
        placement = placements[dim]
    else:
        dim, placement = _the_ragged(placements, mesh, "distribute_tensor")
    if isinstance(tensor, DTensor):
        if tensor.device_mesh == mesh and tuple(tensor.placements) == placements:
            return tensor
        raise ValueError(f"Cannot distribute a DTensor with placements {tensor.placements} to "
                         f"{placements}; call .redistribute(...) instead.")
    if not tensor.is_leaf:
        raise RuntimeError("`distribute_tensor` should be used to distribute leaf tensors! but "
                           "found non-leaf tensor!")
    full = tensor.detach()
    if full.device.type != mesh.device_type and not full.is_meta:
        full = full.to(mesh.device_type)
    shape = tuple(full.shape)
    region_shape, offset = tp_local_box(shape, mesh, placements, dim) if tp else (shape, None)
    placement.validate(region_shape, mesh.size(dim))
    if src_data_rank is not None and not full.is_meta:
        buf = full.contiguous()  # may alias the caller's tensor: only ever sent, never written
        for d in range(mesh.ndim):
            if mesh.size(d) == 1:
                continue
            group = mesh.get_group(d)
            if mesh.get_local_rank(d) != src_data_rank:  # receive into a temporary
                buf = torch.empty_like(full, memory_format=torch.contiguous_format)
            dist.broadcast(buf, src=dist.get_global_rank(group, src_data_rank), group=group)
        full = buf
    if offset is not None:
        full = full[tuple(slice(o, o + s) for o, s in zip(offset, region_shape))]
    local = local_slice(full, placement, mesh.get_local_rank(dim)).clone()
    out = ragged_from_local(local, mesh, placements, shape, autograd=False, check=False)
    return out.requires_grad_(tensor.requires_grad)


def wrap_distribute_tensor(original: Callable[..., DTensor]) -> Callable[..., DTensor]:
    """torch's ``distribute_tensor`` with ragged placements answered by
    :func:`distribute_ragged`; every other call goes to ``original`` unchanged."""

    @functools.wraps(original)
    def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                          placements: Sequence[Any] | None = None, *,
                          src_data_rank: int | None = 0) -> DTensor:
        if placements is not None and has_ragged_placement(placements):
            if device_mesh is None:
                raise ValueError("distribute_tensor with a RaggedShard placement needs an "
                                 "explicit device_mesh (e.g. param.device_mesh).")
            return distribute_ragged(tensor, device_mesh, placements,
                                     src_data_rank=src_data_rank)
        if isinstance(tensor, DTensor) and has_ragged_placement(tensor.placements):
            # e.g. parallelize_module on a module fully_shard already sharded ([fsdp-tp])
            raise ValueError(
                f"distribute_tensor: a tensor already sharded by lightning_vescale's fully_shard "
                f"(placements {tuple(tensor.placements)}) cannot be distributed to "
                f"{placements} on {device_mesh}. A tensor-parallel plan must be applied before "
                "fully_shard (parallelize_module(model, mesh['tp'], plan), then fully_shard(..., "
                "mesh=mesh['dp'])), as with FSDP2 + TP.")
        return original(tensor, device_mesh, placements, src_data_rank=src_data_rank)

    distribute_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    return distribute_tensor


def wrap_distribute_tensors(original: Callable[..., None]) -> Callable[..., None]:
    """torch's ``_state_dict_utils._distribute_tensors`` with ragged entries (``(local DTensor,
    full tensor)`` pairs) cut here; the others go to ``original``."""

    @functools.wraps(original)
    def _distribute_tensors(local_state_dict: dict[str, Any], keys: list[str],
                            device: torch.device, pg: Any = None) -> None:
        for key in keys:
            entry = local_state_dict.get(key)
            if not (isinstance(entry, tuple) and len(entry) == 2
                    and isinstance(entry[0], DTensor) and has_ragged(entry[0]._spec)):
                continue
            local_state, full = entry
            mesh = local_state.device_mesh
            piece = _local_piece(full, mesh, tuple(local_state.placements))
            if local_state.is_meta:
                local_state_dict[key] = ragged_from_local(
                    piece.detach().clone(), mesh, local_state._spec.placements,
                    tuple(local_state.shape), autograd=False, check=False)
            else:
                with torch.no_grad():
                    local_state._local_tensor.copy_(piece)
                local_state_dict[key] = local_state
        return original(local_state_dict, keys, device, pg)

    _distribute_tensors.__wrapped__ = original  # type: ignore[attr-defined]
    return _distribute_tensors



#: The name, in torch's ``_api`` module, of the ragged-aware ``distribute_tensor`` that the
#: trampoline calls (a new attribute; nothing of torch's is rebound).
_IMPL_NAME = "_lightning_vescale_distribute_tensor"


def _trampoline(tensor, device_mesh=None, placements=None, *, src_data_rank=0):
    # Runs with torch's ``_api`` globals (its code replaces distribute_tensor's own).
    return _lightning_vescale_distribute_tensor(  # noqa: F821
        tensor, device_mesh, placements, src_data_rank=src_data_rank)


def teach_distribute_tensor(fn: types.FunctionType) -> bool:
    """Make torch's ``distribute_tensor`` function object ``fn`` answer ragged placements in
    place (design note [ragged-compat]); every other call runs torch's original code.

    Idempotent. Returns True when ``fn`` is taught (now or before); False, changing nothing,
    when its signature is not the one the trampoline forwards (another torch): the caller then
    falls back to rebinding module attributes.
    """
    if _IMPL_NAME in fn.__globals__ and fn.__code__.co_filename == __file__:
        return True
    params = fn.__code__.co_varnames[:fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    if params != ("tensor", "device_mesh", "placements", "src_data_rank") or fn.__closure__:
        return False
    original = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
    original.__kwdefaults__ = dict(fn.__kwdefaults__ or {})
    original.__qualname__ = fn.__qualname__
    original.__module__ = fn.__module__
    original.__doc__ = fn.__doc__
    fn.__globals__[_IMPL_NAME] = wrap_distribute_tensor(original)
    fn.__code__ = _trampoline.__code__.replace(
        co_name=fn.__code__.co_name, co_qualname=fn.__code__.co_qualname,
        co_filename=__file__)
    return True
