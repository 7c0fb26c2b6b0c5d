"""Layer 4: AdamW8bit's step on flat memory: the element-wise kernel and the span fast path.

Design note [adamw8bit-fast-path]
---------------------------------
:func:`step_flat` is the whole AdamW update of one flat range (see design note [adamw8bit] for
the maths): plain IEEE element-wise operations and per-block maxima only, in chunks of whole
blocks, so the result of an element depends on its own values and its block's maximum alone.

*Fast path.* Quantized parameters whose local tensors are views into one storage (a ``DBuffer``
shard: ordered, possibly with padding gaps in between) and whose offsets in it are congruent
modulo ``B`` (the block size) form a cluster. A cluster of >= 2 members is stepped as one span, in
one vectorised pass (in chunks of ``chunk_size`` elements, a multiple of ``B``, which bounds the
fp32 temporaries), when: their gradients lie in one storage with the same relative layout, the
members fill >= 90% of the span, every quantized parameter in the span has a gradient and all
have taken the same number of steps (a parameter that once skipped a step keeps its cluster on
the per-parameter path). Relative offsets on multiples of ``B`` make span block ``rel/B + k``
the same elements as the parameter's own block ``k``. Everything else inside the span (padding,
fp32-state parameters, other clusters' or groups' parameters) is a gap: its moments are forced
to 0 before the block maxima (so it never changes a real block's scale, even if the padding
holds NaN) and its parameter values are written back as they are. The members' states are views
into one span-sized buffer per moment (:func:`find_spans` re-packs them when they are not). The
result is bitwise the same as the per-parameter path (tested); parameters outside any qualifying
span take that path. A planner that places every quantized tensor at a buffer offset that is a
multiple of ``B`` puts a whole shard in one span.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_vescale.optim._base import local_view
from lightning_vescale.optim._quant import (
    codebook,
    dequantize_blockwise_,
    num_blocks,
    quantize_blockwise_,
    zero_code,
)

__all__ = ["QUANT_KEYS", "FP32_KEYS", "StepEntry", "Span", "new_state", "find_spans",
           "step_span", "step_flat"]

#: State keys of a quantized parameter, in the order of :func:`step_flat`'s ``moments``.
QUANT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
#: State keys of a parameter with fp32 moments.
FP32_KEYS = ("exp_avg", "exp_avg_sq")
# The fast path allocates span-sized moment buffers (gaps included): use it only when the
# members fill at least this share of their span.
_MIN_SPAN_FILL = 0.9


@dataclass(frozen=True, kw_only=True, eq=False)
class StepEntry:
    """One parameter that takes this step: its local tensor, its gradient's, its state."""

    param: Tensor
    local: Tensor  # the parameter's local tensor (detached view)
    grad: Tensor  # the gradient's local tensor (detached view), same numel
    state: dict[str, Any]


@dataclass(frozen=True, kw_only=True, eq=False)
class Span:
    """Members stepped as one flat range of their shared storage (see the design note)."""

    members: list[StepEntry]  # sorted by storage offset
    params: Tensor  # flat view of the parameters' storage over the span
    grads: Tensor  # flat view of the gradients' storage, same relative layout
    moments: tuple[Tensor, ...]  # span-sized buffers, in QUANT_KEYS order
    gaps: list[tuple[int, int]]  # [a, b) ranges of the span that belong to no member


def _fresh_quantized(n: int, block_size: int, device: torch.device) -> tuple[Tensor, ...]:
    # Zero moments of n elements, in QUANT_KEYS order: codes of 0.0, scales 0.
    nb = num_blocks(n, block_size)
    return (
        torch.full((n,), zero_code(True), dtype=torch.uint8, device=device),
        torch.zeros(nb, dtype=torch.float32, device=device),
        torch.full((n,), zero_code(False), dtype=torch.uint8, device=device),
        torch.zeros(nb, dtype=torch.float32, device=device),
    )


def new_state(local: Tensor, quantized: bool, block_size: int) -> dict[str, Tensor]:
    """A fresh state (``step`` 0, zero moments) for a parameter whose local tensor is ``local``:
    flat quantized moments (:data:`QUANT_KEYS`) or flat fp32 ones (:data:`FP32_KEYS`)."""
    st: dict[str, Tensor] = {"step": torch.tensor(0.0, dtype=torch.float32)}
    n, dev = local.numel(), local.device
    if quantized:
        st.update(zip(QUANT_KEYS, _fresh_quantized(n, block_size, dev)))
    else:
        st["exp_avg"] = torch.zeros(n, dtype=torch.float32, device=dev)
        st["exp_avg_sq"] = torch.zeros(n, dtype=torch.float32, device=dev)
    return st


