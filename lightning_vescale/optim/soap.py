"""Layer 4: SOAP, Adam in Shampoo's eigenbasis, on whole matrices of RaggedShard parameters.

Design note [distributed-soap]
------------------------------
*Math.* The authors' algorithm (Vyas et al., arXiv 2409.11321; their reference ``soap.py``) with
their defaults: per matrix ``G`` (``m x n``), factors ``L <- lerp(L, G G^T, 1 - shampoo_beta)``
and ``R <- lerp(R, G^T G, ...)`` (``shampoo_beta=None``: ``betas[1]``); eigenbases ``Q_L, Q_R``
from ``eigh`` at the first step, which only initialises (no update, so the current gradient
never projects itself), then refreshed by one power iteration + QR every
``precondition_frequency`` steps. Adam runs in the rotated coordinates: the first moment is kept
in the original space (``exp_avg.lerp_(G, 1 - beta1)``) and projected when used, the second in
the projected space (permuted with the basis on a refresh); the update ``Q_L (M' / (sqrt(V) +
eps)) Q_R^T`` with Adam's bias correction, then decoupled weight decay ``p *= 1 - lr wd``. The
pure functions are ``_kronecker.py`` (design note [kronecker-factors]).

*Which tensors are matrices.* A 2-D tensor is one matrix; a tensor of 3+ dims is a stack of its
trailing ``(shape[-2], shape[-1])`` matrices, each preconditioned on its own (experts of an
``(E, out, in)`` weight, like Muon's [muon-stacked-experts]); a 1-D tensor is a vector,
preconditioned only with ``precondition_1d`` (else Adam, as the authors do); a dimension over
``max_precond_dim`` is not rotated (Adam along it). 0-D tensors are Adam.

*Distribution.* A preconditioner needs its whole matrix. Under ``granularity="matrix"`` (or any
layout whose every rank range starts and ends on matrix boundaries) each rank steps the matrices
it holds, with their factors, on local data: **no collective**. A parameter whose matrices are
split across ranks (FSDP2's row layout, the default block-aligned one) has each matrix *owned*
by one rank: one of those holding most of it (fewest bytes moved), balanced over all parameters
by the cost ``m n (m + n)`` of a step, and contiguous within a parameter (owners never decrease
along the tensor), planned once from the layouts alone so every rank computes the same owners
(``_matrix_layout.assign_owners``, like Muon's [distributed-muon] but with the state living on
the owner). Per step and parameter: one ``all_to_all_single`` brings the gradient pieces to the
owners, the owner steps its matrices, a second brings the updates back; the results are bitwise
those of one process. Vectors and tensors without factors are element-wise and always local.

*States* live where the matrices are stepped: ``step``; ``exp_avg``, ``exp_avg_sq`` for the
rank's matrices (exported as DTensors of the parameter's global shape: in its layout when its
matrices are whole, split by owner otherwise, so distributed checkpoint reshards them); per
preconditioned dimension ``i``, ``GG{i}`` and ``Q{i}`` of shape ``(matrices, d, d)``, exported
split over the matrix dimension the same way. ``load_state_dict`` takes those, full
single-process states, or a state saved at another world size through distributed checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_vescale.optim._kronecker import (
    accumulate_factors_,
    eigenbasis,
    init_factors,
    project,
    project_back,
    refresh_eigenbasis_qr,
)
from lightning_vescale.optim._matrix_layout import MatrixLayout
from lightning_vescale.optim._whole_matrix import (
    WholeMatrixOptimizer,
    check_betas,
    check_non_negative,
    check_positive_ints,
    new_matrix_state,
    per_matrix,
)

__all__ = ["SOAP"]


class SOAP(WholeMatrixOptimizer):
    """SOAP (arXiv 2409.11321) on plain and ``fully_shard`` parameters; design note
    [distributed-soap] in this module.

    Args:
        params: parameters or groups (plain tensors, or ``DTensor``s with ``(RaggedShard,)`` /
            ``(Replicate(), RaggedShard)`` placements: FSDP and HSDP meshes).
        lr: as Adam(W)'s ``lr``.
        betas: as Adam(W)'s ``betas``.
        eps: as Adam(W)'s ``eps``.
        weight_decay: as AdamW's (decoupled).
        shampoo_beta: EMA rate of the Kronecker factors; ``None``: ``betas[1]``.
        precondition_frequency: steps between eigenbasis refreshes (power iteration + QR).
        max_precond_dim: dimensions larger than this are not preconditioned.
        merge_dims: only ``False`` (matrices are the trailing 2-D blocks; see the note).
        precondition_1d: precondition vectors (one ``n x n`` factor) instead of Adam on them.
        normalize_grads: divide each update by its RMS.
        correct_bias: Adam's bias correction.

    CPU offload (``CPUOffloadPolicy``): the owner's whole matrices and their states live on
    the CPU with the parameters, so the eigh/QR eigenbasis refreshes run on the CPU; the first
    step warns once.
    """

    matrix_math = "eigh/QR eigenbasis refreshes"  # on the CPU with offload: warned once

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 3e-3,
                 betas: tuple[float, float] = (0.95, 0.95), shampoo_beta: float | None = None,
                 eps: float = 1e-8, weight_decay: float = 0.01, precondition_frequency: int = 10,
                 max_precond_dim: int = 10000, merge_dims: bool = False,
                 precondition_1d: bool = False, normalize_grads: bool = False,
                 correct_bias: bool = True) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps,
                        weight_decay=weight_decay, precondition_frequency=precondition_frequency,
                        max_precond_dim=max_precond_dim, merge_dims=merge_dims,
                        precondition_1d=precondition_1d, normalize_grads=normalize_grads,
                        correct_bias=correct_bias)
        self.check_hparams(defaults, where="SOAP")
        super().__init__(params, defaults)

    who = "SOAP"

    def _unit_args(self, group: dict[str, Any]) -> dict[str, Any]:
        return dict(max_precond_dim=int(group["max_precond_dim"]),
                    precondition_1d=bool(group["precondition_1d"]))

    def _initialising(self, st: dict[str, Any]) -> bool:
        return not st  # the first step only builds the eigenbases

    def _step_matrices(self, st: dict[str, Any], grad: Tensor, group: dict[str, Any],
                       lay: MatrixLayout) -> Tensor | None:
        """SOAP on the matrices ``grad`` holds (flat, ``lay.count`` whole matrices of
        ``lay.unit_shape``, or element-wise when nothing is preconditioned); returns the update
        to subtract (before weight decay), ``None`` at the initialising step."""
        beta1, beta2 = group["betas"]
        shampoo_beta = group["shampoo_beta"] if group["shampoo_beta"] is not None else beta2
        g = grad.reshape(lay.count, *lay.unit_shape)
        if not st:
            self._init_state(st, g, lay, shampoo_beta)
            return None
        st["step"] += 1
        step = float(st["step"])
        exp_avg = st["exp_avg"].view(g.shape)
        exp_avg_sq = st["exp_avg_sq"].view(g.shape)
        exp_avg.lerp_(g, 1.0 - beta1)
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size *= math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
        out = torch.empty_like(g)
        refresh = int(step) % int(group["precondition_frequency"]) == 0
        for j in range(lay.count):
            basis = per_matrix(st, "Q", j, lay)
            gp = project(g[j], basis)
            exp_avg_sq[j].lerp_(gp.square(), 1.0 - beta2)
            denom = exp_avg_sq[j].sqrt().add_(group["eps"])
            norm = project_back(project(exp_avg[j], basis) / denom, basis)
            if group["normalize_grads"]:
                norm = norm / (1e-30 + norm.square().mean().sqrt())
            out[j] = norm * step_size
            factors = per_matrix(st, "GG", j, lay)
            accumulate_factors_(factors, g[j], shampoo_beta)
            if refresh and any(f is not None for f in factors):
                new, exp_avg_sq[j] = refresh_eigenbasis_qr(factors, basis, exp_avg_sq[j])
                for i, q in enumerate(new):
                    if q is not None:
                        st[f"Q{i}"][j] = q
        return out

    @staticmethod
    def _init_state(st: dict[str, Any], g: Tensor, lay: MatrixLayout, beta: float) -> None:
        st.update(new_matrix_state(g, lay, "Q"))
        for j in range(lay.count):
            factors = per_matrix(st, "GG", j, lay)
            accumulate_factors_(factors, g[j], beta)
            for i, q in enumerate(eigenbasis(factors)):
                if q is not None:
                    st[f"Q{i}"][j] = q

    @staticmethod
    def check_hparams(h: dict[str, Any], *, where: str) -> None:
        """The constructor's and every added group's checks."""
        check_non_negative(h, ("lr", "eps", "weight_decay"), where=where)
        check_betas(h["betas"], where=where, example="(0.95, 0.95)")
        sb = h["shampoo_beta"]
        if sb is not None and not 0.0 <= sb < 1.0:
            raise ValueError(f"{where}: shampoo_beta must be in [0, 1) or None (betas[1]), got "
                             f"shampoo_beta={sb!r}")
        check_positive_ints(h, {"precondition_frequency": "precondition_frequency=10",
                                "max_precond_dim": "max_precond_dim=10000"}, where=where)
        if h["merge_dims"]:
            raise ValueError(f"{where}: merge_dims=True is not supported: tensors of 3+ dims are "
                             "stacks of their trailing 2-D matrices, each preconditioned on its "
                             "own; reshape a convolution weight to 2-D yourself, or use "
                             "merge_dims=False.")
