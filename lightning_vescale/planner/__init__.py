"""Layer 1: the structure-aware layout planner (pure: no process group, no torch tensors).

One sharding group's tensors share one flat buffer; :func:`plan_layout` puts every tensor at an
offset so that no block of its granularity crosses a rank boundary, with as little padding as
possible, and derives each tensor's :class:`~lightning_vescale.placement.RaggedShard`.

Modules (each imports only the ones above it in this list, and layer 0):

* ``_granularity``: the granularity forms users write (``None``, elements, ``"element"``,
  ``"row"``, ``"<k>rows"``, ``"matrix"``): :func:`check_granularity` and :func:`resolve_granularity`, the one
  resolution every layer calls;
* ``_spec``: :class:`TensorSpec` and input validation;
* ``_search``: the search over shard sizes (design note [plan-search]);
* ``_layout``: :class:`LayoutPlan` and :func:`plan_layout` (design note [planner]);
* ``_buckets``: :func:`plan_buckets`, one buffer, a second one for whole-matrix tensors or one
  per whole-matrix tensor (design note [plan-buckets]);
* ``presets``: transformer shapes of public models (no allocation);
* ``baselines``: FSDP2- and FSDP1-style padding figures for comparison;
* ``cli``: ``python -m lightning_vescale.planner``.
"""

from lightning_vescale.planner._granularity import (
    DEFAULT_BLOCK_ALIGN,
    DEFAULT_BLOCK_MIN_NUMEL,
    GRANULARITY_FORMS,
    Granularity,
    check_granularity,
    default_granularity,
    is_matrix_granularity,
    matrix_numel,
    resolve_granularity,
)
from lightning_vescale.planner._layout import (
    DEFAULT_ALIGN,
    LayoutPlan,
    plan_layout,
    shard_size_lower_bound,
)
from lightning_vescale.planner._buckets import (
    MAX_STACK_BUFFERS,
    SPLIT_MARGIN,
    BucketPlan,
    is_whole_matrix,
    plan_buckets,
)
from lightning_vescale.planner._spec import TensorSpec
from lightning_vescale.planner.baselines import BaselineFigures, fsdp1_flat, fsdp2_even_rowwise
from lightning_vescale.planner.presets import (
    PRESETS,
    TransformerConfig,
    num_params,
    transformer_groups,
)

__all__ = [
    "DEFAULT_ALIGN",
    "DEFAULT_BLOCK_ALIGN",
    "DEFAULT_BLOCK_MIN_NUMEL",
    "GRANULARITY_FORMS",
    "PRESETS",
    "MAX_STACK_BUFFERS",
    "SPLIT_MARGIN",
    "BaselineFigures",
    "BucketPlan",
    "Granularity",
    "LayoutPlan",
    "TensorSpec",
    "TransformerConfig",
    "check_granularity",
    "default_granularity",
    "is_matrix_granularity",
    "is_whole_matrix",
    "matrix_numel",
    "fsdp1_flat",
    "fsdp2_even_rowwise",
    "num_params",
    "plan_buckets",
    "plan_layout",
    "resolve_granularity",
    "shard_size_lower_bound",
    "transformer_groups",
]
