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

The rule. :func:`plan_buckets` plans up to three candidates, each with
:func:`~lightning_vescale.planner.plan_layout` and keeping the caller's order inside each buffer:

* *one buffer*: the whole bucket;
* *two buffers* (when the bucket holds both kinds): the rest, then the whole-matrix tensors;
* *one buffer per stack* (when it holds 2 to ``max_stacks`` whole-matrix tensors,
  :data:`MAX_STACK_BUFFERS` = 8): the rest (if any), then each whole-matrix tensor alone.

It takes the candidate of least ``padding + margin * numel * (buffers - 1)`` (``margin``:
:data:`SPLIT_MARGIN`, 1%; ``numel``: the bucket's elements), the fewest buffers on a tie: *every
additional buffer must save more than* ``margin * numel`` *elements of padding*. Two buffers beat
one exactly when ``pad(one) - pad(two) > margin * numel``; ``k`` stacks beat two when they save
more than ``(k - 1) * margin * numel`` over it. Why a margin per buffer: each buffer is one more
all-gather per unshard and one more reduce-scatter per backward for the group (a collective's
fixed latency, tens of microseconds on NCCL, and one more flat run for the optimizers); padding
costs in proportion (it is sent by every all-gather and reduce-scatter and stored in the sharded
parameters, gradients, optimizer states and the gathered buffer). Below 1% of the bucket's bytes
per collective pair the saving is within a collective's latency on a group of tens of MiB and
within noise on any group, so fewer buffers stay the default; above it the saving dominates
(12-24% at the MoE presets' 64 ranks for two buffers; at 256 ranks DeepSeek-V3's 256
``gate_up`` and 256 ``down`` experts tile the ranks only apart, one of each per rank as FSDP2's
row chunks do: 23.35% in one or two buffers, ~0% per stack). A saving of exactly the margin
keeps fewer buffers.

Why a cap (:data:`MAX_STACK_BUFFERS`, 8): the per-stack candidate is for MoE blocks, whose
whole-matrix tensors are a few expert stacks (``gate_up``/``down``, or ``gate``/``up``/``down``,
perhaps their biases). A group with ``"matrix"`` granularity on *every* weight (a dense model
under Muon) has one whole-matrix tensor per linear layer; one buffer each would be FSDP1's
per-parameter collectives again, the latency the flat buffer exists to avoid, and the planning
cost would grow with the group. Past the cap only one and two buffers are considered.

*Check early, resolve once.* A bucket without whole-matrix tensors, or of one whole-matrix
tensor and nothing else, is planned once (no second planning costs anything); one of whole-matrix
tensors only has no two-buffer candidate (it would be the one buffer). Every caller
(``ParamGroup.build``, the planner CLI's summary, ``benchmarks/moe.py``'s planner table) calls
this one function, so the figures printed are the layouts trained with. Every plan keeps its
tensors in the caller's order. The per-stack candidate is not always better: GPT-OSS-120B's 128
experts per stack over 256 ranks leave half the ranks without one of each stack (49.5% per
stack), and one buffer (24.16%) stays. Checkpoints are keyed by parameter name and global boxes,
so a checkpoint saved under any decision loads under any other. :attr:`BucketPlan.suffixes`
names each buffer for the engine's ``group.buffers`` keys: ``()`` for the bucket (or its rest),
``("matrix",)`` for the whole-matrix tensors together, ``("matrix", name)`` for one stack alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lightning_vescale.planner._granularity import Granularity, matrix_numel
from lightning_vescale.planner._layout import DEFAULT_ALIGN, LayoutPlan, plan_layout
from lightning_vescale.planner._spec import TensorSpec, check_count, resolve_entries

__all__ = ["MAX_STACK_BUFFERS", "SPLIT_MARGIN", "BucketPlan", "is_whole_matrix", "plan_buckets"]

#: Default ``margin`` of :func:`plan_buckets` (fraction of the bucket's elements the split must
#: save in padding per additional buffer); read at every call, so tests may set it (``-1``: the
#: most buffers available; ``float("inf")``: never split).
SPLIT_MARGIN = 0.01

#: Default ``max_stacks`` of :func:`plan_buckets`: the most whole-matrix tensors a bucket may
#: hold for the one-buffer-per-stack candidate to be planned (read at every call; tests may set
#: it, ``0``: never per stack).
MAX_STACK_BUFFERS = 8


def is_whole_matrix(spec: TensorSpec) -> bool:
    """Whether a resolved ``spec`` (granularity in elements) keeps at least its innermost matrix
    whole on one rank (``"matrix"`` or coarser; a 1-D tensor: whole), with more than one element
    (a single element is whole under any granularity)."""
    return spec.numel > 1 and spec.granularity >= matrix_numel(spec.shape)


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """The buffers of one bucket, as :func:`plan_buckets` decided them.

    Attributes:
        plans: ``(all,)`` for one buffer; ``(rest, matrices)`` for two: the tensors of finer
            granularity, then those kept whole-matrix (:func:`is_whole_matrix`); per stack,
            ``(rest, m1, m2, ...)`` (no ``rest`` when there is none): each whole-matrix tensor
            alone. Tensors keep the caller's order inside each plan and across the stacks.
        one_buffer_padding: padding (elements) of the single-buffer plan, for comparison.
        suffixes: one per plan, how the engine keys its buffer after the bucket's key: ``()``,
            ``("matrix",)`` (the whole-matrix tensors together) or ``("matrix", name)``.
    """

    plans: tuple[LayoutPlan, ...]
    one_buffer_padding: int
    suffixes: tuple[tuple[str, ...], ...] = ((),)

    @property
    def split(self) -> bool:
        """True when the whole-matrix tensors got a buffer (or buffers) of their own."""
        return len(self.plans) > 1

    @property
    def per_stack(self) -> bool:
        """True when each whole-matrix tensor got a buffer of its own."""
        return any(len(s) == 2 for s in self.suffixes)

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
    max_stacks: int | None = None,
) -> BucketPlan:
    """Plan one bucket as one buffer, two, or one per whole-matrix tensor (design note
    [plan-buckets] in this module): the candidate of least padding where every additional
    buffer must save more than ``margin`` of the bucket's elements.

    Args:
        tensors, world_size, granularity, align: as :func:`~lightning_vescale.planner.
            plan_layout` (the bucket's tensors in buffer order).
        margin: the fraction of the bucket's elements each additional buffer must save in
            padding; :data:`SPLIT_MARGIN` (1%) when ``None``.
        max_stacks: the most whole-matrix tensors for which one buffer each is considered;
            :data:`MAX_STACK_BUFFERS` (8) when ``None``.

    Returns:
        A :class:`BucketPlan`; deterministic.

    Raises:
        ValueError: bad input, as :func:`~lightning_vescale.planner.plan_layout`, a ``margin``
            that is not a real number or a negative ``max_stacks``.
    """
    check_count("world_size", world_size, 1)
    check_count("align", align, 1)
    margin = SPLIT_MARGIN if margin is None else margin
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or margin != margin:
        raise ValueError(f"margin must be a real number (a fraction of the bucket's elements, "
                         f"e.g. 0.01), got margin={margin!r}")
    max_stacks = MAX_STACK_BUFFERS if max_stacks is None else max_stacks
    check_count("max_stacks", max_stacks, 0)
    specs = resolve_entries(tensors, granularity)
    one = plan_layout(specs, world_size, align=align)
    best = BucketPlan(plans=(one,), one_buffer_padding=one.padding)
    for candidate in _candidates(specs, world_size, align, max_stacks, one.padding):
        extra = len(candidate.plans) - len(best.plans)  # > 0: candidates grow
        if candidate.padding + margin * one.total_numel * extra < best.padding:
            best = candidate
    return best


def _candidates(specs: list[TensorSpec], world_size: int, align: int, max_stacks: int,
                one_padding: int) -> list[BucketPlan]:
    """Two buffers (both kinds present), then one per stack (2 to ``max_stacks`` whole-matrix
    tensors), in growing numbers of buffers; none for a bucket of one kind and one stack."""
    whole = [s for s in specs if is_whole_matrix(s)]
    rest = [s for s in specs if not is_whole_matrix(s)]
    out: list[BucketPlan] = []
    if not whole or (len(whole) == 1 and not rest):
        return out
    head = ((plan_layout(rest, world_size, align=align),), ((),)) if rest else ((), ())
    if whole and rest:
        out.append(BucketPlan(plans=(*head[0], plan_layout(whole, world_size, align=align)),
                              one_buffer_padding=one_padding, suffixes=((), ("matrix",))))
    if 2 <= len(whole) <= max_stacks:
        out.append(BucketPlan(
            plans=(*head[0], *(plan_layout([s], world_size, align=align) for s in whole)),
            one_buffer_padding=one_padding,
            suffixes=(*head[1], *(("matrix", s.name) for s in whole))))
    return out
