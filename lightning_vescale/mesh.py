"""Layer 0: ``MeshInfo``, the one place that knows which process groups shard and replicate.

Design note [mesh-info]
-----------------------
Every layer above needs the same three facts about the data-parallel mesh: the group that
shards (all-gather / reduce-scatter run in it), this rank's index in that group, and (for HSDP)
the group that replicates (gradient shards are all-reduced across it). FSDP2 keeps them in
``FSDPMeshInfo`` / ``HSDPMeshInfo``; we keep them in one frozen :class:`MeshInfo` that
``fully_shard`` builds once per group and hands to ``ParamGroup``, ``DBuffer``, the optimizers,
checkpoints and precision, instead of a bare process group or ``dist.group.WORLD``. The
mesh-dimension convention (FSDP2's: on a 2-D mesh dim 0 replicates and dim 1 shards) lives here
and nowhere else.

Design note [hsdp]
------------------
HSDP: on a 2-D ``(replicate, shard)`` mesh a parameter is a DTensor with
placements ``(Replicate(), RaggedShard(...))`` (:meth:`MeshInfo.placements`). Every layer plans,
gathers and reduce-scatters inside the shard group (``shard_size`` ranks, the planner's
``world_size``) exactly as on a 1-D mesh of that size; the only extra step is one all-reduce of
each flat gradient shard across the replicate group (``DBuffer.reduce_scatter``). So the data of
rank ``(i, j)`` equals the data of rank ``j`` of a 1-D run of ``shard_size`` ranks, and replicas
compute the same optimizer steps on the same shards. A tensor-parallel (or any other) dim is left
to the caller: pass the data-parallel sub-mesh (``mesh["dp_replicate", "dp_shard"]``), not the
whole mesh.

Design note [mesh-device]
-------------------------
The device is the mesh's, never the parameters': ``fully_shard`` on a model built on the CPU
under NCCL computes on the mesh's device (:func:`mesh_device`, FSDP2's
``_get_device_from_mesh``) and moves the modules' buffers there, and the default mesh's device
type comes from the default process group (:func:`default_device_type`: the accelerator when
the backend runs on it). CPU offload keeps shards, gradients and optimizer states on the CPU
while the mesh is a CUDA one; every collective that can meet such a CPU tensor goes through one
of this module's helpers, which ask :func:`collective_device` where it must run:

* :func:`all_reduce_anywhere` (the grad scaler's found-inf flag, ``clip_grad_norm_``'s sum,
  ragged norms and comparisons, the checkpoint's rank-0 failure flag),
  :func:`broadcast_anywhere` (``sync_module_states``, a one-hot ragged gather),
  :func:`all_to_all_single_anywhere` (Muon's and SOAP/Shampoo's owner exchanges, ragged
  redistribution) and :func:`reduce_scatter_anywhere` (``Partial -> RaggedShard``); the
  placement package's ``all_gather_flat`` asks the same question.
* When the group's backend takes the tensor's device (the GPU; or the CPU under
  ``cpu:gloo,cuda:nccl`` or gloo) the helper *is* the torch call on the caller's tensors: no
  copy. Otherwise (plain NCCL) the send buffer goes to the mesh's device in one copy and the
  receive buffer comes back in one, per call (a bucket, however many pieces its splits cut),
  never per piece; an asynchronous all-to-all copies back in its handle's ``wait()``
  (:class:`StagedWork`). So offload works with ``backend="nccl"``.
* A state built for an offloaded parameter stays on the CPU with it: the optimizers wrap local
  tensors into DTensors without ``DTensor.from_local``, which would move them to the mesh's
  device. The computation around a collective stays where its tensors are (Newton–Schulz of an
  offloaded Muon matrix runs on the CPU, as every offloaded optimizer step does).
* DTensors with torch's own placements go through torch's redistribution, which does not stage
  (FSDP2's behaviour): the full state dict moves them to the mesh's device first.

:func:`init_mesh` is the one factory for the default data-parallel mesh; the strategies and
``fully_shard(mesh=None)`` both use it, so they name the dimension the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate

__all__ = ["MeshInfo", "init_mesh", "DP_SHARD_DIM_NAME", "DP_REPLICATE_DIM_NAME",
           "StagedWork", "all_reduce_anywhere", "all_to_all_single_anywhere",
           "broadcast_anywhere", "reduce_scatter_anywhere", "collective_device",
           "default_device_type", "mesh_device"]

#: Name of the shard dimension of the meshes this package creates.
DP_SHARD_DIM_NAME = "dp_shard"
#: Name of the replicate dimension of the HSDP meshes this package creates.
DP_REPLICATE_DIM_NAME = "dp_replicate"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MeshInfo:
    """The data-parallel mesh of one sharding group, and the groups derived from it.

    Build it with :meth:`from_mesh`. Attributes are read-only; ``eq=False`` because two
    ``MeshInfo`` objects over the same mesh are interchangeable but a ``DeviceMesh`` compares by
    its ranks only.

    Attributes:
        mesh: the data-parallel ``DeviceMesh`` the parameters' DTensors live on.
        shard_mesh_dim: the mesh dimension that shards.
        replicate_mesh_dim: the mesh dimension that replicates (HSDP), or ``None``.
    """

    mesh: DeviceMesh
    shard_mesh_dim: int
    replicate_mesh_dim: int | None = None

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> "MeshInfo":
        """Read the shard (and replicate) dimension off ``mesh``.

        A 1-D mesh shards over its one dim (FSDP); a 2-D mesh replicates over dim 0 and shards
        over dim 1 (HSDP, FSDP2's convention). To keep a tensor-parallel dim out, pass the
        data-parallel sub-mesh (``mesh["dp_replicate", "dp_shard"]``).

        Raises:
            TypeError: ``mesh`` is not a ``DeviceMesh``.
            ValueError: a mesh with more than two dimensions.
        """
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {mesh!r}")
        if mesh.ndim == 1:
            return cls(mesh=mesh, shard_mesh_dim=0)
        if mesh.ndim == 2:
            return cls(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(
            f"mesh: lightning_vescale shards over a 1-D mesh (FSDP) or a 2-D (replicate, shard) "
            f"mesh (HSDP); got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)} (dims {names}). "
            f"Pass the data-parallel sub-mesh, e.g. mesh['{DP_REPLICATE_DIM_NAME}', "
            f"'{DP_SHARD_DIM_NAME}'].")

    def placements(self, ragged: Placement) -> tuple[Placement, ...]:
        """One placement per mesh dim for a tensor sharded by ``ragged`` on the shard dim:
        ``(ragged,)`` on a 1-D mesh, ``(Replicate(), ragged)`` on an HSDP mesh."""
        out: list[Placement] = [Replicate()] * self.mesh.ndim
        out[self.shard_mesh_dim] = ragged
        return tuple(out)

    # -- derived facts (cheap: DeviceMesh caches its groups and coordinates) --------------------
    @property
    def device_type(self) -> str:
        return self.mesh.device_type

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The process group collectives of a sharding group run in."""
        return self.mesh.get_group(self.shard_mesh_dim)

    @functools.cached_property  # read by every hook; a mesh's sizes never change
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_mesh_dim)

    @property
    def shard_rank(self) -> int:
        """This rank's index inside the shard group (the ``r`` of ``RaggedShard.local_range``)."""
        return self.mesh.get_local_rank(self.shard_mesh_dim)

    @property
    def replicate_group(self) -> dist.ProcessGroup | None:
        if self.replicate_mesh_dim is None:
            return None
        return self.mesh.get_group(self.replicate_mesh_dim)

    @functools.cached_property  # read by every hook; a mesh's sizes never change
    def replicate_size(self) -> int:
        return 1 if self.replicate_mesh_dim is None else self.mesh.size(self.replicate_mesh_dim)

    @property
    def replicate_rank(self) -> int:
        """This rank's index inside the replicate group (0 without one)."""
        return 0 if self.replicate_mesh_dim is None else self.mesh.get_local_rank(
            self.replicate_mesh_dim)

    @functools.cached_property  # read by every hook; a mesh's sizes never change
    def is_hsdp(self) -> bool:
        """True when gradients are all-reduced across more than one replica."""
        return self.replicate_size > 1

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """One process group over every data-parallel rank of this mesh, for the engine's small
        all-reduces that must span replicas too (one collective instead of one per mesh dim).

        On a 1-D mesh the shard group; with one rank per shard group the replicate group; on an
        HSDP mesh the group of the flattened mesh (``DeviceMesh._flatten``, created on first use
        and cached by torch on the root mesh: every rank must reach the first use together,
        which ``fully_shard`` guarantees by asking at its call). ``None`` for a 2-D mesh
        without dimension names (torch cannot flatten it): callers then reduce dim by dim.
        """
        if not self.is_hsdp:
            return self.shard_group
        if self.shard_size == 1:
            return self.replicate_group
        if not getattr(self.mesh, "mesh_dim_names", None):
            return None
        return self.mesh._flatten().get_group()

    @functools.cached_property  # read by every hook; a mesh's sizes never change
    def data_parallel_size(self) -> int:
        """Ranks that see different data: ``replicate_size * shard_size``."""
        return self.replicate_size * self.shard_size

    def __repr__(self) -> str:
        return (f"MeshInfo(mesh={tuple(self.mesh.shape)} {self.mesh.device_type}, "
                f"shard_mesh_dim={self.shard_mesh_dim}, "
                f"replicate_mesh_dim={self.replicate_mesh_dim})")


