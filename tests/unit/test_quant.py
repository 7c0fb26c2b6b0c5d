"""Block-wise dynamic 8-bit quantization (lightning_vescale/optim/_quant.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_vescale.optim import (
    CodeBook,
    codebook,
    block_absmax,
    dequantize_blockwise,
    dynamic_code_map,
    num_blocks,
    quantize_blockwise,
    signed_code_map,
    unsigned_code_map,
)


def test_code_maps_structure():
    s, u = signed_code_map(), unsigned_code_map()
    for code in (s, u):
        assert code.dtype == torch.float32 and code.numel() == 256
        assert bool((code[1:] > code[:-1]).all()), "strictly increasing: 256 distinct codes"
        assert code.max().item() == 1.0 and (code == 0).sum().item() == 1
    assert u.min().item() == 0.0
    # signed: 127 negatives mirroring the 127 positives below 1.0
    pos = s[s > 0]
    neg = s[s < 0]
    assert pos.numel() == 128 and neg.numel() == 127
    assert torch.equal(torch.sort(-neg).values, pos[:-1])
    # dynamic tree: decade i (values in [0.1*10^(i-6), 10^(i-6))) holds 2^i signed / 2^(i+1)
    # unsigned codes, i.e. the fraction resolution doubles with every decade.
    for i in range(7):
        lo, hi = 0.1 * 10.0 ** (i - 6), 10.0 ** (i - 6)
        assert int(((pos >= lo) & (pos < hi)).sum()) == 2 ** i
        assert int(((u >= lo) & (u < hi)).sum()) == 2 ** (i + 1)
    assert torch.equal(dynamic_code_map(True), s) and torch.equal(dynamic_code_map(False), u)


def _brute_nearest(normed: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    return (normed[:, None].double() - code[None, :].double()).abs().min(dim=1).values


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n,block", [(1000, 256), (4096, 256), (777, 64), (5, 256)])
def test_roundtrip_nearest_code_and_bounds(signed, n, block):
    g = torch.Generator().manual_seed(n + block)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 1, n)[torch.randperm(n, generator=g)]
    if not signed:
        x = x * x
    code = signed_code_map() if signed else unsigned_code_map()
    codes, absmax = quantize_blockwise(x, code, block)
    assert codes.dtype == torch.uint8 and codes.shape == (n,)
    assert absmax.dtype == torch.float32 and absmax.shape == (num_blocks(n, block),)
    # absmax is the exact per-block max |x|
    for k in range(num_blocks(n, block)):
        assert absmax[k].item() == x[k * block:(k + 1) * block].abs().max().item()
    scale = absmax.repeat_interleave(block)[:n]
    normed = x / scale
    # each code is the nearest code value (ties aside): compare with a brute-force argmin
    err = (normed - code[codes.long()]).abs().double()
    best = _brute_nearest(normed, code)
    assert torch.allclose(err, best, rtol=0, atol=1e-7)
    # reconstruction error bound: half the widest gap between neighbouring codes, times absmax
    y = dequantize_blockwise(codes, absmax, code, block)
    # (for the signed map -1.0 is not a code: its error 1 - 0.99297 equals that half gap)
    half_gap = ((code[1:] - code[:-1]).max() / 2).item()
    assert bool(((x - y).abs() <= scale * half_gap * (1 + 1e-4)).all())
    # relative error of values >= 1% of the block max: at most the map's relative half gap there
    # (about 12.3% signed / 6.6% unsigned at 0.01, shrinking to < 1% near the block max)
    big = normed.abs() >= 0.01
    rel = ((x - y).abs() / x.abs())[big]
    mag = code.abs()
    lo = torch.minimum(mag[1:], mag[:-1])
    keep = lo >= 0.0099
    rel_half_gap = ((code[1:] - code[:-1])[keep] / 2 / lo[keep]).max().item()
    assert rel_half_gap < (0.13 if signed else 0.066)
    assert rel.max().item() <= rel_half_gap * (1 + 1e-4)
    top = normed.abs() >= 0.5
    assert ((x - y).abs() / x.abs())[top].max().item() < (0.0141 if signed else 0.0071)
    # the block maximum itself is reconstructed almost exactly (1.0 is a code; -1.0 is not)
    assert ((x - y).abs() / scale).max().item() < 0.0071


def test_zero_block_and_short_tail():
    x = torch.zeros(600)
    x[512:] = torch.linspace(-2, 3, 88)
    code = signed_code_map()
    codes, absmax = quantize_blockwise(x, code, 256)
    assert absmax.tolist()[:2] == [0.0, 0.0] and absmax[2].item() == 3.0
    y = dequantize_blockwise(codes, absmax, code, 256)
    assert torch.equal(y[:512], torch.zeros(512)), "all-zero blocks reconstruct exactly"
    assert bool((codes[:512] == codes[0]).all()) and code[codes[0].long()].item() == 0.0
    assert y[-1].item() == 3.0


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_element_leaves_its_block_intact(signed, bad):
    """An inf/NaN element does not set its block's scale: the other 255 elements of the block
    quantize exactly as without it (finite), +-inf saturates, NaN gets the code of 0.0."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g)
    if not signed:
        x = x.abs()
    book = codebook(signed)
    clean = x.clone()
    clean[300] = 0.0
    c0, s0 = quantize_blockwise(clean, book, 256)
    dirty = clean.clone()
    dirty[300] = bad
    c1, s1 = quantize_blockwise(dirty, book, 256)
    assert torch.equal(s1, s0) and bool(s1.isfinite().all())
    others = torch.ones(1000, dtype=torch.bool)
    others[300] = False
    assert torch.equal(c1[others], c0[others])
    y = dequantize_blockwise(c1, s1, book, 256)
    assert bool(y.isfinite().all())
    assert torch.equal(y[256:512][others[256:512]], dequantize_blockwise(c0, s0, book, 256)[
        256:512][others[256:512]])
    want = {float("inf"): book.code[-1], float("-inf"): book.code[0]}.get(bad, 0.0)
    if not signed and bad < 0:
        want = 0.0  # the unsigned map has no negative codes
    assert book.code[c1[300].long()].item() == want
    # a block of nothing but non-finite values gets scale 0 and dequantizes to 0
    c2, s2 = quantize_blockwise(torch.full((256,), bad), book, 256)
    assert s2.item() == 0.0 and torch.equal(dequantize_blockwise(c2, s2, book, 256),
                                            torch.zeros(256))


