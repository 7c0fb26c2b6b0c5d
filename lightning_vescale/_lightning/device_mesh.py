"""The strategies' ``device_mesh`` argument: full sharding (default) or HSDP (layer 5, private).

Design note [strategy-mesh]
---------------------------
``device_mesh`` selects how the data-parallel world is laid out; it is the one knob for HSDP
(design note [hsdp] in ``lightning_vescale.mesh``), with FSDP2's / Lightning's ``FSDPStrategy``
convention:

* ``None`` (default): one 1-D mesh over the whole world; every rank holds ``1/world`` of each
  group (full sharding, today's behaviour).
* ``(replicas, shard_size)`` (a tuple, or a list from a YAML config): the 2-D mesh
  ``init_mesh(device_type, replicas=replicas)``, dims ``("dp_replicate", "dp_shard")``.
  Consecutive ranks share a shard group, so with Lightning's node-major rank numbering
  (``global_rank = node_rank * devices + local_rank``) ``(num_nodes, devices)`` shards inside each
  node and all-reduces gradient shards across nodes. Other shapes are allowed too (a shard group
  may span nodes, or a node may hold several); only shapes that cannot exist are errors.
* a ``DeviceMesh`` (1-D or 2-D; dim 0 replicates, dim 1 shards): used as it is, e.g. a
  data-parallel sub-mesh of a larger mesh. A ``DeviceMesh`` can only be built after the process
  group exists, so this form is for Fabric or ``torchrun`` scripts, not for YAML configs.

Whatever the shape, every rank sees different data: the distributed sampler spans the whole world
(data-parallel size = ``replicas * shard_size`` = world size), as with DDP.
With ``tensor_parallel_size`` as well, the pair is the data-parallel part of a 3-D HSDP + TP
mesh (``replicas * shard_size * tp`` = world size; design note [strategy-tp-mesh] in
``parallel_sizes.py`` builds and checks it, and the sampler spans ``replicas * shard_size``).

Checks happen as early as the facts are known: the type and the sanity of the shape (two
positive ints; a mesh of at most two dims) at construction, so a YAML mistake fails before any
process starts; the product against the world size (``num_nodes * devices``) as soon as the
Trainer/Fabric has told the strategy its devices and nodes (``_configure_launcher``, still in the
main process), and again with a mesh's device type when the processes exist
(``setup_environment``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh

from lightning_vescale.mesh import DP_REPLICATE_DIM_NAME, DP_SHARD_DIM_NAME, init_mesh

__all__ = ["DeviceMeshArg", "validate_device_mesh", "check_world_size", "build_device_mesh"]

#: What the strategies' ``device_mesh`` argument accepts (the annotation LightningCLI reads: a
#: YAML list ``[2, 4]`` parses into the tuple).
DeviceMeshArg = Optional[Union[tuple[int, int], DeviceMesh]]

_FORMS = ("None (full sharding over all ranks), a (replicas, shard_size) pair of positive ints "
          "(HSDP; e.g. device_mesh=(num_nodes, devices) shards inside each node), or a 1-D/2-D "
          "torch DeviceMesh")


def validate_device_mesh(device_mesh: Any) -> Union[None, tuple[int, int], DeviceMesh]:
    """Check ``device_mesh`` at construction; return ``None``, a ``(replicas, shard_size)`` tuple
    or the ``DeviceMesh``.

    Raises:
        TypeError: not one of the accepted forms (e.g. an int, a string, floats).
        ValueError: a pair with the wrong number of entries or non-positive entries, a mesh of
            more than two dims.
    """
    if device_mesh is None:
        return None
    if isinstance(device_mesh, DeviceMesh):
        if device_mesh.ndim not in (1, 2):
            names = getattr(device_mesh, "mesh_dim_names", None)
            raise ValueError(
                f"device_mesh: a {device_mesh.ndim}-D DeviceMesh of shape "
                f"{tuple(device_mesh.shape)} (dims {names}) cannot be the data-parallel mesh; "
                f"pass a 1-D mesh (full sharding) or a 2-D (replicate, shard) mesh, e.g. the "
                f"sub-mesh mesh['{DP_REPLICATE_DIM_NAME}', '{DP_SHARD_DIM_NAME}'].")
        return device_mesh
    if isinstance(device_mesh, (str, bytes)) or not isinstance(device_mesh, Sequence):
        raise TypeError(f"device_mesh must be {_FORMS}; got {device_mesh!r}.")
    shape = tuple(device_mesh)
    if any(isinstance(n, bool) or not isinstance(n, int) for n in shape):
        raise TypeError(f"device_mesh={device_mesh!r}: the entries must be ints; device_mesh "
                        f"must be {_FORMS}.")
    if len(shape) != 2:
        hint = (f" For full sharding over all ranks use device_mesh=None (or (1, {shape[0]}))."
                if len(shape) == 1 else
                " A tensor-parallel dim is not device_mesh's business: for FSDP + TP pass "
                "tensor_parallel_size= (and data_parallel_size=) instead, or pass the "
                "data-parallel sub-mesh as a DeviceMesh.")
        raise ValueError(f"device_mesh={device_mesh!r} has {len(shape)} entries; it must be a "
                         f"(replicas, shard_size) pair, e.g. device_mesh=(2, 8) for 2 nodes of 8 "
                         f"devices.{hint}")
    replicas, shard_size = shape
    if replicas < 1 or shard_size < 1:
        raise ValueError(f"device_mesh={device_mesh!r}: replicas ({replicas}) and shard_size "
                         f"({shard_size}) must be positive, e.g. device_mesh=(2, 8) for 2 "
                         f"replicas of 8 ranks each.")
    return (replicas, shard_size)


def _shape_hint(world_size: int, num_nodes: int, devices: int) -> str:
    if num_nodes > 1 and num_nodes * devices == world_size:
        return (f"use device_mesh=({num_nodes}, {devices}) (shard inside each node, replicate "
                f"across the {num_nodes} nodes) or device_mesh=None (shard over all "
                f"{world_size} ranks)")
    pairs = [(r, world_size // r) for r in range(1, world_size + 1) if world_size % r == 0]
    return (f"use a pair whose product is {world_size}, e.g. "
            + ", ".join(f"({r}, {s})" for r, s in pairs[:6]) + ", or device_mesh=None")


def check_world_size(spec: Union[None, tuple[int, int], DeviceMesh], *, world_size: int,
                     num_nodes: int, devices: int) -> None:
    """Check that ``spec`` covers exactly the ``world_size = num_nodes * devices`` ranks.

    The Trainer and Fabric know the world size before they start processes, so the strategies
    call this from ``_configure_launcher`` too: a wrong shape fails once, in the main process,
    not on every rank after the launch.

    Raises:
        ValueError: naming the shape, its product, the world size and a shape that fits.
    """
    where = f"the run has {world_size} processes (num_nodes={num_nodes} x devices={devices})"
    if spec is None:
        return
    if isinstance(spec, DeviceMesh):
        if spec.size() != world_size:
            raise ValueError(
                f"device_mesh: the DeviceMesh of shape {tuple(spec.shape)} covers {spec.size()} "
                f"ranks but {where}; every rank must be in the data-parallel mesh: "
                f"{_shape_hint(world_size, num_nodes, devices)}.")
        return
    replicas, shard_size = spec
    if replicas * shard_size != world_size:
        raise ValueError(
            f"device_mesh=({replicas}, {shard_size}) describes {replicas * shard_size} ranks "
            f"(replicas {replicas} x shard_size {shard_size}) but {where}: "
            f"{_shape_hint(world_size, num_nodes, devices)}.")


def build_device_mesh(spec: Union[None, tuple[int, int], DeviceMesh], *, device_type: str,
                      world_size: int, num_nodes: int, devices: int) -> DeviceMesh:
    """The data-parallel mesh for ``spec`` (from :func:`validate_device_mesh`), once the default
    process group exists (``world_size = num_nodes * devices`` ranks on ``device_type``).

    Raises:
        ValueError: the shape's product is not the world size, or a ``DeviceMesh``'s size or
            device type does not match the run.
    """
    if spec is None:
        return init_mesh(device_type, world_size)
    check_world_size(spec, world_size=world_size, num_nodes=num_nodes, devices=devices)
    if isinstance(spec, DeviceMesh):
        if spec.device_type != device_type:
            raise ValueError(
                f"device_mesh: the DeviceMesh is on {spec.device_type!r} but the strategy runs "
                f"on {device_type!r}; build it with init_device_mesh({device_type!r}, ...), or "
                f"pass device_mesh={tuple(spec.shape)!r} and let the strategy build it.")
        return spec
    replicas, shard_size = spec
    if num_nodes > 1 and shard_size > devices:
        rank_zero_info(
            f"device_mesh=({replicas}, {shard_size}): each shard group spans "
            f"{-(-shard_size // devices)} nodes, so all-gathers and reduce-scatters cross the "
            f"network; device_mesh=({num_nodes}, {devices}) keeps them inside a node.")
    return init_mesh(device_type, world_size, replicas=replicas)
