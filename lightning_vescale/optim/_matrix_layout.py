"""Layer 4: which whole matrices of a parameter a rank preconditions (SOAP, Shampoo), and how
their states are exported to and imported from distributed checkpoint (design note
[distributed-soap])."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_vescale.optim._base import ShardLayout, local_view, param_layout
from lightning_vescale.placement import RaggedShard, ragged_from_local

__all__ = ["MatrixLayout", "matrix_layout"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatrixLayout:
    """The matrices of one parameter that this rank steps.

    ``count`` matrices of ``unit_shape`` (``(m, n)``, ``(n,)`` for a preconditioned vector, or
    ``(local elements,)`` with nothing preconditioned: element-wise), the first being matrix
    ``first`` of ``total``; ``replicated``: split matrices, every rank steps all of them from a
    gathered gradient. ``counts``: matrices per shard rank (for exporting factors).
    """

    unit_shape: tuple[int, ...]
    preconditioned: tuple[bool, ...]
    count: int
    first: int
    total: int
    counts: tuple[int, ...]
    replicated: bool
    layout: ShardLayout

    def export(self, key: str, value: Any) -> Any:
        """A state for ``state_dict``: DTensors in the parameter's layout (moments) or split over
        the matrix dimension (factors); full plain tensors when replicated."""
        if key == "step" or not isinstance(value, Tensor):
            return value
        lay = self.layout
        if key in _MOMENTS:
            return value.view(lay.shape) if self.replicated else lay.to_dtensor(value)
        if self.replicated or lay.mesh is None or lay.placement is None:
            return value
        assert lay.mesh_info is not None
        placements = list(lay.placements)
        placements[lay.mesh_info.shard_mesh_dim] = RaggedShard((0,), list(self.counts))
        return ragged_from_local(value.reshape(-1), lay.mesh, placements,
                                 (self.total, *value.shape[1:]), autograd=False)

    def import_(self, key: str, value: Any, p: Tensor, name: str, who: str = "SOAP") -> Any:
        """A saved state as this rank steps it (see :meth:`export`; full single-process states
        and DTensors in another layout, which are gathered, are accepted)."""
        if key == "step":
            return value.detach().float().cpu().clone() if isinstance(value, Tensor) else \
                torch.tensor(float(value))
        if not isinstance(value, Tensor):
            return value
        device = local_view(p.detach()).device
        if key in _MOMENTS:
            if value.numel() != self.layout.numel:
                raise ValueError(f"{who}.load_state_dict: state {key!r} of parameter {name} has "
                                 f"{value.numel()} elements, the parameter {self.layout.numel}; "
                                 "was it saved for another model?")
            if self.replicated:
                full = value.full_tensor() if isinstance(value, DTensor) else value
                return full.detach().reshape(-1).float().to(device).clone()
            local = self.layout.local_part(value)
            return local.detach().reshape(-1).float().to(device).clone()
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if full.shape[0] == self.total and not self.replicated:
            full = full[self.first:self.first + self.count]
        if full.shape[0] != self.count:
            raise ValueError(f"{who}.load_state_dict: state {key!r} of parameter {name} holds "
                             f"{full.shape[0]} matrices, expected {self.total}; was it saved "
                             "with another max_precond_dim or model?")
        return full.detach().float().to(device).clone()


def matrix_layout(p: Tensor, *, max_precond_dim: int, precondition_1d: bool,
                  name: str) -> MatrixLayout:
    """How SOAP steps ``p`` on this rank (design note [distributed-soap])."""
    layout = param_layout(p, where=name)
    shape = tuple(p.shape)
    if len(shape) >= 2:
        unit = shape[-2:]
        pre = tuple(d <= max_precond_dim for d in unit)
    elif len(shape) == 1:
        unit = shape
        pre = (bool(precondition_1d) and shape[0] <= max_precond_dim,)
    else:
        unit, pre = (1,), (False,)
    ranks = len(layout.ranges)
    if not any(pre):  # element-wise: any layout is local
        n = layout.local_numel
        return MatrixLayout(unit_shape=(n,), preconditioned=(False,), count=1, first=0, total=1,
                            counts=(1,) * ranks, replicated=False, layout=layout)
    unit_numel = max(math.prod(unit), 1)
    total = layout.numel // unit_numel if layout.numel else 0
    whole = all(a % unit_numel == 0 and b % unit_numel == 0 for a, b in layout.ranges)
    if layout.placement is None or not whole:
        return MatrixLayout(unit_shape=unit, preconditioned=pre, count=total, first=0,
                            total=total, counts=(total,) * ranks,
                            replicated=layout.placement is not None, layout=layout)
    counts = tuple((b - a) // unit_numel for a, b in layout.ranges)
    return MatrixLayout(unit_shape=unit, preconditioned=pre, count=counts[layout.rank],
                        first=layout.start // unit_numel, total=total, counts=counts,
                        replicated=False, layout=layout)
