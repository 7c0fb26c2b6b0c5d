"""SOAP on one process against two independent implementations, stacks, and bad input.

References: ``pytorch_optimizer.SOAP`` (a port of the authors' ``soap.py``; not in CI, skipped
without it) and ``_paper_soap`` below, written from the paper's Algorithm 3 in the authors'
original form (the first moment kept in the *projected* space and re-projected when the basis
changes; the optimizer keeps it in the original space and projects on use: equal in exact
arithmetic). Tolerance ``1e-5``: float32 rounding of the two forms over 12 steps with 3 basis
refreshes (measured ~3e-8 against pytorch_optimizer).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_vescale.optim import SOAP, Shampoo

SHAPES = [(6, 5), (7,), (4, 3)]
HP = dict(lr=3e-3, betas=(0.95, 0.95), eps=1e-8, weight_decay=0.01, precondition_frequency=3)


def _grads(step, shapes=SHAPES):
    g = torch.Generator().manual_seed(step)
    return [torch.randn(s, generator=g) for s in shapes]


def _run(make, shapes=SHAPES, steps=12):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = make(params)
    for step in range(steps):
        for p, g in zip(params, _grads(step, shapes)):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def _paper_soap(params, grads_per_step, lr, betas, eps, weight_decay, precondition_frequency):
    """Algorithm 3 of arXiv 2409.11321 for matrices (and Adam for vectors), plainly."""
    b1, b2 = betas
    out = []
    for k, p0 in enumerate(params):
        w = p0.clone()
        if w.dim() == 1:  # no 1-D preconditioning: Adam, first step only initialises
            m = torch.zeros_like(w)
            v = torch.zeros_like(w)
            for t, grads in enumerate(grads_per_step[1:], start=1):
                g = grads[k]
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                w = (w - size * m / (v.sqrt() + eps)) * (1 - lr * weight_decay)
            out.append(w)
            continue
        g0 = grads_per_step[0][k]
        L = (1 - b2) * g0 @ g0.T
        R = (1 - b2) * g0.T @ g0
        QL = torch.flip(torch.linalg.eigh(L)[1], [1])
        QR = torch.flip(torch.linalg.eigh(R)[1], [1])
        M = torch.zeros_like(w)  # projected first moment (the original form)
        V = torch.zeros_like(w)
        for t, grads in enumerate(grads_per_step[1:], start=1):
            g = grads[k]
            gp = QL.T @ g @ QR
            M = b1 * M + (1 - b1) * gp
            V = b2 * V + (1 - b2) * gp * gp
            size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
            w = (w - size * (QL @ (M / (V.sqrt() + eps)) @ QR.T)) * (1 - lr * weight_decay)
            L = b2 * L + (1 - b2) * g @ g.T
            R = b2 * R + (1 - b2) * g.T @ g
            if t % precondition_frequency == 0:  # power iteration + QR, moments follow
                M = QL @ M @ QR.T
                new = []
                for i, (F, Q) in enumerate(((L, QL), (R, QR))):
                    order = torch.argsort(torch.diag(Q.T @ F @ Q), descending=True)
                    V = V.index_select(i, order)
                    new.append(torch.linalg.qr((F @ Q)[:, order])[0])
                QL, QR = new
                M = QL.T @ M @ QR
        out.append(w)
    return out


def test_soap_equals_the_paper_algorithm():
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    got = _run(lambda ps: SOAP(ps, **HP))
    want = _paper_soap(init, [_grads(s) for s in range(12)], **HP)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_soap_equals_pytorch_optimizer():
    po = pytest.importorskip("pytorch_optimizer")
    # (precondition_1d is not compared: a vector's factor has rank <= steps, and the QR refresh
    # of a rank-deficient factor picks its null-space basis from rounding noise: 1e-4 apart)
    got = _run(lambda ps: SOAP(ps, **HP))
    want = _run(lambda ps: po.SOAP(ps, **HP))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_a_stack_is_its_matrices_each_on_its_own():
    stack = _run(lambda ps: SOAP(ps, **HP), shapes=[(3, 6, 5)])[0]
    torch.manual_seed(0)
    full = torch.randn(3, 6, 5)
    params = [torch.nn.Parameter(full[e].clone()) for e in range(3)]
    opt = SOAP(params, **HP)
    for step in range(12):
        g = _grads(step, [(3, 6, 5)])[0]
        for e, p in enumerate(params):
            p.grad = g[e].clone()
        opt.step()
    # 1-ulp differences: the stack's element-wise ops vectorise over other alignments
    torch.testing.assert_close(stack, torch.stack([p.detach() for p in params]), atol=1e-6,
                               rtol=1e-6)


def test_dims_over_max_precond_dim_fall_back_to_adam():
    # every dim > max_precond_dim: no factor at all, Adam (not a silent no-op)
    got = _run(lambda ps: SOAP(ps, **HP, max_precond_dim=2), shapes=[(6, 5)])[0]
    torch.manual_seed(0)
    init = torch.randn(6, 5).reshape(-1)
    want = _paper_soap([init], [[g.reshape(-1) for g in _grads(s, [(6, 5)])] for s in range(12)],
                       **HP)[0]
    torch.testing.assert_close(got.reshape(-1), want, atol=1e-6, rtol=1e-6)
    opt = SOAP([torch.nn.Parameter(torch.randn(6, 5))], max_precond_dim=2)
    opt.param_groups[0]["params"][0].grad = torch.randn(6, 5)
    opt.step()
    assert not any(k.startswith("GG") for k in opt.state[opt.param_groups[0]["params"][0]])


@pytest.mark.parametrize("kwargs, words", [
    (dict(precondition_frequency=0), "precondition_frequency must be an int >= 1"),
    (dict(max_precond_dim=0), "max_precond_dim must be an int >= 1"),
    (dict(betas=(0.9, 1.0)), "betas must be a pair in [0, 1)"),
    (dict(shampoo_beta=1.5), "shampoo_beta must be in [0, 1)"),
    (dict(lr=-1.0), "lr must be a number >= 0"),
    (dict(merge_dims=True), "merge_dims=True is not supported"),
])
def test_bad_hyper_parameters(kwargs, words):
    with pytest.raises(ValueError) as info:
        SOAP([torch.nn.Parameter(torch.randn(3, 3))], **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("optimizer", [SOAP, Shampoo])
def test_complex_and_sparse_are_refused(optimizer):
    """Both checks live in their shared base (``optim/_whole_matrix.py``)."""
    with pytest.raises(TypeError, match="complex"):
        optimizer([torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = optimizer([p])
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_state_dict_round_trip_continues_identically():
    a = [torch.nn.Parameter(torch.randn(6, 5)), torch.nn.Parameter(torch.randn(7))]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    oa, ob = SOAP(a, **HP), SOAP(b, **HP)
    for step in range(4):
        for p, q, g in zip(a, b, _grads(step, [(6, 5), (7,)])):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    oc = SOAP(b, **HP)
    oc.load_state_dict(oa.state_dict())
    for step in range(4, 8):
        for p, q, g in zip(a, b, _grads(step, [(6, 5), (7,)])):
            p.grad, q.grad = g.clone(), g.clone()
        oa.step()
        oc.step()
    for p, q in zip(a, b):
        assert torch.equal(p, q)
