"""Block-wise dynamic 8-bit quantization: pure functions and the one state type, any device.

As torchao's ``optim/``: the quantization maths are pure functions of their inputs (no optimizer,
no process group), and :class:`QuantizedMoment` is the minimal state type that names a moment's
codes and scales together. ``AdamW8bit`` (``adamw8bit.py``) is built on them; another block-wise
optimizer would be too.

Design note [blockwise-quant]
-----------------------------
Dettmers et al., "8-bit Optimizers via Block-wise Quantization" (ICLR 2022) store each optimizer
moment as 8-bit *codes* into a fixed, non-linear *code map* (the "dynamic tree" map: a sign, an
exponent run of zeros and a linear fraction, spanning ``1e-7 .. 1``), normalised per *block* of
``B`` consecutive elements by that block's absolute maximum (one fp32 ``absmax`` per block)::

    codes[i]  = argmin_j |code_map[j] - x[i] / absmax[block(i)]|        (uint8)
    x_hat[i]  = code_map[codes[i]] * absmax[block(i)]

Blocks are consecutive runs of a flat (row-major) tensor: block ``k`` is elements
``[k*B, (k+1)*B)``; the last block may be shorter. Nothing else couples elements, which is what
makes sharded quantization exact: a shard that starts on a multiple of ``B`` (and ends on one, or
at the tensor's end) quantizes to exactly the matching slice of the whole tensor's codes and
scales.

The maps are bit-identical to bitsandbytes' ``create_dynamic_map(signed=True)`` (first moment)
and ``create_dynamic_map(signed=False)`` (second moment, which is non-negative, so the sign bit
becomes one more fraction bit). Rounding is to the nearest code; a value exactly halfway between
two codes rounds to the lower one. An all-zero block has ``absmax == 0`` and codes of ``0.0``.

*Non-finite values* stay confined to their own element, as in torch.optim.AdamW's fp32 states (a
plain ``max |x|`` would let one ``inf`` make its block's scale ``inf`` and then every dequantized
value of the block ``0 * inf = NaN``).
``absmax`` is the maximum over the block's *finite* values (``0`` if there are none), and after
normalisation ``+inf``/``-inf`` saturate to the codes nearest ``+1``/``-1`` and NaN takes the code
of ``0.0``. So the 255 other elements of a block holding an ``inf`` or NaN keep their exact codes
and scale, and every dequantized value is finite.

Everything here is elementwise or a per-block max, so results do not depend on how a tensor is
chunked, on the device's vector width, or on the number of ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "QuantizedMoment",
    "CodeBook",
    "codebook",
    "dynamic_code_map",
    "signed_code_map",
    "unsigned_code_map",
    "code_midpoints",
    "num_blocks",
    "block_absmax",
    "quantize_blockwise",
    "quantize_blockwise_",
    "dequantize_blockwise",
    "dequantize_blockwise_",
    "zero_code",
]

#: Elements per quantization block (bitsandbytes' value). The one definition in the package:
#: ``AdamW8bit(block_size=...)`` defaults to it, and sharded parameters need shard bounds on
#: multiples of it (the strategies' default ``optimizer_block_size`` should import it).
DEFAULT_BLOCK_SIZE = 256


def _constants() -> Any:
    """A context in which the quantizer's constants (code maps, code books) are computed with
    real tensors even under a ``FakeTensorMode`` (the dry run, ``lightning_vescale.dryrun``):
    they are read back as Python numbers and cached, so they must never be fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()


@functools.lru_cache(maxsize=None)
def _dynamic_map_values(signed: bool, max_exponent_bits: int = 7, total_bits: int = 8) -> tuple:
    with _constants():
        return _dynamic_map_values_impl(signed, max_exponent_bits, total_bits)