# Keyed on the process, the rank and the default group too: a child forked from a process that
# built a mesh inherits this dict, and a DeviceMesh keeps the coordinate of the rank that built it
# (a forked rank 1 got rank 0's, and full state dicts then gathered to the wrong rank); a new
# init_process_group() after destroy_process_group() may have another size or rank.
_MESHES: dict[tuple[Any, ...], DeviceMesh] = {}


def init_mesh(device_type: str, world_size: int | None = None, *,
              replicas: int = 1) -> DeviceMesh:
    """The data-parallel mesh over the default process group (cached).

    Args:
        device_type: ``"cuda"``, ``"cpu"``, ... (take it from the strategy or the parameters).
        world_size: defaults to the default group's size; must equal it.
        replicas: ``1`` (default): a 1-D mesh named ``("dp_shard",)`` (full sharding). More:
            a 2-D HSDP mesh ``(replicas, world_size // replicas)`` named
            ``("dp_replicate", "dp_shard")``; consecutive ranks share a shard group (so with
            ranks numbered node by node, a shard group stays inside a node).

    Raises:
        ValueError: ``world_size`` differs from the default group's, or ``replicas`` does not
            divide it.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "lightning_vescale needs torch.distributed to be initialised (init_process_group), "
            "even for world_size=1; or pass mesh=... explicitly.")
    size = dist.get_world_size()
    if world_size is not None and world_size != size:
        raise ValueError(
            f"init_mesh(world_size={world_size}) does not match the default process group's "
            f"size {size}.")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1 \
            or size % replicas:
        raise ValueError(
            f"init_mesh(replicas={replicas!r}): the number of replicas must be a positive int "
            f"that divides the world size {size}.")
    key = (device_type, size, replicas, os.getpid(), dist.get_rank(),
           id(dist.distributed_c10d._get_default_group()))
    if key not in _MESHES:
        if replicas == 1:
            _MESHES[key] = init_device_mesh(device_type, (size,),
                                            mesh_dim_names=(DP_SHARD_DIM_NAME,))
        else:
            _MESHES[key] = init_device_mesh(
                device_type, (replicas, size // replicas),
                mesh_dim_names=(DP_REPLICATE_DIM_NAME, DP_SHARD_DIM_NAME))
    return _MESHES[key]


def default_device_type() -> str:
    """The device type of the default data-parallel mesh, from the default process group.

    The accelerator's type when one exists and the default group's backend is an accelerator
    backend that runs there (``nccl``, ``cpu:gloo,cuda:nccl``: FSDP2's rule, checked against
    the backend), else ``"cpu"`` (plain ``gloo`` is the CPU backend, even on a GPU machine).
    Never from the parameters: a model built on the CPU and sharded under NCCL gets a CUDA
    mesh (design note [mesh-device]).
    """
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if not dist.is_initialized():
        return acc.type if acc is not None else "cpu"
    kinds = group_device_types(None)
    if acc is not None and dist.get_backend() != "gloo" and (not kinds or acc.type in kinds):
        return acc.type
    return "cpu"


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh computes and communicates on: FSDP2's ``_get_device_from_mesh`` (the
    current device of the mesh's type; ``cpu``/``meta`` as they are)."""
    kind = mesh.device_type
    if kind in ("cpu", "meta"):
        return torch.device(kind)
    acc = current_accelerator()
    return acc if acc is not None and acc.type == kind else torch.device(kind)


