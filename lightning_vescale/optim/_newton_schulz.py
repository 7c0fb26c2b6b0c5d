"""Newton–Schulz orthogonalisation for Muon: a readable reference beside the fast path.

Design note [newton-schulz]
---------------------------
Muon replaces each 2-D update ``G`` by (approximately) ``U V^T`` where ``G = U S V^T``. It does
so with ``k`` steps of the quintic iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``,
starting from ``X = G / ||G||_F`` (so the spectral norm is at most one). The iteration works on
the wide orientation (``rows <= cols``) so that the Gram matrix ``A`` is the small one.

Two implementations live here, as in Keller Jordan's Muon:

* :func:`newton_schulz_reference` — the textbook formula, in a dtype of your choice (default
  float32), no fused kernels. Tests use it to check the fast path against the mathematics.
* :func:`newton_schulz` — the fast path. For a single matrix it performs *exactly* the operations
  of ``torch.optim.Muon`` (bfloat16, ``addmm`` with the same ``beta``/``alpha``), so its result is
  bitwise equal to torch's. It also accepts a batch ``(B, m, n)`` of same-shape matrices and then
  uses ``baddbmm`` with one norm per matrix; on CPU this is bitwise equal to running the matrices
  one by one (tested); other backends may differ in the last bit.

Both are pure functions of their inputs (no process group). :func:`newton_schulz_flops` is the
cost model the distributed optimizer load-balances on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "DEFAULT_EPS",
    "newton_schulz",
    "newton_schulz_reference",
    "newton_schulz_flops",
    "validate_ns_args",
]

# Keller Jordan's coefficients (also torch.optim.Muon's defaults).
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7


def validate_ns_args(ns_coefficients: Sequence[float], ns_steps: int, eps: float) -> None:
    """Raise ``ValueError`` naming the bad Newton–Schulz argument."""
    if len(tuple(ns_coefficients)) != 3:
        raise ValueError(
            f"ns_coefficients must be a tuple of exactly 3 floats (a, b, c), got "
            f"{ns_coefficients!r}; the default is {DEFAULT_NS_COEFFICIENTS}."
        )
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or not 0 <= ns_steps < 100:
        raise ValueError(
            f"ns_steps must be an int in [0, 100), got {ns_steps!r}; the default is "
            f"{DEFAULT_NS_STEPS}."
        )
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got eps={eps!r}; the default is {DEFAULT_EPS}.")


def newton_schulz(
    grad: Tensor,
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """Orthogonalise ``grad`` (``(m, n)`` or a batch ``(B, m, n)``); returns bfloat16.

    For a 2-D input this is operation-for-operation ``torch.optim.Muon``'s
    ``_zeropower_via_newtonschulz`` (bitwise equal result). The result has the input's shape; for
    tall matrices it is a transposed (non-contiguous) view, as in torch.
    """
    if grad.ndim not in (2, 3):
        raise ValueError(
            f"newton_schulz expects a 2-D matrix or a 3-D batch of matrices, got shape "
            f"{tuple(grad.shape)}; flatten conv-style weights with .reshape(shape[0], -1) first."
        )
    a, b, c = ns_coefficients
    tall = grad.size(-2) > grad.size(-1)
    x = grad.bfloat16()
    if tall:
        x = x.mT
    if grad.ndim == 2:
        # Out of place (torch uses div_, same bits): ``grad.bfloat16()`` is ``grad`` itself for a
        # bf16 input, and the caller's tensor (e.g. a momentum buffer) must not be scaled.
        x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
        for _ in range(ns_steps):
            gram = x @ x.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(ns_steps):
            gram = x @ x.mT
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
    if tall:
        x = x.mT
    return x


def newton_schulz_reference(
    grad: Tensor,
    ns_coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = DEFAULT_NS_STEPS,
    eps: float = DEFAULT_EPS,
    *,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The textbook quintic Newton–Schulz iteration on a 2-D matrix, computed in ``dtype``.

    ``X0 = G / max(||G||_F, eps)``; ``A = X X^T``; ``X <- a X + (b A + c A A) X`` on the wide
    orientation. Slow and simple on purpose: the yardstick for :func:`newton_schulz`.
    """
    if grad.ndim != 2:
        raise ValueError(f"newton_schulz_reference expects a 2-D matrix, got {tuple(grad.shape)}")
    a, b, c = ns_coefficients
    x = grad.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / torch.clamp(torch.linalg.matrix_norm(x), min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.T if tall else x


def newton_schulz_flops(rows: int, cols: int, ns_steps: int = DEFAULT_NS_STEPS) -> int:
    """Multiply-add FLOPs (2 per MAC) of :func:`newton_schulz` on a ``rows x cols`` matrix.

    With ``m = min(rows, cols)``, ``n = max(rows, cols)``, each step costs ``X X^T`` (2 m^2 n),
    ``A A`` (2 m^3) and ``B X`` (2 m^2 n): ``~ rows * cols * min(rows, cols)`` to leading order,
    which is the cost the distributed optimizer balances across owner ranks.
    """
    m, n = min(rows, cols), max(rows, cols)
    return ns_steps * (4 * m * m * n + 2 * m * m * m)
