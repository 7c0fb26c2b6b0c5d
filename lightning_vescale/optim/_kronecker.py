"""Layer 4: Kronecker-factor machinery for whole-matrix preconditioners (SOAP, Shampoo).

Design note [kronecker-factors]
-------------------------------
Shampoo-family optimizers precondition a gradient matrix ``G`` (``m x n``) with two factors,
``L ~ E[G G^T]`` (``m x m``) and ``R ~ E[G^T G]`` (``n x n``), kept as exponential moving
averages. SOAP (arXiv 2409.11321) runs Adam in their *eigenbasis*: with ``Q_L, Q_R`` the
eigenvectors (largest eigenvalue first), a matrix is *projected* as ``Q_L^T X Q_R`` and
*projected back* as ``Q_L X Q_R^T``. The eigenbasis starts from ``torch.linalg.eigh`` and is then
refreshed every ``precondition_frequency`` steps by one power iteration and a QR decomposition
(cheaper than ``eigh``), re-sorting the columns by the estimated eigenvalues; Adam's second moment,
which lives in the projected coordinates, is permuted along with them.

Shampoo (arXiv 2309.06497) instead multiplies by the factors' inverse roots,
``L^(-1/r) G R^(-1/r)`` (:func:`inverse_root`, :func:`precondition`).

These are pure functions of ONE matrix (or vector) and its factors, no optimizer state and no
communication: the reference the optimizers are tested against, and the code they run on each
whole matrix wherever it lies (the rank holding it under ``granularity="matrix"``). A dimension
larger than ``max_precond_dim`` has no factor (``None``): it is left unrotated, as the authors'
implementation does, so the optimizer degrades to Adam along it.

Design note [shampoo-blocks]
----------------------------
Shampoo instead *blocks* a large matrix, as Distributed Shampoo does (``multi_dim_split`` in
facebookresearch/optimizers' ``distributed_shampoo/utils/shampoo_utils.py``: ``torch.split``
with ``split_size=max_preconditioner_dim`` along every dimension, dimension 0 first): the rows
are cut into runs of ``block`` (the last run shorter when ``block`` does not divide them), the
columns likewise, and every tile is preconditioned as a small matrix of its own, with its own
factors. :func:`split_sizes` and :func:`matrix_blocks` are that pure function of the shape;
tiles are listed row-major, Distributed Shampoo's order. :func:`block_views` lays the tiles'
``d x d`` factors end to end in one flat tensor per matrix and dimension (no padding), which is
how the optimizer keeps and checkpoints them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "Factors",
    "accumulate_factors_",
    "block_views",
    "eigenbasis",
    "init_factors",
    "inverse_root",
    "matrix_blocks",
    "precondition",
    "project",
    "project_back",
    "refresh_eigenbasis_qr",
    "split_sizes",
]

#: One factor per dimension of the preconditioned tensor (``None``: that dimension is not
#: preconditioned).
Factors = list


def init_factors(shape: Sequence[int], *, max_precond_dim: int, precondition_1d: bool,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> Factors:
    """Zero factors for a tensor of ``shape`` (1-D or 2-D): ``d x d`` per dimension of size
    ``d <= max_precond_dim``; a 1-D tensor only with ``precondition_1d``."""
    if len(shape) == 1 and not precondition_1d:
        return [None]
    return [torch.zeros(d, d, device=device, dtype=dtype) if d <= max_precond_dim else None
            for d in shape]


def accumulate_factors_(factors: Factors, grad: Tensor, beta: float) -> None:
    """``F_i <- beta F_i + (1 - beta) G_(i) G_(i)^T`` for every factor (``G_(i)``: ``grad``
    with dimension ``i`` first, the others flattened)."""
    dims = grad.dim()
    for i, f in enumerate(factors):
        if f is None:
            continue
        other = [d for d in range(dims) if d != i]
        outer = torch.tensordot(grad, grad, dims=[other, other]) if other else \
            torch.outer(grad, grad)
        f.lerp_(outer.to(f.dtype), 1.0 - beta)


def eigenbasis(factors: Factors) -> list[Tensor | None]:
    """Eigenvectors of every factor, columns by descending eigenvalue (``eigh`` of ``F + 1e-30
    I``; in float64 where float32 fails to converge)."""
    out: list[Tensor | None] = []
    for f in factors:
        if f is None:
            out.append(None)
            continue
        eye = torch.eye(f.shape[0], device=f.device, dtype=f.dtype)
        try:
            q = torch.linalg.eigh(f + 1e-30 * eye)[1]
        except RuntimeError:  # ill-conditioned: retry in double precision
            q = torch.linalg.eigh((f + 1e-30 * eye).double())[1].to(f.dtype)
        out.append(torch.flip(q, [1]))
    return out


def refresh_eigenbasis_qr(factors: Factors, basis: list[Tensor | None],
                          exp_avg_sq: Tensor) -> tuple[list[Tensor | None], Tensor]:
    """One power iteration + QR per factor from the current basis; returns the new basis and
    ``exp_avg_sq`` with its projected coordinates permuted to the new column order."""
    new: list[Tensor | None] = []
    for i, (f, q) in enumerate(zip(factors, basis)):
        if f is None:
            new.append(None)
            continue
        product = f @ q
        estimated = (q * product).sum(dim=0)  # diag(Q^T F Q)
        order = torch.argsort(estimated, descending=True)
        exp_avg_sq = exp_avg_sq.index_select(i, order)
        new.append(torch.linalg.qr(product.index_select(1, order).float())[0].to(q.dtype))
    return new, exp_avg_sq


def project(x: Tensor, basis: list[Tensor | None]) -> Tensor:
    """``x`` in the eigenbasis: each preconditioned dimension ``i`` contracted with ``Q_i``."""
    return _contract(x, basis, transpose=False)


def project_back(x: Tensor, basis: list[Tensor | None]) -> Tensor:
    """Inverse of :func:`project` (the bases are orthogonal)."""
    return _contract(x, basis, transpose=True)


def inverse_root(factor: Tensor, root: float, epsilon: float) -> Tensor:
    """``(F + epsilon I)^(-1/root)`` of a symmetric factor through one ``eigh`` (eigenvalues
    clamped at 0 first: rounding can make them slightly negative); Shampoo's preconditioner."""
    try:
        values, vectors = torch.linalg.eigh(factor)
    except RuntimeError:  # ill-conditioned: retry in double precision
        values, vectors = torch.linalg.eigh(factor.double())
    scaled = (values.clamp_min(0) + epsilon).pow(-1.0 / root)
    return ((vectors * scaled) @ vectors.T).to(factor.dtype)