def _dynamic_map_values_impl(signed: bool, max_exponent_bits: int, total_bits: int) -> tuple:
    # Dettmers' dynamic tree map, as bitsandbytes builds it (functional.create_dynamic_map).
    data: list[float] = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        boundaries = torch.linspace(0.1, 1, fraction_items, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if additional_items > 0:  # not reached for the 8-bit, 7-exponent-bit maps used here
        boundaries = torch.linspace(0.1, 1, additional_items + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + max_exponent_bits - 1)) * means).tolist()
    data.append(0.0)
    data.append(1.0)
    data += [0.0] * (2**total_bits - len(data))
    data.sort()
    return tuple(data)


def dynamic_code_map(signed: bool, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The 256-entry dynamic code map (sorted ascending, fp32) on ``device``.

    ``signed=True`` spans ``[-0.99297, 1]`` with one exact zero (first moment);
    ``signed=False`` spans ``[0, 1]`` with twice the resolution (second moment).
    """
    return torch.tensor(_dynamic_map_values(bool(signed)), dtype=torch.float32, device=device)


def signed_code_map(device: torch.device | str | None = None) -> torch.Tensor:
    """``dynamic_code_map(signed=True)``: the first-moment map."""
    return dynamic_code_map(True, device=device)


def unsigned_code_map(device: torch.device | str | None = None) -> torch.Tensor:
    """``dynamic_code_map(signed=False)``: the second-moment map."""
    return dynamic_code_map(False, device=device)


def code_midpoints(code: torch.Tensor) -> torch.Tensor:
    """Decision boundaries for nearest rounding into the sorted ``code`` (255 values)."""
    return (code[1:] + code[:-1]) * 0.5


# -- nearest code: a bucketize without the binary search ------------------------------------------
# ``torch.bucketize`` does a per-element binary search (~5x slower than the rest of a step on
# CPU). Instead: the top 17 bits of an fp32 value (sign, exponent, 8 mantissa bits) pick one of
# 2^17 buckets, each spanning a relative width of 2^-8 = 0.39%, less than the smallest relative
# gap between two midpoints of either dynamic map (0.7%). So a bucket holds at most one
# midpoint, and ``idx = lut[bucket]; idx += x > mid[idx]`` is exactly
# ``bucketize(x, midpoints)`` (ties to the lower code), with two table lookups. ``CodeBook``
# verifies the "one midpoint per bucket" property when it is built and otherwise falls back to
# bucketize, so any sorted 256-entry map works.
_LUT_SHIFT = 15


@dataclass(frozen=True, kw_only=True, eq=False)
class CodeBook:
    """A code map with what nearest rounding into it needs (build with :func:`codebook`)."""

    code: torch.Tensor  # (256,) fp32, sorted ascending
    midpoints: torch.Tensor  # (255,) fp32
    mid_ext: torch.Tensor  # (256,) midpoints + [inf]
    lut: torch.Tensor | None  # (2^17,) int32: bucketize(lowest value of the bucket), or None

    @staticmethod
    def from_code(code: torch.Tensor) -> "CodeBook":
        """Build the tables for a sorted fp32 ``code`` (on its device)."""
        code = code.float()
        if code.dim() != 1 or not bool((code[1:] > code[:-1]).all()):
            raise ValueError("a code map must be a 1-D, strictly increasing tensor")
        mid = code_midpoints(code)
        mid_ext = torch.cat([mid, mid.new_full((1,), float("inf"))])
        hi = torch.arange(1 << (32 - _LUT_SHIFT), dtype=torch.int64)
        neg = ((hi >> (31 - _LUT_SHIFT)) & 1).bool()
        ones = (1 << _LUT_SHIFT) - 1
        low_end = (hi << _LUT_SHIFT) | torch.where(neg, ones, 0)  # smallest value of the bucket
        high_end = (hi << _LUT_SHIFT) | torch.where(neg, 0, ones)  # largest value of the bucket

        def as_float(bits: torch.Tensor) -> torch.Tensor:
            signed_bits = torch.where(bits >= 2**31, bits - 2**32, bits)
            return signed_bits.to(torch.int32).view(torch.float32)

        lo, top = as_float(low_end), as_float(high_end)
        mid_cpu = mid.cpu()
        lut = torch.bucketize(lo, mid_cpu)
        finite = lo.isfinite() & top.isfinite()
        spread = (torch.bucketize(top, mid_cpu) - lut)[finite]
        lut_t = lut.to(torch.int32).to(code.device) if int(spread.max()) <= 1 else None
        return CodeBook(code=code, midpoints=mid, mid_ext=mid_ext, lut=lut_t)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """Index (int32) of the nearest code for each fp32 element of ``x`` (any shape)."""
        if self.lut is None:
            return torch.bucketize(x, self.midpoints, out_int32=True)
        bucket = (x.view(torch.int32) >> _LUT_SHIFT).bitwise_and_((1 << (32 - _LUT_SHIFT)) - 1)
        idx = torch.index_select(self.lut, 0, bucket.reshape(-1)).view(x.shape)
        above = torch.gt(x, torch.index_select(self.mid_ext, 0, idx.reshape(-1)).view(x.shape))
        return idx.add_(above)


@functools.lru_cache(maxsize=None)
def codebook(signed: bool, device: torch.device | str = "cpu") -> CodeBook:
    """The (cached) :class:`CodeBook` of ``dynamic_code_map(signed)`` on ``device``."""
    device = torch.device(device)
    with _constants():
        return CodeBook.from_code(dynamic_code_map(signed, device=device))


def _as_book(code: torch.Tensor | CodeBook) -> CodeBook:
    return code if isinstance(code, CodeBook) else CodeBook.from_code(code)


def num_blocks(numel: int, block_size: int) -> int:
    """Number of blocks of ``block_size`` elements covering ``numel`` (the last may be short)."""
    return -(-int(numel) // int(block_size))


def _check(x: torch.Tensor, block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got block_size={block_size}")
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(
            f"blockwise quantization works on flat contiguous tensors, got shape "
            f"{tuple(x.shape)} (contiguous={x.is_contiguous()}); pass x.reshape(-1)"
        )


def _per_block(x: torch.Tensor, scale: torch.Tensor, block_size: int, op,
               out: torch.Tensor) -> None:
    # out = op(x, scale[block of each element]) for a flat x; out may alias x.
    n = x.numel()
    nfull = n // block_size
    if nfull:
        op(x[: nfull * block_size].view(nfull, block_size), scale[:nfull, None],
           out=out[: nfull * block_size].view(nfull, block_size))
    if n > nfull * block_size:
        op(x[nfull * block_size:], scale[nfull], out=out[nfull * block_size:])


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    # |x| with inf and NaN replaced by 0, so they never set a block's scale
    return torch.nan_to_num_(x.abs(), nan=0.0, posinf=0.0)


def block_absmax(x: torch.Tensor, block_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-block ``max |x|`` over the finite elements (fp32, ``num_blocks(x.numel(),
    block_size)`` entries; ``0`` for a block without a finite non-zero value)."""
    _check(x, block_size)
    n = x.numel()
    nfull = n // block_size
    if out is None:
        out = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=x.device)
    if nfull:
        torch.amax(_finite_abs(x[: nfull * block_size].view(nfull, block_size)), dim=1,
                   out=out[:nfull])
    if n > nfull * block_size:
        out[nfull] = _finite_abs(x[nfull * block_size:]).amax()
    return out