def current_accelerator() -> torch.device | None:
    """The current accelerator device (with its index), ``None`` without one."""
    if not torch.accelerator.is_available():
        return None
    acc = torch.accelerator.current_accelerator()
    return torch.device(acc.type, torch.accelerator.current_device_index())


def group_device_types(group: dist.ProcessGroup | None) -> set[str]:
    """The device types ``group``'s backends run collectives on (``None``: the default group):
    ``{"cuda"}`` for NCCL, ``{"cpu", "cuda"}`` for ``cpu:gloo,cuda:nccl`` or gloo. Empty when
    torch does not say (then callers assume the tensor's own device works)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    kinds = getattr(pg, "_device_types", None)
    return {d.type for d in kinds} if kinds else set()


def collective_device(group: dist.ProcessGroup | None, device: torch.device,
                      mesh: DeviceMesh | None = None) -> torch.device:
    """Where a tensor on ``device`` must be for a collective in ``group`` (design note
    [mesh-device]): ``device`` itself when the group's backend takes it, else the mesh's
    device (``mesh``), else the current accelerator. CPU-offloaded gradients and states on an
    NCCL group thus go to the GPU and back, as FSDP2 does for its full state dicts."""
    kinds = group_device_types(group)
    if not kinds or device.type in kinds:
        return device
    if mesh is not None and mesh.device_type in kinds:
        return mesh_device(mesh)
    acc = current_accelerator()
    if acc is not None and acc.type in kinds:
        return acc
    raise RuntimeError(
        f"A collective on a {device.type} tensor needs a process group backend for "
        f"{device.type!r}, but this group runs on {sorted(kinds)}; initialise the process "
        f"group with a backend for both, e.g. backend='cpu:gloo,cuda:nccl'.")


def all_reduce_anywhere(t: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                        group: dist.ProcessGroup | None = None,
                        mesh: DeviceMesh | None = None) -> torch.Tensor:
    """``dist.all_reduce(t)`` in place, moving ``t`` to a device the group's backend takes and
    back when its own is not one (a CPU-offloaded gradient's norm or found-inf flag on an
    NCCL group: design note [mesh-device]). Returns ``t``."""
    return _in_place_anywhere(t, lambda x: dist.all_reduce(x, op=op, group=group), group, mesh)


def broadcast_anywhere(t: torch.Tensor, *, group_src: int, group: dist.ProcessGroup,
                       mesh: DeviceMesh | None = None) -> torch.Tensor:
    """``dist.broadcast(t, group_src=group_src)`` in place, through a device the group's backend
    takes (one copy there and one back when ``t``'s is not one: design note [mesh-device]).
    ``t`` must be contiguous. Returns ``t``."""
    return _in_place_anywhere(
        t, lambda x: dist.broadcast(x, group=group, group_src=group_src), group, mesh)


def _in_place_anywhere(t: torch.Tensor, collective: Callable[[torch.Tensor], Any],
                       group: dist.ProcessGroup | None, mesh: DeviceMesh | None) -> torch.Tensor:
    """Run the in-place ``collective`` on ``t``, or on a copy on the collective device that is
    then copied back into ``t`` (design note [mesh-device])."""
    where = collective_device(group, t.device, mesh)
    if where == t.device:
        collective(t)
        return t
    moved = t.to(where)
    collective(moved)
    t.copy_(moved)
    return t


class StagedWork:
    """The handle of an asynchronous collective that ran on staged copies (design note
    [mesh-device]): :meth:`wait` waits for it, then copies the staged output back into the
    caller's tensor (the staged tensors stay referenced until then)."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work, self._finish = work, finish

    def wait(self, timeout: Any = None) -> bool:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait() if timeout is None else self._work.wait(timeout)
            finish, self._finish, self._work = self._finish, None, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def all_to_all_single_anywhere(output: torch.Tensor, input: torch.Tensor,
                               output_split_sizes: list[int] | None = None,
                               input_split_sizes: list[int] | None = None, *,
                               group: dist.ProcessGroup | None = None,
                               mesh: DeviceMesh | None = None,
                               async_op: bool = False) -> Any:
    """``dist.all_to_all_single``, through a device the group's backend takes (design note
    [mesh-device]).

    When ``input``'s device is one (the GPU, or the CPU on ``cpu:gloo,cuda:nccl``), this *is*
    ``dist.all_to_all_single``: no copy. Otherwise (CPU-offloaded tensors on plain NCCL) the
    whole ``input`` goes to the mesh's device in one copy, the collective writes a staged output
    there, and that comes back into ``output`` in one copy: once per call, whatever the number
    of pieces the splits cut. With ``async_op`` the copy back happens in the returned handle's
    ``wait()`` (a :class:`StagedWork`); without it, before returning ``None``.
    """
    where = collective_device(group, input.device, mesh)
    if where == input.device and where == output.device:
        return dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      group=group, async_op=async_op)
    staged_in = input.to(where)
    staged_out = torch.empty_like(output, device=where)
    work = dist.all_to_all_single(staged_out, staged_in, output_split_sizes, input_split_sizes,
                                  group=group, async_op=async_op)

    def finish(staged_in: torch.Tensor = staged_in) -> None:  # ``staged_in`` kept alive
        output.copy_(staged_out)

    handle = StagedWork(work, finish)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter_anywhere(output: torch.Tensor, input: torch.Tensor, split_sizes: list[int], *,
                            op: dist.ReduceOp = dist.ReduceOp.SUM,
                            group: dist.ProcessGroup | None = None,
                            mesh: DeviceMesh | None = None) -> None:
    """The list ``dist.reduce_scatter`` of the consecutive pieces ``input.split(split_sizes)``
    (uneven allowed) into ``output``, through a device the group's backend takes: a
    CPU-offloaded ``input`` goes to the mesh's device in one copy, the reduced piece comes back
    in one (design note [mesh-device]); no copy when the backend takes ``input``'s device."""
    where = collective_device(group, input.device, mesh)
    staged = where != input.device or where != output.device
    src = input.to(where) if staged else input
    out = torch.empty_like(output, device=where) if staged else output
    dist.reduce_scatter(out, list(src.split(split_sizes)), op=op, group=group)
    if staged:
        output.copy_(out)