def precondition(x: Tensor, roots: list[Tensor | None]) -> Tensor:
    """``x`` with each dimension ``i`` multiplied by the symmetric ``roots[i]`` (``L^(-1/r) X
    R^(-1/r)`` for a matrix); a ``None`` leaves that dimension as it is."""
    return _contract(x, roots, transpose=False)


def _contract(x: Tensor, basis: list[Tensor | None], *, transpose: bool) -> Tensor:
    # dimension by dimension: tensordot puts the contracted dimension last, so after all of them
    # the dimensions are back in order (an unpreconditioned one is rotated to the end as is)
    for q in basis:
        if q is None:
            x = x.permute(*range(1, x.dim()), 0)
        else:
            x = torch.tensordot(x, q, dims=[[0], [1 if transpose else 0]])
    return x


def split_sizes(d: int, block: int) -> tuple[int, ...]:
    """The runs ``torch.split(range(d), block)`` makes: full ``block``s, then the rest."""
    if block < 1:
        raise ValueError(f"split_sizes: block must be >= 1, got {block!r}")
    return tuple(min(block, d - start) for start in range(0, d, block))


def matrix_blocks(shape: Sequence[int], block: int) -> list[tuple[slice, slice]]:
    """The tiles of an ``m x n`` matrix cut into runs of at most ``block`` along both
    dimensions, row-major (design note [shampoo-blocks])."""
    m, n = shape
    rows, cols = _starts(split_sizes(m, block)), _starts(split_sizes(n, block))
    return [(slice(a, b), slice(c, d)) for a, b in rows for c, d in cols]


def block_views(flat: Tensor, sizes: Sequence[int]) -> list[Tensor]:
    """Consecutive ``d x d`` views of the 1-D ``flat`` (``sum d^2`` elements), one per ``d``
    of ``sizes``: the tiles' factors for one dimension of one matrix."""
    out, at = [], 0
    for d in sizes:
        out.append(flat[at:at + d * d].view(d, d))
        at += d * d
    assert at == flat.numel(), (at, flat.numel())
    return out


def _starts(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    out, at = [], 0
    for d in sizes:
        out.append((at, at + d))
        at += d
    return out
