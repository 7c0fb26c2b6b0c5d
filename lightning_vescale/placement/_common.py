"""Shared helpers of the RaggedShard DTensor extension (private to the placement package).

Used by ``_dtensor`` (redistribution, checkpoint chunks), ``_ops`` (the dispatch hook,
element-wise ops) and ``_reductions`` (norms, reductions): recognising ragged placements and
operand specs, comparing layouts, binding an op's arguments by name, and the one error message
that lists what RaggedShard DTensors support. Its own module so that its users import it one-way
(``_ragged_shard`` <- ``_common`` <- ``_dtensor`` / ``_reductions`` <- ``_ops``), like FSDP2's
``_fsdp_common``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from lightning_vescale.mesh import collective_device
from lightning_vescale.placement._ragged_shard import RaggedShard

__all__ = [
    "SUPPORTED_FAMILIES",
    "all_gather_flat",
    "aten",
    "bind_args",
    "has_ragged",
    "has_ragged_placement",
    "is_scalar_like",
    "same_layout",
    "spec_str",
    "unsupported",
]

aten = torch.ops.aten


#: What RaggedShard DTensors support, quoted by every "not supported" error.
SUPPORTED_FAMILIES = (
    "element-wise (pointwise) ops and their _foreach_* forms, whose tensor operands have the "
    "same global shape, stride and placement or are scalar-like (Python scalars, 0-d/1-element "
    "plain tensors or Replicate DTensors); copy_ (also from another layout of the same "
    "tensor), dtype casts, clone/detach and *_like "
    "factories; in-place random fills (uniform_, normal_, bernoulli_, random_, ...) and "
    "rand_like/randn_like/randint_like; new_empty/new_zeros/new_ones/new_full (Replicate for "
    "another shape); slices of dim 0 with step 1 (views); reductions "
    "sum/mean/amax/amin/linalg.vector_norm over all dims or some (dim=...), max/min/any/all "
    "over all dims, "
    "_foreach_norm/_foreach_powsum/_foreach_max (results are Replicate); equal/allclose"
)


def has_ragged_placement(placements: Iterable[object] | None) -> bool:
    """True when some placement of ``placements`` (``None``: no placements) is a ``RaggedShard``."""
    return placements is not None and any(isinstance(p, RaggedShard) for p in placements)


def has_ragged(spec: object) -> bool:
    """True when ``spec`` is a ``DTensorSpec`` with a ``RaggedShard`` on some mesh dim."""
    return isinstance(spec, DTensorSpec) and has_ragged_placement(spec.placements)


def spec_str(spec: object) -> str:
    """``(placements) shape=...`` of a spec, for error messages."""
    if isinstance(spec, DTensorSpec):
        shape = tuple(spec.tensor_meta.shape) if spec.tensor_meta is not None else "?"
        return f"{tuple(spec.placements)} shape={shape}"
    return repr(spec)


def unsupported(op: object, specs: Sequence[object], why: str = "") -> NotImplementedError:
    """The error (to raise) for an op RaggedShard DTensors do not define: op, operand layouts,
    ``why`` (appended to the first sentence), the supported families and the way out."""
    placements = ", ".join(spec_str(s) for s in specs if isinstance(s, DTensorSpec))
    return NotImplementedError(
        f"{op} is not supported on RaggedShard DTensors{why} (operand placements: "
        f"{placements}). RaggedShard DTensors support only {SUPPORTED_FAMILIES}. For other "
        "ops, first call .full_tensor() or .redistribute(...) to Replicate/Shard."
    )


def is_scalar_like(spec: DTensorSpec) -> bool:
    """A replicated 1-element operand with at most one dim broadcasts against a flat slice."""
    meta = spec.tensor_meta
    return (
        meta is not None
        and len(meta.shape) <= 1
        and math.prod(meta.shape) == 1
        and all(p.is_replicate() for p in spec.placements)
    )


def same_layout(a: DTensorSpec, b: DTensorSpec) -> bool:
    """Same placements, mesh, global shape and stride: the same flat range on every rank."""
    ma, mb = a.tensor_meta, b.tensor_meta
    return (
        a.placements == b.placements
        and a.mesh == b.mesh
        and ma is not None
        and mb is not None
        and tuple(ma.shape) == tuple(mb.shape)
        and tuple(ma.stride) == tuple(mb.stride)
    )


def bind_args(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Every argument of ``op``'s schema by name (defaults filled in, missing ones ``None``)."""
    out: dict[str, Any] = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        else:
            out[a.name] = a.default_value if a.has_default_value() else None
    return out


def all_gather_flat(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup,
                    mesh: DeviceMesh | None = None) -> None:
    """Gather every rank's equal-sized flat ``local`` into the flat ``output``, in rank order.

    ``all_gather_single`` (torch 2.13 deprecates ``all_gather_into_tensor`` in its favour), or the
    older name on a torch without it; looked up per call, so tests that count calls into
    ``torch.distributed`` see it. CPU-offloaded tensors on a group whose backend refuses CPU
    tensors (plain NCCL) gather on ``mesh``'s device (or the accelerator): one copy there, one
    back (design note [mesh-device]); otherwise no copy.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    where = collective_device(group, local.device, mesh)
    if where == local.device:
        gather(output, local, group=group)
        return
    staged = torch.empty_like(output, device=where)
    gather(staged, local.to(where), group=group)
    output.copy_(staged)


#: The fused optimizer kernels, element-wise over their lists like ``_foreach_*`` ops
#: (``grad_scale``/``found_inf``/tensor ``lr`` are scalar-like operands).
FUSED_OPTIMIZER_OPS = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
#: ``_foreach_*`` ops whose base op is pointwise but that reduce (or are not element-wise).
FOREACH_NOT_ELEMENTWISE = frozenset({"max", "norm", "powsum", "mm"})
#: ``_foreach_*`` ops whose base is not tagged pointwise but that act element by element.
FOREACH_EXTRA_ELEMENTWISE = frozenset({"copy", "zero"})


def foreach_is_elementwise(base: str) -> bool:
    """Whether ``_foreach_<base>`` maps each list item's elements independently (the one
    definition, shared by the operator support and the flat optimizer step)."""
    if base in FOREACH_NOT_ELEMENTWISE:
        return False
    if base in FOREACH_EXTRA_ELEMENTWISE:
        return True
    packet = getattr(aten, base, None)
    return packet is not None and any(
        torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads()
    )
