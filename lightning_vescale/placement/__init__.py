"""Layer 0: the ``RaggedShard`` placement, its pure range math, and its DTensor support.

``RaggedShard(dims, local_units)`` shards a tensor over contiguous memory in atomic units with
uneven per-rank amounts (design note [ragged-shard] in ``_ragged_shard``). Build its DTensors
with :func:`ragged_from_local`; cut a full tensor to a rank's part with :func:`local_slice`.

Modules, each importing only those before it:

* ``_ragged_shard``: the placement and the pure range math (ranges, checkpoint boxes, the split
  sizes of redistribution), ``ragged_from_local``, ``local_slice``;
* ``_common``: helpers shared by the DTensor extension (ragged specs, layouts, errors);
* ``_dtensor``: redistribution (with autograd), ``to_local`` backward, DCP chunks (design note
  [ragged-dtensor]); ``_reductions``: norms and full reductions ([ragged-reductions]);
* ``_random_ops`` (random fills: one-process values; [ragged-random]) and ``_init_ops``
  (``new_*`` factories, dim-0 slices as views; [ragged-init]): what model init code calls;
* ``_ops``: the operator dispatch hook (element-wise ops, copies; [ragged-ops]);
* ``_flat_runs`` (memory layout: the one run builder, compaction), ``_flat_ops`` (which ops),
  ``_flat_probe`` (the exactness probe of list ops and of optimizer classes, one cache) and
  ``_flat_step`` (the handler): list ops (``_foreach_*``, fused optimizers) on whole flat runs
  of DBuffer shards instead of per tensor ([flat-step]);
  :func:`flat_step_enabled` switches it;
* ``_pickle``: pickling and deep-copying DTensors over views at a storage offset
  ([dtensor-views-pickle]);
* ``_install``: :func:`install`, the one place that registers all of it with DTensor.

Importing this package calls :func:`install` (idempotent), so no other module needs an import for
its side effect.
"""

from lightning_vescale.placement._flat_runs import compact_, contiguous_runs, run_view
from lightning_vescale.placement._install import (
    flat_step_enabled,
    install,
    is_flat_step_enabled,
    set_flat_step_enabled,
)
from lightning_vescale.placement._ragged_shard import (
    Box,
    FlatRange,
    RaggedShard,
    box_numel,
    chunk_bounds,
    flat_range_to_boxes,
    local_slice,
    overlap_matrix,
    overlap_splits,
    ragged_from_local,
    ragged_mesh_dim,
    ragged_ranges,
    ragged_shard_and_rank,
    slab_pieces,
)

install()

__all__ = [
    "Box",
    "FlatRange",
    "RaggedShard",
    "box_numel",
    "chunk_bounds",
    "compact_",
    "contiguous_runs",
    "flat_range_to_boxes",
    "flat_step_enabled",
    "install",
    "is_flat_step_enabled",
    "local_slice",
    "overlap_matrix",
    "overlap_splits",
    "ragged_from_local",
    "ragged_mesh_dim",
    "ragged_ranges",
    "ragged_shard_and_rank",
    "run_view",
    "set_flat_step_enabled",
    "slab_pieces",
]