# -------------------------------------------------------------------------------------------------
# The fast path: which parameters step together
# -------------------------------------------------------------------------------------------------
def find_spans(entries: Sequence[StepEntry], group_params: Sequence[Tensor],
               state: Mapping[Tensor, dict[str, Any]], block_size: int) -> list[Span]:
    """Spans of >= 2 quantized entries that satisfy the fast-path rules (see the design note).

    Candidates are clustered by (storage, storage offset mod ``block_size``): members of a
    cluster start on multiples of the block size relative to each other. ``group_params`` and
    ``state`` (the optimizer's) find quantized parameters without a gradient, whose clusters
    must not take the fast path. May re-pack members' states into span buffers.
    """

    def key(t: Tensor) -> tuple[int, int]:
        return t.untyped_storage().data_ptr(), t.storage_offset() % block_size

    clusters: dict[tuple[int, int], list[StepEntry]] = {}
    for e in entries:
        if "exp_avg_codes" in e.state and e.local.numel() > 0:
            clusters.setdefault(key(e.local), []).append(e)
    # Every quantized state inside a span must be a member: a non-member's slice of the
    # span's moment buffers would be overwritten (a parameter without a gradient).
    with_grad = {id(e.param) for e in entries}
    for q in group_params:
        st = state.get(q)
        if id(q) not in with_grad and st and "exp_avg_codes" in st and \
                st["exp_avg_codes"].numel():
            clusters.pop(key(local_view(q.detach())), None)
    spans = []
    for members in clusters.values():
        span = _span(members, block_size) if len(members) >= 2 else None
        if span is not None:
            spans.append(span)
    return spans


def _span(members: list[StepEntry], bs: int) -> Span | None:
    """The span when ``members`` (same storage) tile it block-aligned; else None."""
    p0, g0 = members[0].local, members[0].grad
    pst, gst = p0.untyped_storage().data_ptr(), g0.untyped_storage().data_ptr()
    step0 = float(members[0].state["step"])
    for e in members:
        loc, gl = e.local, e.grad
        if not (loc.is_contiguous() and gl.is_contiguous() and loc.dtype == p0.dtype
                and gl.dtype == g0.dtype and loc.device == p0.device
                and loc.untyped_storage().data_ptr() == pst
                and gl.untyped_storage().data_ptr() == gst
                and float(e.state["step"]) == step0):
            return None
    members.sort(key=lambda e: e.local.storage_offset())
    base, gbase = members[0].local.storage_offset(), members[0].grad.storage_offset()
    rels, prev_end = [], 0
    for e in members:
        rel = e.local.storage_offset() - base
        if rel % bs or rel < prev_end or e.grad.storage_offset() - gbase != rel:
            return None
        rels.append(rel)
        prev_end = rel + e.local.numel()
    span_len = prev_end
    if sum(e.local.numel() for e in members) < _MIN_SPAN_FILL * span_len:
        return None  # mostly gaps: span-sized moment buffers would waste memory
    if (base + span_len) * p0.element_size() > p0.untyped_storage().nbytes() or \
            (gbase + span_len) * g0.element_size() > g0.untyped_storage().nbytes():
        return None
    gaps = [(r + e.local.numel(), nxt)
            for r, e, nxt in zip(rels, members, rels[1:] + [span_len])
            if r + e.local.numel() < nxt]
    return Span(members=members,
                params=torch.as_strided(p0, (span_len,), (1,), base),
                grads=torch.as_strided(g0, (span_len,), (1,), gbase),
                moments=_span_states(members, rels, span_len, bs, p0.device), gaps=gaps)


