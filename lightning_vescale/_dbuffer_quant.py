"""Layer 2: the block-quantized all-gather of a :class:`~lightning_vescale.dbuffer.DBuffer`.

Design note [quantized-all-gather]
----------------------------------
With ``CommPolicy(all_gather="int8"|"fp8")`` (``fully_shard(comm_policy=...)``) a DBuffer that
holds only quantized tensors all-gathers 1-byte *codes* plus one fp32 *scale* per block instead
of its ``param_dtype`` values; the master shard is never changed.

*Blocks.* A block is ``B`` (``block_size``) consecutive elements of one tensor, counted from the
tensor's first element (the blocks of ``AdamW8bit``, design note [blockwise-quant]; a tensor's
last block may be shorter). The group plans quantized tensors with a granularity that is a
multiple of ``B``, so every rank's local range of a tensor is whole blocks and no block
straddles two ranks: each rank quantizes its own shard without communication. The rank's shard
is cut into *pieces* (a tensor's local range, or padding between them), each piece into blocks;
padding blocks are zeros (scale 0, dequantized to exactly 0). Every rank derives every rank's
blocks from the plan, so nothing about the layout travels.

*Codes.* ``int8``: symmetric linear, ``scale = absmax / 127``, ``code = round(x / scale)``, so
a dequantized value is within ``scale / 2`` (half a step) of the true one. ``fp8``:
``float8_e4m3fn`` codes of ``x / scale`` with ``scale = absmax / 448`` (relative error
``<= 2**-4``, absolute ``<= 2**-10 * scale`` near zero). The absmax is a plain ``amax``: a
non-finite value makes its whole block non-finite (forward then sees NaN, as it would without
quantization; nothing is hidden). (``optim/_quant.py``'s dynamic map is a layer above and is
made for optimizer moments: weights want the uniform grid and its half-step bound.)

*Message.* One contiguous ``uint8`` buffer per rank of ``P = S' + 4 K`` bytes: ``S`` codes
(padded to ``S'``, a multiple of 4) then ``K`` fp32 scales, ``K`` the largest number of blocks
any rank has. One ``all_gather`` moves ``W * P`` bytes (int8: ``~S * (1 + 4/B)`` per rank,
0.254x fp32 at ``B = 256``); the send buffer is persistent (sharded), the receive buffer is
allocated for the all-gather and freed after dequantization, as ``full`` is (it would otherwise
hold a byte per parameter of the whole group). Dequantization writes ``code * scale`` straight
into ``full`` in ``param_dtype`` (the codes widened in place, then scaled: exact codes, one
rounding): two kernels per run of equal-length blocks, two for the whole buffer when every
rank's shard is whole blocks of ``B`` (the common case: tensor sizes and ``S`` multiples of
``B``). A world of one moves nothing but still quantizes and dequantizes, so results do not
depend on the world size.

*Degenerate blocks* (one outlier sets the step of its neighbours) are refused: design note
[quantized-degenerate-blocks].

*Not quantized:* the re-gather of ``reshard_after_forward=<int>`` (it moves the kept chunk of
already dequantized values among the smaller group, in ``param_dtype``).

Design note [quantized-degenerate-blocks]
-----------------------------------------
One absmax per block means a single outlier sets the step for its 255 neighbours; a block whose
codes no longer say anything is refused, never all-gathered silently. Criterion, per block of
the rank's shard, evaluated while quantizing: the block is *degenerate* when its scale is finite
and more than half of its nonzero elements get code 0 (int8: ``|x| <= scale / 2``, i.e. they
round to 0; fp8: ``|x| / scale <= 2**-10``, below half of e4m3's smallest subnormal), i.e. most
of what the block holds decodes to exactly 0. A gaussian block has ~1% such elements in int8
(absmax ~3 sigma); it takes an outlier ~170 sigma (int8) or ~3 * 10**5 sigma (fp8) above its
neighbours to reach half; ``1e30`` or ``3e38`` beside weights of ~0.1 zero every neighbour.
Blocks of exact zeros and non-finite blocks (already NaN, see *Codes*) are not degenerate. The
sender marks such a block by a negative scale (scales are otherwise >= 0) in its message, so
every rank sees every mark after the all-gather and raises the same ``RuntimeError``, naming the
group, the parameter, the block's elements and its absmax, and the ways out (``"fp8"``'s wider
range, or ``CommPolicy(quantize={name: False})``): no rank is left waiting in a collective. We
raise rather than send such blocks unquantized because a message of fixed size is what keeps the
all-gather one collective without a size exchange. Costs: two comparisons and two row sums per
block when quantizing; after each all-gather a few kernels that keep, on the device, the first
marked block's ``(count, index, scale)`` (``QuantizedGather.record_marks``: no host read);
under ``fully_shard`` the root reads every buffer's record at once after its forward
(``check_gathers``: one host read per forward, on an accelerator one sync, instead of one per
quantized all-gather, forward and backward, which kept the CPU from running ahead more than one
group). So the error comes at the end of the forward in which the block was gathered, on every
rank at the same point (the records are the same everywhere); backward's re-gathers of the same
shards carry the same marks and are read with the next forward's. A bare ``DBuffer`` (no
``defer_check``) reads at the all-gather's ``wait``, as before.
"""

