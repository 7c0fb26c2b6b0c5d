"""One rank's range of a whole-tensor random draw on the CPU generator, without the whole tensor
(private; used by ``_random_ops``, design note [ragged-random]).

torch's CPU generator (mt19937) cannot jump ahead, but its kernels draw in element order: the
``uniform_`` family (``uniform_``, ``random_``, ``exponential_``, ``geometric_``,
``log_normal_``, ``cauchy_``, ``bernoulli_`` with a float ``p``) takes the same draws per
element whatever the tensor's size, and ``normal_`` on fp32/fp64 with at least 16 elements
first draws one uniform per element, then turns each aligned block of 16 into normals, then,
when the size is not a multiple of 16, redraws its last 16 values from 16 fresh uniforms. So
drawing the same op over consecutive pieces (of multiples of 16 for ``normal_``, the tail done
as the kernel does) gives the whole draw's values bit for bit and leaves the generator where the
whole draw does: the pieces before and after this rank's range are drawn into a small scratch
buffer and dropped, this rank's range straight into its local tensor. The time is the whole
draw's; the memory is ``SCRATCH_NUMEL`` elements instead of the whole tensor.
(Checked against the whole draw for fp32/fp64/bf16/fp16, sizes 1 to 300k, pieces of 7 to 4096
elements, 1 and 2 threads; bf16/fp16 ``normal_`` does not follow the fp32 pattern and keeps the
whole draw, as do other devices' generators: ``can_draw_range``.)
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_vescale.placement._common import aten

__all__ = ["SCRATCH_NUMEL", "can_draw_range", "draw_range"]

#: Elements of the scratch buffer the skipped pieces are drawn into (a multiple of 16).
SCRATCH_NUMEL = 1 << 16

_SERIAL = frozenset({"uniform_", "random_", "exponential_", "geometric_", "log_normal_",
                     "cauchy_", "bernoulli_"})
_BLOCK = 16  # the CPU normal_ kernel's block


def _name(op: Any) -> str:
    return op._schema.name.split("::")[-1]


def can_draw_range(op: Any, local: torch.Tensor, numel: int, kwargs: dict) -> bool:
    """Whether :func:`draw_range` gives the whole draw's values for ``op`` on ``local``'s
    generator: the CPU generator (``local`` on the CPU, and any ``generator=`` a CPU one) and
    an op whose CPU kernel draws in element order (above)."""
    gen = kwargs.get("generator")
    if local.device.type != "cpu" or (gen is not None and gen.device.type != "cpu"):
        return False
    name = _name(op)
    if name == "normal_":
        return local.dtype in (torch.float32, torch.float64) and numel >= _BLOCK
    return name in _SERIAL


def draw_range(op: Any, local: torch.Tensor, start: int, numel: int, rest: tuple,
               kwargs: dict) -> None:
    """Fill the 1-D ``local`` with elements ``[start, start + local.numel())`` of
    ``op(whole, *rest, **kwargs)`` for a whole tensor of ``numel`` elements, advancing the
    generator exactly as that whole draw does (requires :func:`can_draw_range`)."""
    stop = start + local.numel()
    target = local if local.is_contiguous() else torch.empty_like(local)
    scratch = torch.empty(min(SCRATCH_NUMEL, numel), dtype=local.dtype, device=local.device)
    if _name(op) != "normal_":
        _pieces(op, target, start, stop, 0, numel, scratch, rest, kwargs, step=1)
    else:
        main = numel - numel % _BLOCK
        _pieces(op, target, start, stop, 0, main, scratch, rest, kwargs, step=_BLOCK)
        if main < numel:  # the kernel's tail: the last partial block's uniforms are drawn,
            # then the last 16 values are redrawn from 16 new ones
            aten.uniform_.default(scratch[: numel - main], generator=kwargs.get("generator"))
            _pieces(op, target, start, stop, numel - _BLOCK, numel, scratch, rest, kwargs,
                    step=_BLOCK)
    if target is not local:
        local.copy_(target)


def _pieces(op: Any, target: torch.Tensor, start: int, stop: int, lo: int, hi: int,
            scratch: torch.Tensor, rest: tuple, kwargs: dict, step: int) -> None:
    """Draw elements ``[lo, hi)`` of the whole tensor in order, in pieces of at most
    ``scratch``'s size (a multiple of ``step``); the part inside ``[start, stop)`` lands in
    ``target`` (drawn there directly when a piece lies wholly inside)."""
    width = max(step, scratch.numel() // step * step)
    pos = lo
    while pos < hi:
        # a piece ends at the range's bounds (aligned to ``step``) so most of it lands directly
        end = min(hi, pos + width)
        for bound in (start, stop):
            aligned = lo + (bound - lo) // step * step
            if pos < aligned < end:
                end = aligned
        if start <= pos and end <= stop:
            op(target[pos - start: end - start], *rest, **kwargs)
        else:
            piece = scratch[: end - pos] if end - pos <= scratch.numel() else torch.empty(
                end - pos, dtype=scratch.dtype, device=scratch.device)
            op(piece, *rest, **kwargs)
            a, b = max(pos, start), min(end, stop)
            if a < b:
                target[a - start: b - start].copy_(piece[a - pos: b - pos])
        pos = end
