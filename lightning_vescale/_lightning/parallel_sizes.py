"""The strategies' ``data_parallel_size`` / ``tensor_parallel_size`` (layer 5, private).

Design note [strategy-tp-mesh]
------------------------------
FSDP + tensor parallelism through the strategies, with Lightning's ``ModelParallelStrategy``
conventions, so that a LightningModule written for it runs on ours unchanged:

* ``tensor_parallel_size`` (and/or ``data_parallel_size``) given: the strategy builds the 2-D
  mesh ``init_device_mesh(device_type, (dp, tp), mesh_dim_names=("data_parallel",
  "tensor_parallel"))``, Lightning's names and layout (consecutive ranks form a TP group, so
  with node-major rank numbering ``tp = devices`` keeps TP inside a node). It is
  ``LightningModule.device_mesh`` in ``configure_model`` (and ``strategy.device_mesh`` for
  Fabric), where the user applies ``parallelize_module(..., self.device_mesh["tensor_parallel"],
  plan)``; then the strategy shards (its units, or the user's own ``fully_shard`` calls on
  ``device_mesh["data_parallel"]``) on the data-parallel dim (design note [fsdp-tp]). The
  distributed sampler spans the data-parallel dim only: the ranks of a TP group see one batch.
* ``"auto"``: as ``ModelParallelStrategy``, both ``"auto"`` means ``dp = num_nodes`` and
  ``tp = devices`` (TP inside each node); one ``"auto"`` is the world size divided by the
  other (Lightning takes ``num_nodes`` / ``devices`` there and fails unless that is the
  quotient: where Lightning succeeds, both agree).
* Defaults: ``tensor_parallel_size=None`` and ``data_parallel_size="auto"`` keep the 1-D
  (or ``device_mesh``) data-parallel mesh of design note [strategy-mesh]: a default of
  ``"auto"`` as Lightning's would turn every existing multi-GPU run into TP runs without a plan.
* HSDP + TP: ``device_mesh=(replicas, shard_size)`` together with ``tensor_parallel_size=tp``
  (``data_parallel_size``, if not ``"auto"``, must be ``replicas * shard_size``; ``tp`` may be
  ``"auto"``: the world size divided by it) builds the 3-D mesh ``init_device_mesh(device_type,
  (replicas, shard_size, tp), mesh_dim_names=("dp_replicate", "dp_shard",
  "tensor_parallel"))``: the strategy's HSDP names (design note [strategy-mesh]) for the two
  data-parallel dims, Lightning's for TP, consecutive ranks forming a TP group as above. The two
  data-parallel dims are also flattened (``DeviceMesh._flatten``, torchtitan's way) into a 1-D
  dim named ``"data_parallel"``, so a LightningModule written for ``ModelParallelStrategy``
  still finds ``self.device_mesh["tensor_parallel"]`` (its TP plan) and
  ``self.device_mesh["data_parallel"]`` (whatever it does on the whole data-parallel dim; torch
  2.13 warns that slicing a flattened dim from the root mesh "will be deprecated", and does it).
  The strategy shards on the ``(dp_replicate, dp_shard)`` sub-mesh, so ``fully_shard`` does HSDP
  on the TP-local tensors (design note [fsdp-tp]); the sampler spans the ``replicas *
  shard_size`` data-parallel ranks (a TP group reads one batch). A ``DeviceMesh`` given as
  ``device_mesh`` together with either size is refused (a ``ValueError`` at construction): it is
  already the whole layout.

Checks run as early as the facts are known, as for ``device_mesh``: types and positivity at
construction (a YAML mistake fails before any process starts); ``dp * tp`` against
``num_nodes * devices`` in ``_configure_launcher`` (main process) and again in
``setup_environment``, with an error naming values that fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_vescale.mesh import DP_REPLICATE_DIM_NAME, DP_SHARD_DIM_NAME

__all__ = ["DP_DIM_NAME", "TP_DIM_NAME", "ParallelSizes", "SizeArg", "validate_parallel_sizes"]

#: Lightning's ``ModelParallelStrategy`` dimension names.
DP_DIM_NAME = "data_parallel"
TP_DIM_NAME = "tensor_parallel"

#: What ``data_parallel_size`` / ``tensor_parallel_size`` accept (LightningCLI reads it).
SizeArg = Union[Literal["auto"], int]


def _check_size(name: str, value: Any) -> SizeArg:
    if value == "auto" and isinstance(value, str):
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive int or 'auto' (e.g. "
                         f"{name}=2), as Lightning's ModelParallelStrategy.")
    return value


@dataclass(frozen=True, kw_only=True)
class ParallelSizes:
    """The requested ``(data_parallel_size, tensor_parallel_size)``, ``"auto"`` unresolved;
    ``hsdp``: the ``(replicas, shard_size)`` of ``device_mesh`` for HSDP + TP (then
    ``data_parallel_size`` is their product), ``None`` for the 2-D mesh."""

    data_parallel_size: SizeArg
    tensor_parallel_size: SizeArg
    hsdp: Optional[tuple[int, int]] = None

    def resolve(self, *, world_size: int, num_nodes: int, devices: int) -> tuple[int, int]:
        """``(dp, tp)`` for a run of ``world_size = num_nodes * devices`` ranks.

        Raises:
            ValueError: ``dp * tp`` is not the world size (or an ``"auto"`` size cannot fill
                it), naming the sizes, the run and pairs that fit.
        """
        dp, tp = self.data_parallel_size, self.tensor_parallel_size
        if dp == "auto" and tp == "auto":
            dp, tp = num_nodes, devices
        elif dp == "auto":
            dp = world_size // tp if world_size % tp == 0 else 0
        elif tp == "auto":
            tp = world_size // dp if world_size % dp == 0 else 0
        assert isinstance(dp, int) and isinstance(tp, int)
        if dp * tp != world_size or dp < 1 or tp < 1:
            run = (f"the {world_size} processes of the run (num_nodes={num_nodes} x devices="
                   f"{devices})")
            if self.hsdp is not None:
                raise ValueError(_hsdp_error(self.hsdp, self.tensor_parallel_size, run,
                                             world_size))
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size!r} x tensor_parallel_size="
                f"{self.tensor_parallel_size!r} does not fill {run}: the product must be "
                f"{world_size}. {_hint(world_size, num_nodes, devices)}")
        return dp, tp

    def build_mesh(self, *, device_type: str, world_size: int, num_nodes: int,
                   devices: int) -> DeviceMesh:
        """The ``("data_parallel", "tensor_parallel")`` mesh, or with ``hsdp`` the
        ``("dp_replicate", "dp_shard", "tensor_parallel")`` mesh whose first two dims are also
        flattened into ``"data_parallel"`` (the process group must exist)."""
        dp, tp = self.resolve(world_size=world_size, num_nodes=num_nodes, devices=devices)
        if tp > 1 and devices % tp and tp % devices:
            rank_zero_info(f"tensor_parallel_size={tp} does not divide the {devices} devices of "
                           f"a node: some TP groups span two nodes (TP's collectives run in "
                           f"every layer); tensor_parallel_size={devices} keeps them in a node.")
        if self.hsdp is None:
            return init_device_mesh(device_type, (dp, tp),
                                    mesh_dim_names=(DP_DIM_NAME, TP_DIM_NAME))
        mesh = init_device_mesh(device_type, (*self.hsdp, tp), mesh_dim_names=(
            DP_REPLICATE_DIM_NAME, DP_SHARD_DIM_NAME, TP_DIM_NAME))
        mesh[DP_REPLICATE_DIM_NAME, DP_SHARD_DIM_NAME]._flatten(DP_DIM_NAME)
        return mesh

    def sharding_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The sub-mesh of :meth:`build_mesh`'s mesh the strategy shards on: ``"data_parallel"``
        (FSDP), or ``("dp_replicate", "dp_shard")`` (HSDP)."""
        if self.hsdp is None:
            return mesh[DP_DIM_NAME]
        return mesh[DP_REPLICATE_DIM_NAME, DP_SHARD_DIM_NAME]