from __future__ import annotations

import struct
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

from lightning_vescale._dbuffer_comm import _all_gather_flat
from lightning_vescale.planner import LayoutPlan

__all__ = ["QUANT_FORMATS", "QuantizedGather", "Run", "all_rank_runs", "any_unread",
           "check_gathers", "fp8_dtype", "message_bytes", "rank_runs"]

#: ``all_gather`` format -> largest code magnitude (the scale is ``absmax / qmax``)
QUANT_FORMATS = {"int8": 127.0, "fp8": 448.0}


def fp8_dtype() -> torch.dtype | None:
    """``torch.float8_e4m3fn`` if this torch build has it, else ``None``."""
    return getattr(torch, "float8_e4m3fn", None)


class Run(NamedTuple):
    """``count`` blocks of ``length`` elements from shard element ``start``; their scales are
    slots ``scale`` .. ``scale + count`` of the rank's ``K``."""

    start: int
    count: int
    length: int
    scale: int


def _cuts(plan: LayoutPlan) -> list[list[tuple[int, int]]]:
    """Per rank, the ``(start, end)`` shard ranges of the tensors it holds, in order; each
    tensor visits only the ranks it spans (``O(tensors + pieces)``, not ``ranks * tensors``)."""
    S = plan.shard_size
    out: list[list[tuple[int, int]]] = [[] for _ in range(plan.world_size)]
    for spec in plan.entries:
        off = plan.offsets[spec.name]
        for rank in plan.ranks_spanned(spec.name):
            a, b = plan.local_range(spec.name, rank)
            if b > a:
                out[rank].append((off + a - rank * S, off + b - rank * S))
    return [sorted(c) for c in out]


