"""Shampoo with Adam grafting on one process against a plain implementation of the paper's
configuration (arXiv 2309.06497; written here from the formulas, matrix powers through
``torch.linalg.matrix_power``-free eigendecompositions in float64), and its checks.

Tolerance ``1e-5``: the reference runs in float64, the optimizer in float32.
"""

from __future__ import annotations

import pytest
import torch

from lightning_vescale.optim import Shampoo

SHAPES = [(6, 5), (7,), (3, 4, 2)]
HP = dict(lr=1e-2, betas=(0.9, 0.99), epsilon=1e-6, weight_decay=1e-3, precondition_frequency=3,
          start_preconditioning_step=2, grafting_beta2=0.95, grafting_epsilon=1e-8)


def _grads(step, shapes=SHAPES):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in shapes]


def _root(F, r, eps):
    w, v = torch.linalg.eigh(F)
    return v @ torch.diag((w.clamp_min(0) + eps) ** (-1.0 / r)) @ v.T


def _reference_matrix(w, grads, lr, betas, epsilon, weight_decay, precondition_frequency,
                      start_preconditioning_step, grafting_beta2, grafting_epsilon, r=4.0,
                      sides=(True, True)):
    w = w.double().clone()
    b1, b2 = betas
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    L = torch.zeros(w.shape[0], w.shape[0], dtype=torch.float64)
    R = torch.zeros(w.shape[1], w.shape[1], dtype=torch.float64)
    RL = RR = None
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = grafting_beta2 * v + (1 - grafting_beta2) * g * g
        m_hat = m / (1 - b1 ** t)
        graft = m_hat / ((v / (1 - grafting_beta2 ** t)).sqrt() + grafting_epsilon)
        L = b2 * L + (1 - b2) * g @ g.T
        R = b2 * R + (1 - b2) * g.T @ g
        if t >= start_preconditioning_step and \
                (t - start_preconditioning_step) % precondition_frequency == 0:
            RL, RR = _root(L, r, epsilon), _root(R, r, epsilon)
        if RL is None:
            d = graft
        else:
            d = (RL if sides[0] else torch.eye(w.shape[0], dtype=w.dtype)) @ m_hat
            d = d @ (RR if sides[1] else torch.eye(w.shape[1], dtype=w.dtype))
            d = d * graft.norm() / d.norm()
        w = (w - lr * d) * (1 - lr * weight_decay)
    return w.float()


def _reference_adam(w, grads, lr, betas, weight_decay, grafting_beta2, grafting_epsilon, **_):
    m = torch.zeros_like(w)
    v = torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = betas[0] * m + (1 - betas[0]) * g
        v = grafting_beta2 * v + (1 - grafting_beta2) * g * g
        d = (m / (1 - betas[0] ** t)) / ((v / (1 - grafting_beta2 ** t)).sqrt() + grafting_epsilon)
        w = (w - lr * d) * (1 - lr * weight_decay)
    return w


def test_shampoo_equals_the_paper_configuration():
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    opt = Shampoo(params, **HP)
    for step in range(10):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        opt.step()
    grads = [_grads(s) for s in range(10)]
    want = _reference_matrix(init[0], [g[0] for g in grads], **HP)
    torch.testing.assert_close(params[0].detach(), want, atol=1e-5, rtol=1e-5)
    want = _reference_adam(init[1], [g[1] for g in grads], **HP)  # a vector: Adam
    torch.testing.assert_close(params[1].detach(), want, atol=1e-6, rtol=1e-6)
    for e in range(3):  # a stack: each (4, 2) matrix on its own
        want = _reference_matrix(init[2][e], [g[2][e] for g in grads], **HP)
        torch.testing.assert_close(params[2].detach()[e], want, atol=1e-5, rtol=1e-5)


def _run_one(shape, steps=10, **kwargs):
    torch.manual_seed(0)
    init = torch.randn(shape)
    p = torch.nn.Parameter(init.clone())
    opt = Shampoo([p], **{**HP, **kwargs})
    for step in range(steps):
        p.grad = _grads(step, [shape])[0]
        opt.step()
    return init, p, opt.state[p]


def test_dims_over_max_preconditioner_dim_are_adam_along_them():
    grads = [_grads(s, [(6, 5)])[0] for s in range(10)]
    # every dim over the limit: no factor at all, Adam (not a silent no-op)
    init, p, st = _run_one((6, 5), max_preconditioner_dim=4)
    assert not any(k.startswith(("GG", "R")) for k in st)
    torch.testing.assert_close(p.detach(), _reference_adam(init, grads, **HP), atol=1e-6,
                               rtol=1e-6)
    # the 6-row dim over the limit, the 5-column dim preconditioned: one-sided Shampoo
    init, p, st = _run_one((6, 5), max_preconditioner_dim=5)
    assert "GG0" not in st and "GG1" in st
    want = _reference_matrix(init, grads, **HP, sides=(False, True))
    torch.testing.assert_close(p.detach(), want, atol=1e-5, rtol=1e-5)


def test_shampoo_state_dict_round_trip():
    a = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(a.detach().clone())
    oa = Shampoo([a], **HP)
    for step in range(4):
        a.grad = _grads(step, [(6, 5)])[0]
        oa.step()
    with torch.no_grad():
        b.copy_(a)
    ob = Shampoo([b], **HP)
    ob.load_state_dict(oa.state_dict())
    for step in range(4, 9):
        a.grad = _grads(step, [(6, 5)])[0]
        b.grad = a.grad.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs, words", [
    (dict(precondition_frequency=0), "precondition_frequency must be an int >= 1"),
    (dict(max_preconditioner_dim=0), "max_preconditioner_dim must be an int >= 1"),
    (dict(start_preconditioning_step=0), "start_preconditioning_step must be an int >= 1"),
    (dict(inverse_root_exponent=0), "inverse_root_exponent must be a number > 0"),
    (dict(betas=(0.9, 1.0)), "betas must be a pair in [0, 1)"),
    (dict(epsilon=-1.0), "epsilon must be a number >= 0"),
])
def test_bad_hyper_parameters(kwargs, words):
    with pytest.raises(ValueError) as info:
        Shampoo([torch.nn.Parameter(torch.randn(3, 3))], **kwargs)
    assert words in str(info.value)


def test_complex_and_sparse_are_refused():
    with pytest.raises(TypeError, match="complex"):
        Shampoo([torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = Shampoo([p])
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