def test_block_independence_slices_match():
    """A block-aligned slice quantizes to exactly the slice of the whole tensor's codes/scales."""
    x = torch.randn(256 * 7 + 100)
    code = signed_code_map()
    codes, absmax = quantize_blockwise(x, code, 256)
    for a, b in [(0, 256), (256, 1024), (1536, x.numel()), (512, 512)]:
        c2, s2 = quantize_blockwise(x[a:b], code, 256)
        assert torch.equal(c2, codes[a:b])
        assert torch.equal(s2, absmax[a // 256: num_blocks(b, 256)])


def test_low_precision_input_and_bad_arguments():
    x = torch.randn(512).bfloat16()
    codes, absmax = quantize_blockwise(x, signed_code_map(), 256)
    assert torch.equal(absmax, block_absmax(x.float(), 256))
    with pytest.raises(ValueError, match="flat contiguous"):
        quantize_blockwise(torch.randn(4, 4), signed_code_map(), 4)
    with pytest.raises(ValueError, match="block_size"):
        quantize_blockwise(torch.randn(4), signed_code_map(), 0)
    with pytest.raises(ValueError, match="absmax has"):
        dequantize_blockwise(codes, absmax[:1], signed_code_map(), 256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an accelerator")
def test_device_matches_cpu():
    x = torch.randn(256 * 9 + 3)
    code = signed_code_map()
    c_cpu, s_cpu = quantize_blockwise(x, code, 256)
    c_dev, s_dev = quantize_blockwise(x.cuda(), code.cuda(), 256)
    assert torch.equal(c_dev.cpu(), c_cpu) and torch.equal(s_dev.cpu(), s_cpu)


@pytest.mark.parametrize("signed", [True, False])
def test_lookup_table_rounding_equals_bucketize(signed):
    """The two-lookup nearest-code search is exactly bucketize into the midpoints."""
    book = codebook(signed)
    assert book.lut is not None, "the dynamic maps qualify for the lookup table"
    mid = book.midpoints
    nxt = torch.nextafter(mid, torch.full_like(mid, 2.0))
    prv = torch.nextafter(mid, torch.full_like(mid, -2.0))
    g = torch.Generator().manual_seed(0)
    x = torch.cat([
        torch.rand(200_000, generator=g) * 2 - 1,
        (torch.rand(20_000, generator=g) * 2 - 1) * torch.logspace(-12, 0, 20_000),
        mid, nxt, prv, book.code, -book.code,
        torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1.5e-45]),
    ])
    if not signed:
        x = x.abs()
    assert torch.equal(book.nearest(x), torch.bucketize(x, mid, out_int32=True))
    # and a map that does not qualify falls back to bucketize
    coarse = CodeBook.from_code(torch.cat([torch.tensor([0.0]), torch.linspace(0.99, 1.0, 255)]))
    assert coarse.lut is None
    assert torch.equal(coarse.nearest(x.abs()),
                       torch.bucketize(x.abs(), coarse.midpoints, out_int32=True))