def _span_states(members: list[StepEntry], rels: list[int], span_len: int, bs: int,
                 device: torch.device) -> tuple[Tensor, ...]:
    """Span-sized moment buffers whose slices are the members' states (re-packed if needed)."""
    nb_span = num_blocks(span_len, bs)
    sizes = (span_len, nb_span, span_len, nb_span)
    out = []
    packed = True
    for k, size in zip(QUANT_KEYS, sizes):
        t0 = members[0].state[k]
        per = 1 if size == span_len else bs
        tbase = t0.storage_offset()
        ok = (tbase + size) * t0.element_size() <= t0.untyped_storage().nbytes()
        ptr = t0.untyped_storage().data_ptr()
        for r, e in zip(rels, members):
            t = e.state[k]
            ok = ok and t.untyped_storage().data_ptr() == ptr and \
                t.storage_offset() - tbase == r // per and t.is_contiguous()
        if not ok:
            packed = False
            break
        out.append(torch.as_strided(t0, (size,), (1,), tbase))
    if packed:
        return tuple(out)
    # (Re)pack: one buffer per moment, members' states become views into it.
    bufs = _fresh_quantized(span_len, bs, device)
    for r, e in zip(rels, members):
        n = e.local.numel()
        for k, buf in zip(QUANT_KEYS, bufs):  # codes per element, scales per block
            lo, hi = (r, r + n) if k.endswith("_codes") else (r // bs, r // bs + num_blocks(n, bs))
            view = buf[lo:hi]
            view.copy_(e.state[k].reshape(-1))
            e.state[k] = view
    return bufs


def step_span(span: Span, group: Mapping[str, Any]) -> None:
    """One step of every member of ``span`` (their step counts are equal)."""
    for e in span.members:
        e.state["step"] += 1
    step_flat(span.params, span.grads, span.moments, span.gaps, group,
              float(span.members[0].state["step"]), int(group["block_size"]))


# -------------------------------------------------------------------------------------------------
# The kernel
# -------------------------------------------------------------------------------------------------
def step_flat(p: Tensor, g: Tensor, moments: Sequence[Tensor],
              gaps: Sequence[tuple[int, int]] | None, group: Mapping[str, Any], step: float,
              block_size: int) -> None:
    """One AdamW step on the flat ``p`` (in place) from the flat gradient ``g``.

    ``moments`` is ``(m_codes, m_absmax, v_codes, v_absmax)`` (quantized, ``p[0]`` starts a
    block) or ``(m, v)`` fp32. ``gaps`` (``[a, b)`` ranges of ``p``) are not updated: they keep
    their parameter values and get zero moments. Work is done in chunks of
    ``group["chunk_size"]`` elements rounded down to whole blocks, so results do not depend on it.
    """
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    maximize = bool(group["maximize"])
    bc1 = 1 - beta1 ** step
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    step_size = lr / bc1
    decay = 1 - lr * wd
    quantized = len(moments) == 4
    chunk = max(block_size, int(group["chunk_size"]) // block_size * block_size)
    n = p.numel()
    dev = p.device
    if quantized:
        m_book, v_book = codebook(True, dev), codebook(False, dev)
        m_codes, m_absmax, v_codes, v_absmax = moments
    else:
        m_all, v_all = moments
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        b0, b1 = s // block_size, num_blocks(e, block_size)
        pc = p[s:e]
        p32 = pc.float()
        g32 = g[s:e].float()
        if maximize:
            g32 = -g32
        if quantized:
            m = torch.empty(e - s, dtype=torch.float32, device=dev)
            v = torch.empty_like(m)
            dequantize_blockwise_(m, m_codes[s:e], m_absmax[b0:b1], m_book.code, block_size)
            dequantize_blockwise_(v, v_codes[s:e], v_absmax[b0:b1], v_book.code, block_size)
        else:
            m, v = m_all[s:e], v_all[s:e]
        # m = beta1*m + (1-beta1)*g ; v = beta2*v + (1-beta2)*g*g  (plain IEEE ops, see note)
        m.mul_(beta1).add_(g32 * (1 - beta1))
        v.mul_(beta2).add_((g32 * g32).mul_(1 - beta2))
        cut = [(max(a, s) - s, min(b, e) - s) for a, b in gaps or () if a < e and b > s]
        for a, b in cut:  # gaps: zero moments (never raise a block's absmax, even from NaN)
            m[a:b] = 0.0
            v[a:b] = 0.0
        denom = v.sqrt().div_(bc2_sqrt).add_(eps)
        new_p = (p32 * decay).add_(torch.div(m, denom).mul_(-step_size))
        for a, b in cut:  # gaps: parameter values written back as they were
            new_p[a:b] = p32[a:b]
        pc.copy_(new_p)
        if quantized:
            quantize_blockwise_(m, m_codes[s:e], m_absmax[b0:b1], m_book, block_size)
            quantize_blockwise_(v, v_codes[s:e], v_absmax[b0:b1], v_book, block_size)
