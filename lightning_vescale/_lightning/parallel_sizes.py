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
* ``device_mesh`` together with either size is refused (a ``ValueError`` at construction): the
  strategies do not build HSDP + TP (3-D) meshes yet (``fully_shard`` takes them, design note
  [fsdp-tp]), and a ``DeviceMesh`` given as ``device_mesh`` is already the whole layout.

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
    """The requested ``(data_parallel_size, tensor_parallel_size)``, ``"auto"`` unresolved."""

    data_parallel_size: SizeArg
    tensor_parallel_size: SizeArg

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
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size!r} x tensor_parallel_size="
                f"{self.tensor_parallel_size!r} does not fill the {world_size} processes of the "
                f"run (num_nodes={num_nodes} x devices={devices}): the product must be "
                f"{world_size}. {_hint(world_size, num_nodes, devices)}")
        return dp, tp

    def build_mesh(self, *, device_type: str, world_size: int, num_nodes: int,
                   devices: int) -> DeviceMesh:
        """The ``("data_parallel", "tensor_parallel")`` mesh (the process group must exist)."""
        dp, tp = self.resolve(world_size=world_size, num_nodes=num_nodes, devices=devices)
        if tp > 1 and devices % tp and tp % devices:
            rank_zero_info(f"tensor_parallel_size={tp} does not divide the {devices} devices of "
                           f"a node: some TP groups span two nodes (TP's collectives run in "
                           f"every layer); tensor_parallel_size={devices} keeps them in a node.")
        return init_device_mesh(device_type, (dp, tp), mesh_dim_names=(DP_DIM_NAME, TP_DIM_NAME))


def _hint(world_size: int, num_nodes: int, devices: int) -> str:
    pairs = [(world_size // t, t) for t in range(1, world_size + 1) if world_size % t == 0]
    shown = ", ".join(f"({d}, {t})" for d, t in pairs[:6])
    return (f"Pairs (data_parallel_size, tensor_parallel_size) that fit: {shown}; "
            f"tensor_parallel_size={devices} (TP inside each node) with data_parallel_size="
            f"{num_nodes}, or leave one of them 'auto'.")


def validate_parallel_sizes(data_parallel_size: Any, tensor_parallel_size: Any,
                            device_mesh: Any) -> Optional[ParallelSizes]:
    """Check the sizes at construction; ``None``: no TP mesh (design note [strategy-tp-mesh]).

    Raises:
        ValueError: a size that is not a positive int or ``"auto"``; a size together with
            ``device_mesh``.
    """
    dp = _check_size("data_parallel_size", data_parallel_size)
    if tensor_parallel_size is None and dp == "auto":
        return None
    tp = "auto" if tensor_parallel_size is None else _check_size("tensor_parallel_size",
                                                                  tensor_parallel_size)
    if device_mesh is not None:
        raise ValueError(
            f"device_mesh={device_mesh!r} cannot be combined with data_parallel_size="
            f"{data_parallel_size!r} / tensor_parallel_size={tensor_parallel_size!r}: the sizes "
            f"build the (data_parallel, tensor_parallel) mesh themselves, and HSDP with tensor "
            f"parallelism (a 3-D mesh) is not built by the strategies yet (lightning_vescale.fully_shard "
            f"takes one). Drop device_mesh for FSDP + TP, or drop the sizes for FSDP/HSDP "
            f"without TP.")
    return ParallelSizes(data_parallel_size=dp, tensor_parallel_size=tp)


def sampler_kwargs(sizes: tuple[int, int], global_rank: int) -> dict[str, int]:
    """The distributed sampler over the data-parallel dim (row-major ``(dp, tp)`` ranks)."""
    dp, tp = sizes
    return {"num_replicas": dp, "rank": global_rank // tp}
