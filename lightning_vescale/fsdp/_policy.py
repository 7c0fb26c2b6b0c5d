"""``MixedPrecisionPolicy``: the one object that says which dtypes a group computes and reduces in.

``fully_shard`` keeps the policy it is given whole (it is frozen) and hands that very object to
the group's :class:`~lightning_vescale.fsdp._param_group.ParamGroup` (DBuffer dtypes) and to the
module's :class:`~lightning_vescale.fsdp._state.FSDPState` (input/output casts): every consumer
reads ``.mp_policy``, no field is copied elsewhere. PyTorch FSDP2's policy (same fields) is
converted once, at ``fully_shard``, by :func:`as_policy`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "as_offload_policy", "as_policy"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """Mixed precision for ``fully_shard`` (same fields and meaning as FSDP2's).

    Args:
        param_dtype: dtype of the all-gather and of the unsharded parameters used in compute
            (``None``: the parameters' own dtype). Shards stay in the original dtype (the fp32
            master copy) and the optimizer steps on them.
        reduce_dtype: dtype of the gradient reduce-scatter (``None``: ``param_dtype``).
        output_dtype: cast floating-point forward outputs to this dtype (``None``: no cast).
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for f in ("param_dtype", "reduce_dtype", "output_dtype"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, torch.dtype) or not v.is_floating_point):
                raise TypeError(
                    f"MixedPrecisionPolicy.{f} must be a floating-point torch.dtype or None, "
                    f"got {f}={v!r}")


_DTYPE_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype")


def as_policy(mp_policy: Any) -> MixedPrecisionPolicy:
    """The ``mp_policy`` argument of ``fully_shard`` as a :class:`MixedPrecisionPolicy`.

    ``None`` is the default policy (no casts); one of ours is returned as is (the same object);
    PyTorch FSDP2's ``MixedPrecisionPolicy`` (same fields) is converted.

    Raises:
        TypeError: anything else.
    """
    if mp_policy is None:
        return MixedPrecisionPolicy()
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    if all(hasattr(mp_policy, f) for f in _DTYPE_FIELDS):  # PyTorch's FSDP2 policy
        return MixedPrecisionPolicy(**{f.name: getattr(mp_policy, f.name, f.default)
                                       for f in dataclasses.fields(MixedPrecisionPolicy)})
    raise TypeError(
        f"mp_policy must be a lightning_vescale.fsdp.MixedPrecisionPolicy or None, got "
        f"{type(mp_policy).__name__}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CPUOffloadPolicy:
    """Keep sharded parameters, their gradients and the optimizer states in CPU memory (same
    field and meaning as FSDP2's ``CPUOffloadPolicy``).

    Each group's all-gather input is copied to the compute device (the mesh's) per all-gather,
    and each reduced gradient shard copied back (design note [dbuffer-offload] in
    ``lightning_vescale/dbuffer.py``). The optimizer then steps on CPU.

    Args:
        pin_memory: pin the CPU storage (when an accelerator exists) so the copies can overlap.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise TypeError(f"CPUOffloadPolicy.pin_memory must be a bool, got "
                            f"pin_memory={self.pin_memory!r}")


def as_offload_policy(offload_policy: Any) -> CPUOffloadPolicy | None:
    """The ``offload_policy`` argument of ``fully_shard``: ``None`` (no offload) or ours.

    ``None`` and FSDP2's base ``OffloadPolicy()`` mean no offload; ours is returned as is;
    FSDP2's ``CPUOffloadPolicy`` is converted.

    Raises:
        TypeError: anything else.
    """
    if offload_policy is None or isinstance(offload_policy, CPUOffloadPolicy):
        return offload_policy
    cls = type(offload_policy)
    if cls.__module__.startswith("torch.distributed.fsdp"):
        if cls.__name__ == "OffloadPolicy":
            return None
        if cls.__name__ == "CPUOffloadPolicy":
            return CPUOffloadPolicy(pin_memory=bool(offload_policy.pin_memory))
    raise TypeError(
        f"offload_policy must be a lightning_vescale.fsdp.CPUOffloadPolicy (or FSDP2's "
        f"OffloadPolicy/CPUOffloadPolicy) or None, got {cls.__name__}")
