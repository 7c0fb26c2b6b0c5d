"""Operators on ``RaggedShard`` DTensors: the one place where DTensor dispatch learns about them.

Design note [ragged-ops]
------------------------
The local tensor of a ``RaggedShard`` DTensor is its rank's flat, contiguous slice of the
row-major global tensor. Two operands with the *same* global shape, stride and ``RaggedShard``
placement therefore hold the same flat element range on every rank, so an element-wise op is
exact when run on the local tensors, with the result keeping that placement. Norms and full
reductions are a local partial plus one collective over the ragged mesh dimension. Nothing else
(views, matmuls, indexing) is defined on a ragged layout, and such ops must fail loudly instead
of returning a tensor with a wrong placement.

On an N-D mesh (design note [ragged-nd]; HSDP's ``(Replicate(), RaggedShard)``) the same holds
with *all* placements: operands must have equal placement tuples, results keep the whole tuple
(the replicate dims stay ``Replicate``), a scalar-like operand is ``Replicate`` on every dim,
and ``Partial`` on any dim is refused. Nothing here depends on the number of mesh dims.

How torch 2.13 dispatches a DTensor op (``torch/csrc/autograd/python_variable.cpp``,
``dispatchDTensorOp``), and where this module hooks in:

1. A per-op ``OpDispatcher._custom_op_handlers`` dict is consulted first. Keying an op there
   would route *every* DTensor's call of that op through Python, so this module does not add
   entries for common ops; it only guards the few handlers torch already registers
   (``argmin``/``argmax``/``convolution*``) against ragged inputs. The one exception is the
   package's ``_flat_step`` module (design note [flat-step]): list ops (``_foreach_*``, fused
   optimizers) cost one Python call per *list*, and it hands non-ragged lists straight back to
   this normal path.
2. A C++ cache maps (op, input specs incl. placements, shapes, strides, dtypes, static args) to
   an ``OutputSharding``. On a hit, C++ runs the op on the local tensors and wraps the result
   with the cached output spec: no Python at all.
3. On a miss C++ calls ``OpDispatcher._propagate_op_sharding_dispatch_slow_path``. Its result is
   either an ``OutputSharding`` (cached, then step 2's local compute runs) or *the op's final
   result* (returned as is, nothing cached; torch uses this for decompositions).

**Extensions (the only patches of DTensor internals; defined here, registered by
``lightning_vescale.placement.install()``):** (a) :func:`guard_custom_handler` wraps torch's
``argmin``/``argmax``/``convolution*`` custom handlers so ragged inputs raise (they assume
Shard/Replicate and would mis-handle a ragged layout); (b) :func:`wrap_slow_path` replaces the
bound ``_propagate_op_sharding_dispatch_slow_path`` on the ``DTensor._op_dispatcher`` instance.
Why (b): it is the single point every uncached DTensor op passes through, it sees the op's
``OpSchema`` (placements of every argument) and it may answer with either a sharding or a result. For schemas with no ``RaggedShard`` it calls the original unchanged, so
ordinary DTensors keep the normal path. For ragged schemas:

* element-wise ops (``torch.Tag.pointwise``, their ``_foreach_*`` forms, copies, casts,
  ``*_like`` factories; see :func:`is_elementwise_op`) get an ``OutputSharding`` that keeps the
  placement and needs no redistribution. C++ caches it, so from the second call on (e.g. every
  optimizer step) the op costs exactly what it costs on a ``Replicate`` DTensor.
* norms and full reductions (``REDUCTION_HANDLERS``, design note [ragged-reductions] in
  the package's ``_reductions`` module) are computed there and returned as ``Replicate``
  DTensors (one collective per call, one per *list* for ``_foreach_norm``, so
  ``clip_grad_norm_(foreach=True)`` costs one all-reduce; its default for DTensors is the
  per-tensor loop, one all-reduce per gradient).
* random fills (``uniform_``, ``normal_``..., ``rand_like``...; ``RANDOM_HANDLERS``, design
  note [ragged-random] in ``_random_ops``) give each rank its range of the whole draw (drawn
  whole on an accelerator; only the range on the CPU generator): the values of single-device
  initialisation under the same seed.
* ``new_empty``/``new_zeros``/``new_ones``/``new_full`` (the input's layout for its own shape,
  ``Replicate`` for another) and dim-0 slices ``w[a:b]`` (a ragged *view*, so writes reach
  ``w``): ``INIT_HANDLERS``, design note [ragged-init] in ``_init_ops``; what model init code
  (torchtitan's ``init_weights``) calls on sharded parameters.
* ``copy_`` between two layouts of the same tensor redistributes the source, then copies; a
  plain full source (only under DTensor's ``implicit_replication()``: otherwise DTensor refuses
  mixing plain and DTensor operands before any hook runs) is a Replicate one.
* anything else raises :class:`NotImplementedError` naming the op and the supported families;
  operands whose layouts do not match raise ``ValueError`` naming the op and both layouts.

Helpers both modules use (spec checks, argument binding, the "unsupported" error) live in the
package's ``_common`` module. Tested with torch 2.13's C++ DTensor dispatch; ``install()`` raises
``RuntimeError`` with an explanation on a torch without
``_propagate_op_sharding_dispatch_slow_path``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Partial

from lightning_vescale.placement._common import (
    FUSED_OPTIMIZER_OPS,
    foreach_is_elementwise,
    aten,
    bind_args,
    has_ragged,
    is_scalar_like,
    same_layout,
    spec_str,
    unsupported,
)
from lightning_vescale.placement._flat_step import activate as activate_flat_step
from lightning_vescale.placement._init_ops import INIT_HANDLERS
from lightning_vescale.placement._random_ops import RANDOM_HANDLERS
from lightning_vescale.placement._ragged_shard import local_slice, ragged_shard_and_rank
from lightning_vescale.placement._reductions import REDUCTION_HANDLERS

__all__ = ["GUARDED_CUSTOM_OPS", "clear_sharding_caches", "guard_custom_handler", "is_elementwise_op",
           "wrap_slow_path"]

# Ops that are element-wise on a flat slice but carry no ``torch.Tag.pointwise``.
_EXTRA_ELEMENTWISE = {
    aten.copy_.default,
    aten.copy.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten._to_copy.default,
    aten.detach.default,
    aten.detach_.default,
    aten.alias.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
}
# DTensor's own list of ops it treats as pointwise but that lack the tag (e.g. masked_fill_,
# used by the backward of vector_norm). Private in torch, so optional.
try:
    from torch.distributed.tensor._ops._pointwise_ops import (
        _extra_pointwise_ops as _DTENSOR_EXTRA_POINTWISE,
    )
except ImportError:  # pragma: no cover - layout of torch internals changed
    _DTENSOR_EXTRA_POINTWISE = []
_EXTRA_ELEMENTWISE.update(
    op for op in _DTENSOR_EXTRA_POINTWISE
    if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten"
)
# Fused optimizer steps are element-wise over their tensor lists too; ``state_steps`` (0-d) and
# ``grad_scale``/``found_inf``/tensor ``lr`` are scalar-like operands.
_EXTRA_ELEMENTWISE.update(
    getattr(packet, o)
    for packet in (getattr(aten, name, None) for name in FUSED_OPTIMIZER_OPS)
    if packet is not None
    for o in packet.overloads()
)


@functools.cache
def is_elementwise_op(op: torch._ops.OpOverload) -> bool:
    """True when ``op`` maps each element (or each list item's elements) independently.

    Random ops (``nondeterministic_seeded``) are excluded: DTensor's RNG tracker has no notion
    of a ragged range, so they would draw the same stream on every rank.
    """
    if torch.Tag.nondeterministic_seeded in op.tags:
        return False
    if op in _EXTRA_ELEMENTWISE or torch.Tag.pointwise in op.tags:
        return True
    name = op._schema.name  # "aten::_foreach_add_" (op.name() carries the overload too)
    if name.startswith("aten::_foreach_"):
        return foreach_is_elementwise(name[len("aten::_foreach_"):].rstrip("_"))
    return False


def _is_list_op(op: torch._ops.OpOverload) -> bool:
    return op.name().startswith(("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_"))


def _schema_has_ragged(op_info: Any) -> bool:
    for s in op_info.flat_args_schema:
        if has_ragged(s):
            return True
    schema = op_info.schema
    if schema is not None and schema.kwargs_schema:
        for v in schema.kwargs_schema.values():
            if has_ragged(v) or (
                isinstance(v, (list, tuple)) and any(has_ragged(e) for e in v)
            ):
                return True
    return False


# ---------------------------------------------------------------------------------------------
# Element-wise ops: an OutputSharding that keeps the placement (cached by DTensor's C++ path).
# ---------------------------------------------------------------------------------------------
def _slot_main(
    op: object, specs: Sequence[DTensorSpec], all_specs: Sequence[object]
) -> DTensorSpec:
    """The layout every non-scalar operand of one element-wise application shares."""
    main: DTensorSpec | None = None
    for s in specs:
        if any(isinstance(p, Partial) for p in s.placements):
            raise unsupported(
                op, all_specs,
                ": an operand is Partial; call .full_tensor() or .redistribute(placements="
                "[Replicate()]) on it first",
            )
        if is_scalar_like(s):
            continue
        if main is None:
            main = s
        elif not same_layout(main, s):
            raise ValueError(
                f"{op}: element-wise ops on RaggedShard DTensors need every tensor operand to "
                f"have the same global shape, stride and placement (or be a scalar / 1-element "
                f"Replicate tensor); got {spec_str(main)} and {spec_str(s)}. Redistribute "
                "one operand to the other's placement first."
            )
    if main is None:  # only scalar-like operands in this slot: the result is replicated too
        main = specs[0]
    return main


def _tensor_slots(op: torch._ops.OpOverload, schema: OpSchema):
    """Group the DTensorSpecs of ``schema`` by element-wise application.

    A single op is one application. A ``_foreach_*`` op applies item ``i`` of every list
    together, plus any non-list tensor operand (e.g. ``_foreach_mul_.Tensor``'s ``other``)
    which we call *shared*.
    """
    operands = list(schema.args_schema) + list(schema.kwargs_schema.values())
    if not _is_list_op(op):
        flat: list[DTensorSpec] = []
        for a in operands:
            if isinstance(a, DTensorSpec):
                flat.append(a)
            elif isinstance(a, (list, tuple)):
                flat.extend(e for e in a if isinstance(e, DTensorSpec))
        return [flat], []
    lists = [
        a for a in operands
        if isinstance(a, (list, tuple)) and any(isinstance(e, DTensorSpec) for e in a)
    ]
    shared = [a for a in operands if isinstance(a, DTensorSpec)]
    n = len(lists[0]) if lists else 0
    if any(len(lst) != n for lst in lists):
        raise ValueError(f"{op}: tensor lists have different lengths {[len(x) for x in lists]}")
    slots = [[lst[i] for lst in lists if isinstance(lst[i], DTensorSpec)] for i in range(n)]
    return slots, shared


def _elementwise_sharding(op: torch._ops.OpOverload, schema: OpSchema) -> OutputSharding:
    slots, shared = _tensor_slots(op, schema)
    all_specs = [s for slot in slots for s in slot] + shared
    for s in shared:
        if not all(p.is_replicate() for p in s.placements):
            raise unsupported(
                op, all_specs, f": the shared operand {spec_str(s)} must be Replicate"
            )
    mains = [_slot_main(op, slot, all_specs) for slot in slots if slot]
    if not mains:
        raise unsupported(op, all_specs)
    if _is_list_op(op) and op._schema.name.endswith("_"):
        # In place over lists: item i of the first list is written, so it must be the layout
        # every other operand of item i shares (a replicated scalar cannot absorb a shard).
        for slot, main in zip(slots, mains):
            if not same_layout(slot[0], main):
                raise ValueError(
                    f"{op}: an in-place op would write {spec_str(main)} into an operand of "
                    f"layout {spec_str(slot[0])}; use the out-of-place op."
                )
    # Global output metadata (dtype promotion, dtype= kwargs) from DTensor's own fake-tensor
    # propagation. Runs once per (op, layouts): the result is cached by the C++ dispatcher.
    metas = DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_non_cached(schema)

    def out_spec(main: DTensorSpec, meta: TensorMeta | None) -> DTensorSpec | None:
        if meta is None:
            return None
        if tuple(meta.shape) != tuple(main.tensor_meta.shape):
            raise ValueError(
                f"{op}: the result shape {tuple(meta.shape)} differs from the operand shape "
                f"{tuple(main.tensor_meta.shape)} ({spec_str(main)}); on RaggedShard DTensors "
                "element-wise ops must not broadcast the sharded operand."
            )
        return DTensorSpec(main.mesh, main.placements, tensor_meta=meta)

    if metas is None:
        output: Any = None
    elif isinstance(metas, TensorMeta):
        output = out_spec(mains[0], metas)
    elif _is_list_op(op):
        if len(metas) != len(mains):
            raise unsupported(op, all_specs, ": unexpected number of outputs")
        output = tuple(out_spec(m, t) for m, t in zip(mains, metas))
    else:  # a single op with several outputs (e.g. frexp): all keep the operand's layout
        output = tuple(out_spec(mains[0], t) for t in metas)
    if isinstance(output, DTensorSpec) and op._schema.name.endswith("_") and not _is_list_op(op):
        self_spec = schema.args_schema[0] if schema.args_schema else None
        if not (isinstance(self_spec, DTensorSpec) and same_layout(self_spec, output)):
            raise ValueError(
                f"{op}: an in-place op would change self's layout from {spec_str(self_spec)} "
                f"to {spec_str(output)}; use the out-of-place op."
            )
    return OutputSharding(output)


@functools.lru_cache(maxsize=4096)
def _elementwise_sharding_cached(op: torch._ops.OpOverload, schema: OpSchema) -> OutputSharding:
    # Used only when C++ could not build its own cache key (it then asks for a cached answer).
    return _elementwise_sharding(op, schema)


def clear_sharding_caches() -> None:
    """Forget every cached sharding decision: ours and DTensor's (its C++ fast-path cache and
    its Python one, this thread's).

    A cached output spec holds the ``DeviceMesh`` object it was computed with, and meshes of the
    same ranks compare equal whatever rank built them; a ``DeviceMesh`` keeps the coordinate of
    the rank that built it. So a process that ran as another rank (the dry run's fake ranks) or a
    child forked from a process that had computed shardings would get DTensors on a mesh that
    says it is another rank: full state dicts then gathered to the wrong rank. Called after the
    dry run and, through ``os.register_at_fork``, in every forked child.
    """
    _elementwise_sharding_cached.cache_clear()
    clear_cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_cpp is not None:
        clear_cpp()
    propagate = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    if hasattr(propagate, "cache_clear"):
        propagate.cache_clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=clear_sharding_caches)


# ---------------------------------------------------------------------------------------------
# copy_ between two layouts of the same tensor: redistribute the source, then copy locally.
# ---------------------------------------------------------------------------------------------
def _copy_across_layouts(op, args, kwargs):
    """``dst.copy_(src)`` where exactly the layouts differ (e.g. Replicate/Shard -> RaggedShard).

    Redistributes ``src`` to ``dst``'s placement (``_dtensor``'s redistribution: a local
    slice from Replicate, one all-to-all from Shard/RaggedShard), then copies locally. Returns
    ``None`` when the element-wise rule applies instead (same layout or a scalar-like ``src``).
    """
    bound = bind_args(op, args, kwargs)
    dst, src = bound["self"], bound["src"]
    if not isinstance(dst, DTensor):
        return None
    if not isinstance(src, DTensor):
        # A plain multi-element ``src`` gets here only under DTensor's implicit replication
        # (``implicit_replication()``): the full tensor on every rank; keep this rank's range.
        if src.numel() == 1 or tuple(src.shape) != tuple(dst.shape) \
                or not has_ragged(dst._spec):
            return None
        placement, rank = ragged_shard_and_rank(dst.device_mesh, dst.placements, str(op))
        piece = local_slice(src.contiguous(), placement, rank)
        dst._local_tensor.copy_(piece, non_blocking=bool(bound["non_blocking"]))
        return dst
    if same_layout(dst._spec, src._spec) or is_scalar_like(src._spec):
        return None
    if tuple(dst.shape) != tuple(src.shape) or dst.device_mesh != src.device_mesh:
        return None
    moved = src.redistribute(dst.device_mesh, dst.placements)
    dst._local_tensor.copy_(moved._local_tensor, non_blocking=bool(bound["non_blocking"]))
    return dst


# ---------------------------------------------------------------------------------------------
# The hooks (registered by ``lightning_vescale.placement.install``).
# ---------------------------------------------------------------------------------------------
def wrap_slow_path(original: Callable[..., object]) -> Callable[..., object]:
    """torch's ``_propagate_op_sharding_dispatch_slow_path`` (``original``) with ragged schemas
    answered here (design note [ragged-ops]); every other schema goes to ``original``."""

    def _slow_path(op_call, args, kwargs, op_info, try_cache):
        # Runs only on a C++ sharding-cache miss. Non-ragged schemas: untouched torch path.
        if not _schema_has_ragged(op_info):
            return original(op_call, args, kwargs, op_info, try_cache)
        activate_flat_step()  # the process has RaggedShard DTensors: list ops go flat
        direct = (REDUCTION_HANDLERS.get(op_call) or RANDOM_HANDLERS.get(op_call)
                  or INIT_HANDLERS.get(op_call))
        if direct is not None:
            return direct(op_call, args, kwargs)
        if op_call is aten.copy_.default:
            out = _copy_across_layouts(op_call, args, kwargs)
            if out is not None:
                return out
        if is_elementwise_op(op_call):
            if try_cache:
                return _elementwise_sharding_cached(op_call, op_info.schema)
            return _elementwise_sharding(op_call, op_info.schema)
        if torch._C._dispatch_has_kernel_for_dispatch_key(
            op_call.name(), torch._C.DispatchKey.CompositeImplicitAutograd
        ):
            # Same as torch's slow path: composite ops reaching dispatch (inference mode) are
            # decomposed; their parts come back through here and are checked one by one.
            out = op_call.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        raise unsupported(op_call, op_info.flat_args_schema)

    _slow_path.__wrapped__ = original  # type: ignore[attr-defined]
    return _slow_path


def guard_custom_handler(handler: Callable[..., object]) -> Callable[..., object]:
    """Wrap a torch-provided custom op handler so that ragged inputs fail loudly."""

    def guarded(op_call, args, kwargs):
        specs = [a._spec for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
        if any(has_ragged(s) for s in specs):
            raise unsupported(op_call, specs)
        return handler(op_call, args, kwargs)

    guarded.__wrapped__ = handler  # type: ignore[attr-defined]
    return guarded


#: torch's own custom handlers that would mis-handle a ragged layout (they assume
#: Shard/Replicate); :func:`guard_custom_handler` wraps each.
GUARDED_CUSTOM_OPS = (
    aten.argmin.default,
    aten.argmax.default,
    aten.convolution.default,
    aten.convolution_backward.default,
)
