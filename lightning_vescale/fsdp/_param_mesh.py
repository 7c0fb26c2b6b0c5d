"""Parameters on a mesh of their own inside one ``fully_shard`` group (expert parallelism).

Design note [fsdp-param-mesh]
-----------------------------
FSDP2's ``shard_placement_fn`` may return ``ShardPlacementResult(placement, mesh_info)`` on
another mesh than the call's; FSDP2 then keeps one ``FSDPParamGroup`` per mesh in the module's
state. torchtitan does so under expert parallelism
(``torchtitan/distributed/fsdp.py::apply_fsdp_to_decoder``, ``ep_degree > 1``): the routed
experts, already DTensors ``Shard(0)`` on the ``"ep"`` mesh (``model.parallelize``), go to the
``"efsdp"`` mesh (the expert-data-parallel complement of ``ep``), the rest of the block to the
dense ``"fsdp"`` mesh.

Here the call stays *one* :class:`~lightning_vescale.fsdp._param_group.ParamGroup` with one
DBuffer per (bucket, mesh): the parameters of another mesh are bucketed apart (the buffer key
gains ``("mesh", <that mesh's dim names>)``, the same on every rank), planned for that mesh's
size, and their DBuffer runs its all-gather and reduce-scatter on that mesh's process group
(each DBuffer already carries its :class:`~lightning_vescale.mesh.MeshInfo`). One group rather
than FSDP2's group per mesh because everything else is per call here and stays right: the
hooks, the backward completion ([fsdp-backward-completion]), the prefetch orders and the
``FSDPModule`` setters torchtitan calls (``set_gradient_divide_factor``,
``set_modules_to_forward_prefetch``, ...). The schedule is FSDP2's: the experts gather with
their block when it runs forward and reduce with it at the end of its backward.

A parameter of another mesh that is a DTensor on a further mesh (the experts on ``"ep"``) is a
tensor-parallel parameter of design note [fsdp-tp] whose data-parallel mesh is its own: its
ep-local tensor is planned and sharded on ``"efsdp"``; the sharded parameter is a DTensor on the
2-D ``("efsdp", "ep")`` mesh (FSDP2's ``DeviceMesh._concatenate`` of the two when the root
mesh has no such dims: torchtitan unflattens them) with placements ``(RaggedShard, Shard(0))``
(``full_tensor()`` composes both, [ragged-tp]); the unsharded one is the ``"ep"`` DTensor the
model expects. Built on the meta device (torchtitan's trainer flow), both stay on meta with
their DBuffer until ``to_empty()``; ``init_weights()`` then draws one process's values into
each rank's part ([fsdp-tp], [ragged-random]).

With HSDP (torchtitan's ``dp_replicate > 1``) both meshes are 2-D ``(replicate, shard)``:
``("dp_replicate", "fsdp")`` for the group and FSDP2's ``HSDPMeshInfo`` on
``("dp_replicate", "efsdp")`` for the experts. The experts' DBuffer then has an HSDP
:class:`~lightning_vescale.mesh.MeshInfo` of its own (reduce-scatter over ``"efsdp"``,
all-reduce over ``"dp_replicate"``, as every HSDP buffer: design note [hsdp]), and their
sharded parameter is a DTensor on the 3-D ``("dp_replicate", "efsdp", "ep")`` mesh with
``(Replicate(), RaggedShard, Shard(0))`` (design note [fsdp-tp]'s HSDP + TP form). A
per-parameter HSDP mesh requires the group's mesh to replicate too (as torchtitan's always
does), so that ``set_requires_all_reduce`` means the same for every buffer of the group.

Gradients are reduced per buffer on its own mesh: ``AVG`` over it by default (as each of
FSDP2's per-mesh groups does), ``set_force_sum_reduction_for_comms`` divides by its own mesh's
size, ``set_gradient_divide_factor(f)`` divides every buffer by ``f`` (torchtitan sets 1.0 and
scales the loss itself). The gradient-flag all-reduce of the root spans the group's own
(widest) mesh, which holds every parameter's structural position on every rank.

Refused, naming the parameter (:func:`refuse_unsupported`, :func:`own_mesh_info`): a mesh of
its own of more than 2 dims, or with FSDP2's (shard, replicate) dim order, an HSDP one beside a
group mesh that does not replicate, a mesh of another device type, and together with
``comm_policy``, ``offload_policy`` or ``reshard_after_forward=<int>``. With ``dp_mesh_dims``
(torchtitan's default ``spmd_types`` backend with ``ep > 1``) each result's ``mesh_info``
already holds its data-parallel mesh (FSDP2's ``_get_mesh_info`` flattened it from the named
dims), so it is taken as is; the parameters are then plain tensors (the experts ep-local ones),
and a DTensor off the SPMD mesh (``full_dtensor``'s experts) is refused by
:func:`~lightning_vescale.fsdp._shard_placement.local_value`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.mesh import MeshInfo

__all__ = ["OWN_MESH_PARAMS", "TP_PARAMS", "own_mesh_info", "param_mesh_keys",
           "refuse_unsupported"]


def own_mesh_info(name: str, mesh: DeviceMesh, group_mesh: DeviceMesh) -> MeshInfo:
    """The :class:`MeshInfo` of parameter ``name``'s own ``mesh``: 1-D (FSDP) or 2-D
    ``(replicate, shard)`` (HSDP, torchtitan's ``("dp_replicate", "efsdp")``).

    Raises:
        NotImplementedError: ``mesh`` has more than 2 dims, another device type than the
            group's, or replicates (HSDP) while the group's mesh does not.
    """
    if mesh.ndim not in (1, 2):
        raise NotImplementedError(
            f"parameter {name!r}: shard_placement_fn gave it a {mesh.ndim}-D mesh of its own "
            f"({mesh}); lightning_vescale's fully_shard takes 1-D (FSDP) or 2-D (replicate, "
            "shard) per-parameter meshes.")
    if mesh.device_type != group_mesh.device_type:
        raise NotImplementedError(
            f"parameter {name!r}: its mesh from shard_placement_fn is on "
            f"{mesh.device_type!r}, the group's on {group_mesh.device_type!r}; build both "
            "meshes on one device type.")
    info = MeshInfo.from_mesh(mesh)
    if info.is_hsdp and not (group_mesh.ndim == 2 and group_mesh.size(0) > 1):
        raise NotImplementedError(
            f"parameter {name!r}: shard_placement_fn gave it an HSDP mesh of its own ({mesh}) "
            f"in a group whose mesh ({group_mesh}) does not replicate; replicate both (as "
            "torchtitan does with dp_replicate > 1: ('dp_replicate', 'fsdp') and "
            "('dp_replicate', 'efsdp')) or neither.")
    return info


#: ``refuse_unsupported``'s ``params`` (what they are, the fix) for tensor-parallel
#: parameters (design note [fsdp-tp])
TP_PARAMS = ("tensor-parallel parameters", "drop the option or the TP plan")
#: ... and for parameters on a mesh of their own (this note)
OWN_MESH_PARAMS = ("parameters on a mesh of their own from shard_placement_fn",
                   "expert parallelism: drop the option, or return the group's mesh for them")


def refuse_unsupported(names: Sequence[str], params: tuple[str, str], *, offload: Any,
                       reshard_after_forward: Any, comm: Any = None) -> None:
    """Refuse the ``fully_shard`` options not supported yet with the parameters ``names``,
    which live on a mesh beyond the group's: tensor-parallel ones (``params=TP_PARAMS``, design
    note [fsdp-tp]) or ones on a mesh of their own (``OWN_MESH_PARAMS``, this note).
    ``params``: ``(what they are, what to do)`` for the message, which names the option and the
    first parameter. ``comm``: the resolved comm policy where it is refused (``None``: not
    refused, or inactive; TP parameters take one: their buffers hold the TP-local tensors).

    Raises:
        NotImplementedError: CPU offload, ``comm`` or an int ``reshard_after_forward`` with
            ``names`` non-empty.
    """
    if not names:
        return
    what = None
    if offload is not None:
        what = "offload_policy=CPUOffloadPolicy (CPU offload)"
    elif comm is not None:
        what = "comm_policy (quantized all-gather / gradient wire dtype)"
    elif isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        what = f"reshard_after_forward={reshard_after_forward}"
    if what is not None:
        kind, fix = params
        raise NotImplementedError(
            f"fully_shard: {what} is not supported yet with {kind} ({names[0]!r}"
            f"{' and others' if len(names) > 1 else ''}); {fix}.")


def param_mesh_keys(params: Sequence[Any]) -> dict[str, tuple[str, str]]:
    """``name -> ("mesh", label)`` for the parameters on a mesh of their own: the buffer-key
    suffix of their DBuffer. ``label`` is the mesh's dim names (the same on every rank, unlike
    its ranks), or ``#k`` in the order the meshes are first met; distinct meshes get distinct
    labels."""
    labels: dict[tuple, str] = {}
    out = {}
    for mp in params:
        info = mp.mesh_info
        if info is None:
            continue
        key = (info.mesh.mesh_dim_names, tuple(info.mesh.mesh.flatten().tolist()))
        if key not in labels:
            label = "/".join(info.mesh.mesh_dim_names or ()) or f"#{len(labels)}"
            if label in labels.values():
                label = f"{label}#{len(labels)}"
            labels[key] = label
        out[mp.name] = ("mesh", labels[key])
    return out