def _hint(world_size: int, num_nodes: int, devices: int) -> str:
    pairs = [(world_size // t, t) for t in range(1, world_size + 1) if world_size % t == 0]
    shown = ", ".join(f"({d}, {t})" for d, t in pairs[:6])
    return (f"Pairs (data_parallel_size, tensor_parallel_size) that fit: {shown}; "
            f"tensor_parallel_size={devices} (TP inside each node) with data_parallel_size="
            f"{num_nodes}, or leave one of them 'auto'.")


def _hsdp_error(hsdp: tuple[int, int], tp: SizeArg, run: str, world_size: int) -> str:
    replicas, shard_size = hsdp
    dp = replicas * shard_size
    fits = []
    if world_size % dp == 0:
        fits.append(f"tensor_parallel_size={world_size // dp}")
    if isinstance(tp, int) and world_size % tp == 0:
        n = world_size // tp
        pairs = [(r, n // r) for r in range(1, n + 1) if n % r == 0]
        fits.append("device_mesh=" + " / ".join(f"({r}, {s})" for r, s in pairs[:4])
                    + f" with tensor_parallel_size={tp}")
    hint = ("Values that fit: " + "; or ".join(fits) + ".") if fits else (
        f"replicas x shard_size x tensor_parallel_size must be {world_size}.")
    return (f"device_mesh=({replicas}, {shard_size}) x tensor_parallel_size={tp!r} does not fill "
            f"{run}: replicas x shard_size x tensor_parallel_size must be {world_size}. {hint}")


def validate_parallel_sizes(data_parallel_size: Any, tensor_parallel_size: Any,
                            device_mesh: Union[None, tuple[int, int], DeviceMesh]
                            ) -> Optional[ParallelSizes]:
    """Check the sizes at construction; ``None``: no TP mesh (design note [strategy-tp-mesh]).

    ``device_mesh`` is the validated ``device_mesh`` argument (``validate_device_mesh``): a
    ``(replicas, shard_size)`` pair with a size means HSDP + TP.

    Raises:
        ValueError: a size that is not a positive int or ``"auto"``; a size together with a
            ``DeviceMesh``; a ``data_parallel_size`` other than ``replicas * shard_size``.
    """
    dp = _check_size("data_parallel_size", data_parallel_size)
    if tensor_parallel_size is None and dp == "auto":
        return None
    tp = "auto" if tensor_parallel_size is None else _check_size("tensor_parallel_size",
                                                                  tensor_parallel_size)
    if device_mesh is None:
        return ParallelSizes(data_parallel_size=dp, tensor_parallel_size=tp)
    if isinstance(device_mesh, DeviceMesh):
        raise ValueError(
            f"device_mesh={device_mesh!r} cannot be combined with data_parallel_size="
            f"{data_parallel_size!r} / tensor_parallel_size={tensor_parallel_size!r}: a "
            f"DeviceMesh is already the whole layout. For HSDP + TP pass device_mesh=(replicas, "
            f"shard_size) with tensor_parallel_size=; drop the sizes for FSDP/HSDP without TP.")
    replicas, shard_size = device_mesh
    if dp != "auto" and dp != replicas * shard_size:
        raise ValueError(
            f"data_parallel_size={dp} does not match device_mesh=({replicas}, {shard_size}): with "
            f"HSDP + TP the data-parallel size is replicas x shard_size = "
            f"{replicas * shard_size}; pass data_parallel_size={replicas * shard_size} or "
            f"'auto' (or leave it out).")
    return ParallelSizes(data_parallel_size=replicas * shard_size, tensor_parallel_size=tp,
                         hsdp=(replicas, shard_size))


def sampler_kwargs(sizes: tuple[int, int], global_rank: int) -> dict[str, int]:
    """The distributed sampler over the data-parallel dim (row-major ``(dp, tp)`` ranks; with
    HSDP + TP ``dp = replicas * shard_size``, the row-major ``(replicas, shard_size, tp)``
    ranks of one TP group read one batch)."""
    dp, tp = sizes
    return {"num_replicas": dp, "rank": global_rank // tp}