def _pieces(S: int, cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(start, length)`` pieces covering a shard ``[0, S)``: each tensor's local range
    (``cuts``), and the padding between them, in order."""
    out, pos = [], 0
    for a, b in cuts:
        if a > pos:
            out.append((pos, a - pos))
        out.append((a, b - a))
        pos = b
    if pos < S:
        out.append((pos, S - pos))
    return out


def all_rank_runs(plan: LayoutPlan, block_size: int) -> list[list[Run]]:
    """:func:`rank_runs` of every rank of ``plan``."""
    return [_runs(plan.shard_size, c, block_size) for c in _cuts(plan)]


def rank_runs(plan: LayoutPlan, rank: int, block_size: int) -> list[Run]:
    """The rank's blocks as runs of equal-length blocks (see [quantized-all-gather]);
    neighbouring runs of the same length merge, so a shard of whole ``block_size`` blocks is
    one run."""
    return all_rank_runs(plan, block_size)[rank]


def _runs(S: int, cuts: list[tuple[int, int]], block_size: int) -> list[Run]:
    runs: list[Run] = []
    slot = 0
    for start, length in _pieces(S, cuts):
        full, tail = divmod(length, block_size)
        for s, n, ln in ((start, full, block_size), (start + full * block_size, 1, tail)):
            if n == 0 or ln == 0:
                continue
            last = runs[-1] if runs else None
            if last is not None and last.length == ln and last.start + last.count * ln == s:
                runs[-1] = last._replace(count=last.count + n)
            else:
                runs.append(Run(s, n, ln, slot))
            slot += n
    return runs


def message_bytes(plan: LayoutPlan, block_size: int) -> int:
    """Bytes of one rank's message (codes padded to 4 bytes, then the fp32 scales of the rank
    with the most blocks): the all-gather moves ``world_size`` of them."""
    blocks = max((sum(r.count for r in rs) for rs in all_rank_runs(plan, block_size)),
                 default=0)
    return -(-plan.shard_size // 4) * 4 + 4 * blocks


class QuantizedGather:
    """The persistent message buffers and block runs of one DBuffer's quantized all-gather.

    Args:
        plan: the buffer's layout; ``world_size`` ranks, this one is ``rank``.
        fmt: ``"int8"`` or ``"fp8"``.
        block_size: elements per block.
        device: where the message buffers live (the DBuffer's compute device).
        name: the DBuffer's name, for the error of a degenerate block.
    """

    def __init__(self, plan: LayoutPlan, *, rank: int, fmt: str, block_size: int,
                 device: torch.device, name: str = "") -> None:
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"all_gather={fmt!r}: use 'int8' or 'fp8'")
        self.fmt, self.qmax, self.block_size = fmt, QUANT_FORMATS[fmt], block_size
        self.code_dtype = torch.int8 if fmt == "int8" else fp8_dtype()
        if self.code_dtype is None:
            raise RuntimeError("all_gather='fp8' needs torch.float8_e4m3fn (torch >= 2.1)")
        self.world_size, self.rank = plan.world_size, rank
        self.plan, self.name = plan, name
        self.runs = all_rank_runs(plan, block_size)
        self.num_scales = max((sum(run.count for run in rs) for rs in self.runs), default=0)
        S = plan.shard_size
        self.shard_size, self.code_bytes = S, -(-S // 4) * 4
        self.message_bytes = self.code_bytes + 4 * self.num_scales
        self.device = device
        self.send = torch.zeros(self.message_bytes, dtype=torch.uint8, device=device)
        self.recv = torch.empty(plan.world_size * self.message_bytes, dtype=torch.uint8,
                                device=device)
        self.recv.untyped_storage().resize_(0)
        #: see :meth:`record_marks`; ``fully_shard`` sets ``defer_check`` and checks once per
        #: forward (at the root's post-forward) instead of once per all-gather
        self._marks: torch.Tensor | None = None
        self.defer_check = False
        self._uniform = all(rs == [Run(0, S // block_size, block_size, 0)] for rs in self.runs) \
            and S % block_size == 0 and S > 0

    # -- views -------------------------------------------------------------------------------
    def _codes(self, msg: torch.Tensor) -> torch.Tensor:
        """``(ranks, S)`` code view of a message buffer (``send`` or ``recv``)."""
        return msg.view(-1, self.message_bytes)[:, :self.shard_size].view(self.code_dtype)

    def _scales(self, msg: torch.Tensor) -> torch.Tensor:
        """``(ranks, K)`` fp32 scale view of a message buffer."""
        return msg.view(-1, self.message_bytes)[:, self.code_bytes:].view(torch.float32)

    # -- quantize / dequantize -----------------------------------------------------------------
    def quantize_(self, src: torch.Tensor) -> None:
        """Fill :attr:`send` from this rank's shard ``src`` (``S`` elements, any float dtype)."""
        codes, scales = self._codes(self.send)[0], self._scales(self.send)[0]
        with torch.no_grad():
            for run in self.runs[self.rank]:
                end = run.start + run.count * run.length
                x = src[run.start:end].view(run.count, run.length)
                s = scales[run.scale:run.scale + run.count]
                # the absmax in the shard's dtype (exact: a max), widened into the fp32 scales:
                # ``amax(out=)`` needs equal dtypes, and bf16/fp16 masters are common
                s.copy_(torch.amax(x.abs(), dim=1))
                s.div_(self.qmax)
                safe = torch.where(s > 0, s, torch.ones_like(s))
                q = torch.div(x, safe[:, None])
                if self.fmt == "int8":
                    q.round_()
                codes[run.start:end].view(run.count, run.length).copy_(q)
                self._mark_degenerate(x, q, s)

    def _mark_degenerate(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
        """Negate the scales of degenerate blocks (design note [quantized-degenerate-blocks]):
        finite scale, and more than half of the nonzero elements coded 0. On the device."""
        zero = q == 0 if self.fmt == "int8" else q.abs() <= 2.0 ** -10
        nonzero = x != 0
        flushed = (zero & nonzero).sum(dim=1)
        bad = (2 * flushed > nonzero.sum(dim=1)) & torch.isfinite(s)
        s.copy_(torch.where(bad, -s, s))

    def record_marks(self, msg: torch.Tensor) -> None:
        """Note, on the device, whether a sender marked a degenerate block in the gathered
        ``msg`` (design note [quantized-degenerate-blocks]): the first gather with a mark keeps
        ``(count, first index, its scale's bits)`` until :func:`check_gathers` reads it. No
        host read here; without :attr:`defer_check` it is read at once."""
        scales = self._scales(msg)
        if is_fake(scales):  # the dry run's FakeTensors carry no values to check
            return
        flat = scales.reshape(-1)
        if flat.numel() == 0:
            return
        bad = flat < 0
        first = torch.argmax(bad.to(torch.uint8)).view(1)  # the first marked (0 when none)
        bits = flat.index_select(0, first).view(torch.int32).to(torch.int64)  # not flat[first]:
        new = torch.cat([bad.sum().view(1), first, bits])  # a tensor index is read on the host
        old = self._marks
        self._marks = new if old is None else torch.where(old[0] > 0, old, new)
        _UNREAD.add(self)
        if not self.defer_check:
            check_gathers([self])

    def _raise_marked(self, count: int, index: int, bits: int) -> None:
        """The error of a marked block: ``index`` into the gathered ``(ranks, K)`` scales."""
        row, slot = divmod(index, max(self.num_scales, 1))
        absmax = -struct.unpack("<f", struct.pack("<i", bits))[0] * self.qmax
        r = row  # the sender (a world of one checks its own message: row 0, rank 0)
        run = next(u for u in self.runs[r] if u.scale <= slot < u.scale + u.count)
        pos = run.start + (slot - run.scale) * run.length  # in rank r's shard
        tensor, first = "<padding>", pos
        for spec in self.plan.entries:
            base = self.plan.offsets[spec.name] - r * self.shard_size
            a, b = self.plan.local_range(spec.name, r)
            if base + a <= pos < base + b:
                tensor, first = spec.name, pos - base
                break
        wider = "all_gather='fp8' (a wider range) or " if self.fmt == "int8" else ""
        raise RuntimeError(
            f"CommPolicy(all_gather={self.fmt!r}): parameter {tensor!r} of {self.name or 'a '}"
            f"{'' if self.name else 'group'} has a block (elements [{first}, "
            f"{first + run.length}) of the flattened tensor, absmax {absmax:.4g}) where more "
            "than half of the nonzero values quantize to 0: an outlier sets the block's scale "
            f"and its neighbours are lost ({count} such block(s) in this all-gather). "
            f"Use {wider}CommPolicy(quantize={{{tensor!r}: False}}) to keep this parameter "
            "unquantized, or remove the outlier.")

    def dequantize_(self, msg: torch.Tensor, full: torch.Tensor) -> None:
        """``full = code * scale`` for every rank's part of the gathered ``msg``."""
        W, S = msg.numel() // self.message_bytes, self.shard_size
        codes, scales = self._codes(msg), self._scales(msg)
        out = full.view(W, S)
        with torch.no_grad():
            if self._uniform:
                n, B = S // self.block_size, self.block_size
                self._mul(codes.view(W, n, B), scales[:, :n, None], out.view(W, n, B))
                return
            for r in range(W):
                for run in self.runs[r]:
                    end = run.start + run.count * run.length
                    self._mul(codes[r, run.start:end].view(run.count, run.length),
                              scales[r, run.scale:run.scale + run.count, None],
                              out[r, run.start:end].view(run.count, run.length))

    @staticmethod
    def _mul(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        # Widen in place, then scale: codes are exact in any float param_dtype (|int8| <= 127,
        # e4m3's 3 mantissa bits), so this is code * scale rounded once, as a mixed-dtype mul,
        # at ~2x its speed on CPU (and float8 arithmetic is not implemented everywhere).
        out.copy_(codes)
        out.mul_(scales)

    # -- the collective ----------------------------------------------------------------------
    def all_gather(self, src: torch.Tensor, full: torch.Tensor, *, group: Any,
                   async_op: bool) -> tuple[Any, Callable[[], None]]:
        """Quantize ``src``, start the all-gather of the messages, and return ``(work,
        finish)``: ``finish()`` (after ``work.wait()``) dequantizes into ``full`` and frees
        the receive buffer. A world of one dequantizes its own message."""
        self.quantize_(src)
        if self.world_size == 1:
            def finish_one() -> None:
                self.dequantize_(self.send, full)
                self.record_marks(self.send)
            return None, finish_one
        storage = self.recv.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.recv.numel())
        work = _all_gather_flat(self.recv, self.send, group=group, async_op=async_op)

        def finish() -> None:
            try:
                self.dequantize_(self.recv, full)
                self.record_marks(self.recv)
            finally:
                self.recv.untyped_storage().resize_(0)

        return work, finish

    def held_bytes(self) -> int:
        """Bytes held now: the persistent send buffer and, during an all-gather, the receive
        buffer (communication memory, ``DBuffer.memory_bytes()["comm"]``)."""
        return self.send.numel() + self.recv.untyped_storage().nbytes()


#: the gathers holding marks not read yet (weak: a model dropped with some does not stay alive)
_UNREAD: "weakref.WeakSet[QuantizedGather]" = weakref.WeakSet()


def any_unread() -> bool:
    """Whether some all-gather's marks wait for :func:`check_gathers` (cheap: no tensor read)."""
    return bool(_UNREAD)


def check_gathers(gathers: Iterable[QuantizedGather]) -> None:
    """Raise the error of the first degenerate block any of ``gathers`` recorded since the last
    check (design note [quantized-degenerate-blocks]), reading all their records on the host
    at once: one host read (a sync on an accelerator) for however many all-gathers ran."""
    pending = [g for g in gathers if g._marks is not None]
    if not pending:
        return
    marks = torch.stack([g._marks for g in pending]).tolist()
    for g in pending:
        g._marks = None
        _UNREAD.discard(g)
    for g, (count, index, bits) in zip(pending, marks):
        if count > 0:
            g._raise_marked(int(count), int(index), int(bits))
