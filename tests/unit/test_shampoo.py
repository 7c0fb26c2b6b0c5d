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


def _reference_blocked(w, grads, block, **hp):
    """Blocked Shampoo written independently of the optimizer: cut the matrix into tiles of at
    most ``block`` rows and columns (Distributed Shampoo's ``multi_dim_split``: runs of
    ``block`` along each dimension, the last one shorter) and run a separate small Shampoo
    (its own factors, roots and grafting norm) on each tile."""
    out = torch.empty_like(w)
    for r in range(0, w.shape[0], block):
        for c in range(0, w.shape[1], block):
            tile = (slice(r, r + block), slice(c, c + block))
            out[tile] = _reference_matrix(w[tile], [g[tile] for g in grads], **hp)
    return out


@pytest.mark.parametrize("shape, block", [((11, 7), 4), ((6, 5), 4), ((6, 5), 5), ((3, 9), 2),
                                          ((2, 6, 5), 4)])
def test_large_dims_are_blocked_like_distributed_shampoo(shape, block):
    """10 steps, roots refreshed at steps 2, 5, 8; each trailing matrix of a stack on its own.

    ``epsilon=1e-4``: thin tiles (one row) have rank-deficient factors, whose zero eigenvalues
    come out of float32's ``eigh`` as ~1e-7 rounding; against ``epsilon=1e-6`` that rounding
    moves the float32 result 2.6e-5 from the float64 reference (5e-7 at ``1e-4``)."""
    hp = {**HP, "epsilon": 1e-4}
    grads = [_grads(s, [shape])[0] for s in range(10)]
    init, p, st = _run_one(shape, max_preconditioner_dim=block, epsilon=1e-4)
    count = init.reshape(-1, *shape[-2:]).shape[0]
    rows = [min(block, shape[-2] - a) for a in range(0, shape[-2], block)]
    cols = [min(block, shape[-1] - a) for a in range(0, shape[-1], block)]
    assert st["GG0"].shape == st["R0"].shape == (count, len(cols) * sum(d * d for d in rows))
    assert st["GG1"].shape == st["R1"].shape == (count, len(rows) * sum(d * d for d in cols))
    got, init = p.detach().reshape(-1, *shape[-2:]), init.reshape(-1, *shape[-2:])
    for e in range(count):
        want = _reference_blocked(init[e], [g.reshape(-1, *shape[-2:])[e] for g in grads],
                                  block, **hp)
        torch.testing.assert_close(got[e], want, atol=1e-5, rtol=1e-5)


def test_tiles_follow_torch_split_row_major():
    from lightning_vescale.optim._kronecker import matrix_blocks, split_sizes

    assert split_sizes(11, 4) == (4, 4, 3) and split_sizes(8, 4) == (4, 4)
    assert split_sizes(3, 8) == (3,) and split_sizes(0, 4) == ()
    x = torch.arange(11 * 7).reshape(11, 7)
    want = [s for t in torch.split(x, 4, dim=0) for s in torch.split(t, 4, dim=1)]
    got = [x[rows, cols] for rows, cols in matrix_blocks((11, 7), 4)]
    assert len(got) == len(want) == 6 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_small_matrices_are_one_tile_and_vectors_adam():
    """A matrix within max_preconditioner_dim keeps its whole factors (as before blocking)."""
    init, p, st = _run_one((6, 5), max_preconditioner_dim=6)
    assert st["GG0"].shape == (1, 36) and st["GG1"].shape == (1, 25)
    grads = [_grads(s, [(6, 5)])[0] for s in range(10)]
    torch.testing.assert_close(p.detach(), _reference_matrix(init, grads, **HP), atol=1e-5,
                               rtol=1e-5)
    _, _, st = _run_one((7,), max_preconditioner_dim=2)
    assert not any(k.startswith(("GG", "R")) for k in st)


def test_state_saved_with_another_block_is_refused():
    p = torch.nn.Parameter(torch.randn(6, 5))
    opt = Shampoo([p], **HP, max_preconditioner_dim=4)
    p.grad = torch.randn(6, 5)
    opt.step()
    # the state dict's groups carry max_preconditioner_dim, so loading restores it ...
    other = Shampoo([torch.nn.Parameter(p.detach().clone())], **HP, max_preconditioner_dim=3)
    other.load_state_dict(opt.state_dict())
    assert other.param_groups[0]["max_preconditioner_dim"] == 4
    # ... factors that do not fit the tiles (edited groups; a state of the version that left
    # long dimensions unblocked: no GG0 for the 6 rows) are refused, not silently misread
    sd = opt.state_dict()
    sd["param_groups"][0]["max_preconditioner_dim"] = 3
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        other.load_state_dict(sd)
    sd = opt.state_dict()
    sd["param_groups"][0]["max_preconditioner_dim"] = 5
    sd["state"][0] = {k: v for k, v in sd["state"][0].items() if k not in ("GG0", "R0")}
    sd["state"][0]["GG1"] = sd["state"][0]["R1"] = torch.zeros(1, 25)
    with pytest.raises(ValueError, match="'GG0' of parameter #0 of group 0 has none"):
        other.load_state_dict(sd)
    # the same block size loads, in either the flat or a (count, d, d) shape
    whole = Shampoo([torch.nn.Parameter(torch.randn(4, 3))], **HP, max_preconditioner_dim=4)
    sd = whole.state_dict()
    sd["state"] = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(12),
                       "exp_avg_sq": torch.zeros(12), "GG0": torch.eye(4)[None],
                       "R0": torch.eye(4)[None], "GG1": torch.eye(3)[None],
                       "R1": torch.eye(3)[None]}}
    whole.load_state_dict(sd)
    assert whole.state[whole.param_groups[0]["params"][0]]["GG0"].shape == (1, 16)


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
    (dict(max_preconditioner_dim=0), "max_preconditioner_dim must be an int >= 1, got "
                                     "max_preconditioner_dim=0; e.g. 1024"),
    (dict(max_preconditioner_dim=2.5), "max_preconditioner_dim must be an int >= 1"),
    (dict(start_preconditioning_step=0), "start_preconditioning_step must be an int >= 1"),
    (dict(inverse_root_exponent=0), "inverse_root_exponent must be a number > 0"),
    (dict(betas=(0.9, 1.0)), "betas must be a pair in [0, 1)"),
    (dict(epsilon=-1.0), "epsilon must be a number >= 0"),
])
def test_bad_hyper_parameters(kwargs, words):
    with pytest.raises(ValueError) as info:
        Shampoo([torch.nn.Parameter(torch.randn(3, 3))], **kwargs)
    assert words in str(info.value)
