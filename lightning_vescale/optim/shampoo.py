"""Layer 4: Shampoo with Adam grafting, on whole matrices of RaggedShard parameters.

Design note [distributed-shampoo]
---------------------------------
*Math.* The configuration of Distributed Shampoo (Shi et al., arXiv 2309.06497) that won the
AlgoPerf external tuning track: per matrix ``G`` (``m x n``), Kronecker factors ``L <- b2 L + (1 -
b2) G G^T`` and ``R <- b2 R + (1 - b2) G^T G`` (``b2 = betas[1]``); every
``precondition_frequency`` steps from ``start_preconditioning_step`` on, their inverse roots
``(L + eps I)^(-1/r)``, ``(R + eps I)^(-1/r)`` from one ``eigh`` each (eigenvalues clamped at 0,
then ``+ epsilon``; ``r = inverse_root_exponent``, default 4 = twice the order of a matrix). The
first moment ``M`` (``betas[0]``, bias-corrected) is preconditioned, ``D = L^(-1/r) M R^(-1/r)``,
and *grafted* onto Adam: ``A = M / (sqrt(V) + grafting_epsilon)`` with ``V`` Adam's second moment
(``grafting_beta2``, bias-corrected), and the step direction is ``D * ||A|| / ||D||`` (Adam before
the first roots exist). Then ``p <- p - lr * direction`` and decoupled weight decay
``p *= 1 - lr * wd``. Vectors and dimensions over ``max_preconditioner_dim`` are not
preconditioned (Adam along them); Distributed Shampoo's splitting of a large dimension into
blocks is not done. The factor functions are ``_kronecker.py``'s.

*Distribution and states* are SOAP's (design note [distributed-soap]): whole matrices local
under ``granularity="matrix"`` (no collective), owner ranks for split ones; ``GG{i}``
(factors) and ``R{i}`` (inverse roots) per preconditioned dimension, ``exp_avg``/``exp_avg_sq``
in the parameter's layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_vescale.optim._kronecker import accumulate_factors_, inverse_root, precondition
from lightning_vescale.optim._matrix_layout import MatrixLayout
from lightning_vescale.optim._whole_matrix import (
    WholeMatrixOptimizer,
    check_betas,
    check_non_negative,
    check_positive_ints,
    new_matrix_state,
    per_matrix,
)

__all__ = ["Shampoo"]


class Shampoo(WholeMatrixOptimizer):
    """Shampoo with Adam grafting; design note [distributed-shampoo] in this module.

    Args:
        params: parameters or groups (plain tensors or ``fully_shard`` parameters).
        lr: learning rate. betas: ``(momentum of the gradient, EMA rate of the factors)``.
        epsilon: added to the factors' eigenvalues before the inverse root.
        weight_decay: decoupled weight decay.
        max_preconditioner_dim: dimensions larger than this are not preconditioned.
        precondition_frequency: steps between inverse-root computations.
        start_preconditioning_step: first step that uses the preconditioner (Adam before);
            ``None``: ``precondition_frequency``.
        inverse_root_exponent: ``r`` in ``L^(-1/r)`` (4: the usual one for matrices).
        grafting_beta2, grafting_epsilon: Adam grafting's second moment and epsilon.
    """

    who = "Shampoo"

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), epsilon: float = 1e-12,
                 weight_decay: float = 1e-5, max_preconditioner_dim: int = 8192,
                 precondition_frequency: int = 100,
                 start_preconditioning_step: int | None = None,
                 inverse_root_exponent: float = 4.0, grafting_beta2: float = 0.999,
                 grafting_epsilon: float = 1e-8) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), epsilon=epsilon, weight_decay=weight_decay,
                        max_preconditioner_dim=max_preconditioner_dim,
                        precondition_frequency=precondition_frequency,
                        start_preconditioning_step=start_preconditioning_step,
                        inverse_root_exponent=inverse_root_exponent,
                        grafting_beta2=grafting_beta2, grafting_epsilon=grafting_epsilon)
        self.check_hparams(defaults, where="Shampoo")
        super().__init__(params, defaults)

    def _unit_args(self, group: dict[str, Any]) -> dict[str, Any]:
        return dict(max_precond_dim=int(group["max_preconditioner_dim"]),
                    precondition_1d=False)

    def _step_matrices(self, st: dict[str, Any], grad: Tensor, group: dict[str, Any],
                       lay: MatrixLayout) -> Tensor | None:
        b1, b2 = group["betas"]
        g = grad.reshape(lay.count, *lay.unit_shape)
        if not st:
            st.update(new_matrix_state(g, lay, "R"))
        st["step"] += 1
        t = float(st["step"])
        exp_avg = st["exp_avg"].view(g.shape).lerp_(g, 1.0 - b1)
        exp_avg_sq = st["exp_avg_sq"].view(g.shape).lerp_(g.square(),
                                                          1.0 - group["grafting_beta2"])
        m_hat = exp_avg / (1.0 - b1 ** t)
        graft = m_hat / ((exp_avg_sq / (1.0 - group["grafting_beta2"] ** t)).sqrt()
                         + group["grafting_epsilon"])
        start = group["start_preconditioning_step"] or group["precondition_frequency"]
        refresh = t >= start and (int(t) - start) % int(group["precondition_frequency"]) == 0
        out = torch.empty_like(g)
        for j in range(lay.count):
            factors = per_matrix(st, "GG", j, lay)
            accumulate_factors_(factors, g[j], b2)
            if refresh:
                for i, f in enumerate(factors):
                    if f is not None:
                        st[f"R{i}"][j] = inverse_root(f, group["inverse_root_exponent"],
                                                      group["epsilon"])
            if t < start or not any(f is not None for f in factors):
                out[j] = graft[j]
                continue
            direction = precondition(m_hat[j], per_matrix(st, "R", j, lay))
            scale = graft[j].norm() / direction.norm().clamp_min(1e-30)
            out[j] = direction * scale
        return out * group["lr"]

    @staticmethod
    def check_hparams(h: dict[str, Any], *, where: str) -> None:
        """The constructor's and every added group's checks."""
        check_non_negative(h, ("lr", "epsilon", "weight_decay", "grafting_epsilon"), where=where)
        check_betas(h["betas"], where=where, example="(0.9, 0.999)")
        if not 0.0 <= h["grafting_beta2"] < 1.0:
            raise ValueError(f"{where}: grafting_beta2 must be in [0, 1), got "
                             f"grafting_beta2={h['grafting_beta2']!r}")
        check_positive_ints(h, {"max_preconditioner_dim": None, "precondition_frequency": None},
                            where=where)
        s = h["start_preconditioning_step"]
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 1):
            raise ValueError(f"{where}: start_preconditioning_step must be an int >= 1 or None "
                             f"(= precondition_frequency), got {s!r}")
        r = h["inverse_root_exponent"]
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or \
                r <= 0:
            raise ValueError(f"{where}: inverse_root_exponent must be a number > 0, got {r!r}; "
                             "e.g. 4 (the inverse 4th root, usual for matrices)")
