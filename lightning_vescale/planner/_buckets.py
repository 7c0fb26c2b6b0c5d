"""How many flat buffers one bucket of a group gets: :func:`plan_buckets` and :class:`BucketPlan`.

Design note [plan-buckets]
--------------------------
``fully_shard`` puts a group's parameters of one dtype (and trainability, and quantization) in
one flat buffer, planned in buffer order (design notes [planner], [plan-search]). Tensors whose
granularity is a *whole matrix or larger* (``"matrix"`` experts: a block of ``shape[-2] *
shape[-1]`` elements or more, :func:`is_whole_matrix`) are the coarse pieces of that packing. After
the element-granular tensors (attention, router, norms) they meet each rank boundary at an
arbitrary cursor, and the remainder of every shard that no whole matrix fits is lost: an
order-preserving layout of GPT-OSS-120B's blocks over 64 ranks pads 24%. Planned *alone*, the
expert stacks tile the ranks (128 ``gate_up`` experts of ``2D`` and 128 ``down`` experts of ``D``
elements over 64 ranks: 42 ranks of 3 ``gate_up``, one of 2 ``gate_up`` + 2 ``down``, 21 of 6
``down``: 0%) and the element-granular rest pads ~0% on its own.

The rule. :func:`plan_buckets` plans the bucket as one buffer and, when it holds both kinds, as
two: the whole-matrix tensors (in order) and the rest (in order), each with
:func:`~lightning_vescale.planner.plan_layout`. It takes two exactly when that lowers the total
padding by more than ``margin`` (:data:`SPLIT_MARGIN`, 1%) of the bucket's elements:
``pad(one) - pad(rest) - pad(matrices) > margin * numel``. Why a margin: a second buffer costs
one more all-gather per unshard and one more reduce-scatter per backward for the group (a
collective's fixed latency, tens of microseconds on NCCL, and a second flat run for the
optimizers); padding costs in proportion (it is sent by every all-gather and reduce-scatter and
stored in the sharded parameters, gradients, optimizer states and the gathered buffer). Below 1%
of the bucket's bytes the saving is within a collective's latency on a group of tens of MiB and
within noise on any group, so one buffer stays the default; above it (12-24% at the MoE presets'
64 ranks) the saving dominates. A saving of exactly the margin keeps one buffer.

*Check early, resolve once.* A bucket without whole-matrix tensors, or with nothing else, is
planned once (no second planning costs anything). Every caller (``ParamGroup.build``, the planner
CLI's summary, ``benchmarks/moe.py``'s planner table) calls this one function, so the figures
printed are the layouts trained with. Both plans keep their tensors in the caller's order.
Checkpoints are keyed by parameter name and global boxes, so a checkpoint saved under either
decision loads under the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_vescale.planner._granularity import Granularity, matrix_numel
from lightning_vescale.planner._layout import DEFAULT_ALIGN, LayoutPlan, plan_layout
from lightning_vescale.planner._spec import TensorSpec, check_count, resolve_entries

__all__ = ["SPLIT_MARGIN", "BucketPlan", "is_whole_matrix", "plan_buckets"]

#: Default ``margin`` of :func:`plan_buckets` (fraction of the bucket's elements the split must
#: save in padding); read at every call, so tests may set it (``-1``: split whenever both kinds
#: are present; ``float("inf")``: never split).
SPLIT_MARGIN = 0.01


def is_whole_matrix(spec: TensorSpec) -> bool:
    """Whether a resolved ``spec`` (granularity in elements) keeps at least its innermost matrix
    whole on one rank (``"matrix"`` or coarser; a 1-D tensor: whole), with more than one element
    (a single element is whole under any granularity)."""
    return spec.numel > 1 and spec.granularity >= matrix_numel(spec.shape)


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """The buffers of one bucket, as :func:`plan_buckets` decided them.

    Attributes:
        plans: ``(all,)`` for one buffer, or ``(rest, matrices)`` when split: the tensors of
            finer granularity, then those kept whole-matrix (:func:`is_whole_matrix`), each in
            the caller's order.
        one_buffer_padding: padding (elements) of the single-buffer plan, for comparison.
    """

    plans: tuple[LayoutPlan, ...]
    one_buffer_padding: int

    @property
    def split(self) -> bool:
        """True when the whole-matrix tensors got a buffer of their own (``plans[1]``)."""
        return len(self.plans) == 2

    @property
    def total_numel(self) -> int:
        """Elements of real data in the bucket."""
        return sum(p.total_numel for p in self.plans)

    @property
    def buffer_size(self) -> int:
        """Elements of all the bucket's buffers (unsharded)."""
        return sum(p.buffer_size for p in self.plans)

    @property
    def padding(self) -> int:
        """Elements of the bucket's buffers that hold no tensor."""
        return self.buffer_size - self.total_numel

    @property
    def padding_ratio(self) -> float:
        """``padding / buffer_size``."""
        return self.padding / self.buffer_size if self.buffer_size else 0.0


def plan_buckets(
    tensors: Iterable,
    world_size: int,
    *,
    granularity: Granularity | None = 1,
    align: int = DEFAULT_ALIGN,
    margin: float | None = None,
) -> BucketPlan:
    """Plan one bucket as one buffer or as two (design note [plan-buckets] in this module).

    Args:
        tensors, world_size, granularity, align: as :func:`~lightning_vescale.planner.
            plan_layout` (the bucket's tensors in buffer order).
        margin: the fraction of the bucket's elements the split must save in padding;
            :data:`SPLIT_MARGIN` (1%) when ``None``.

    Returns:
        A :class:`BucketPlan`; deterministic.

    Raises:
        ValueError: bad input, as :func:`~lightning_vescale.planner.plan_layout`, or a
            ``margin`` that is not a real number.
    """
    check_count("world_size", world_size, 1)
    check_count("align", align, 1)
    if margin is None:
        margin = SPLIT_MARGIN
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
        raise ValueError(f"margin must be a real number (a fraction of the bucket's elements, "
                         f"e.g. 0.01), got margin={margin!r}")
    specs = resolve_entries(tensors, granularity)
    one = plan_layout(specs, world_size, align=align)
    whole = [s for s in specs if is_whole_matrix(s)]
    if not whole or len(whole) == len(specs):  # one kind only: nothing to separate
        return BucketPlan(plans=(one,), one_buffer_padding=one.padding)
    rest = [s for s in specs if not is_whole_matrix(s)]
    two = (plan_layout(rest, world_size, align=align),
           plan_layout(whole, world_size, align=align))
    saved = one.padding - sum(p.padding for p in two)
    if saved > margin * one.total_numel:
        return BucketPlan(plans=two, one_buffer_padding=one.padding)
    return BucketPlan(plans=(one,), one_buffer_padding=one.padding)