def quantize_blockwise_(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor,
                        book: CodeBook, block_size: int) -> None:
    """In-place form of :func:`quantize_blockwise`: fills ``codes``/``absmax``.

    ``x`` must be a flat contiguous fp32 tensor; it is used as scratch (overwritten).
    """
    _check(x, block_size)
    block_absmax(x, block_size, out=absmax)
    # An all-zero block keeps absmax 0; divide by 1 there so its codes are those of 0.0.
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    _per_block(x, safe, block_size, torch.div, x)
    # Finite values now lie in [-1, 1]; saturate +-inf there and give NaN the code of 0.0.
    torch.nan_to_num_(x, nan=0.0, posinf=1.0, neginf=-1.0)
    codes.copy_(book.nearest(x))


def quantize_blockwise(
    x: torch.Tensor, code: torch.Tensor | CodeBook, block_size: int = DEFAULT_BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the flat tensor ``x`` to ``(codes uint8, absmax fp32 per block)``.

    Args:
        x: 1-D contiguous floating tensor (computed in fp32).
        code: a sorted 256-entry code map (see :func:`dynamic_code_map`) or its
            :class:`CodeBook` (:func:`codebook`, cached: use it in loops).
        block_size: elements per block; block ``k`` is ``x[k*B:(k+1)*B]``.
    """
    _check(x, block_size)
    book = _as_book(code)
    work = x.to(dtype=torch.float32, copy=True)
    codes = torch.empty(x.numel(), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(num_blocks(x.numel(), block_size), dtype=torch.float32, device=x.device)
    quantize_blockwise_(work, codes, absmax, book, block_size)
    return codes, absmax


def dequantize_blockwise_(out: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor,
                          code: torch.Tensor, block_size: int) -> None:
    """In-place form of :func:`dequantize_blockwise` into the flat fp32 ``out``."""
    torch.index_select(code, 0, codes.int(), out=out)
    _per_block(out, absmax, block_size, torch.mul, out)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor | CodeBook,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: ``code[codes] * absmax[block]`` (flat fp32)."""
    _check(codes, block_size)
    if absmax.numel() != num_blocks(codes.numel(), block_size):
        raise ValueError(
            f"absmax has {absmax.numel()} entries but {codes.numel()} codes in blocks of "
            f"{block_size} need {num_blocks(codes.numel(), block_size)}"
        )
    table = code.code if isinstance(code, CodeBook) else code.float()
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    dequantize_blockwise_(out, codes, absmax, table, block_size)
    return out


@functools.lru_cache(maxsize=None)
def zero_code(signed: bool) -> int:
    """The code of ``0.0`` in ``dynamic_code_map(signed)`` (127 signed, 0 unsigned): the fill
    value of a fresh (all-zero) moment's codes."""
    with _constants():
        return int(codebook(signed).nearest(torch.zeros(1)))


# -------------------------------------------------------------------------------------------------
# The state type: one block-quantized moment (views into an optimizer's state tensors).
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class QuantizedMoment:
    """One moment stored as 8-bit ``codes`` into a dynamic map plus one fp32 ``absmax`` per block.

    ``codes`` (uint8, ``n`` elements) and ``absmax`` (fp32, ``num_blocks(n, block_size)``) are
    flat tensors, usually views into an optimizer's state; this type only names them together
    with how to read them (see design note [blockwise-quant]). ``signed`` picks the code map:
    ``True`` for a moment of either sign (Adam's first), ``False`` for a non-negative one.
    """

    codes: torch.Tensor
    absmax: torch.Tensor
    signed: bool
    block_size: int

    def dequantize(self) -> torch.Tensor:
        """The moment in fp32 (flat, a new tensor)."""
        out = torch.empty(self.codes.numel(), dtype=torch.float32, device=self.codes.device)
        dequantize_blockwise_(out, self.codes, self.absmax,
                              codebook(self.signed, self.codes.device).code, self.block_size)
        return out

    def quantize_(self, x: torch.Tensor) -> None:
        """Store ``x`` (any shape with ``codes.numel()`` elements, any float dtype) into
        ``codes``/``absmax`` in place; ``x`` is not modified."""
        work = x.reshape(-1).to(dtype=torch.float32, copy=True)
        quantize_blockwise_(work, self.codes, self.absmax, codebook(self.signed, self.codes.device),
                            self.block_size)
