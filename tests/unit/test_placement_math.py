"""Property tests of the pure range math in ``lightning_vescale.placement``.

References are brute force over explicit index sets (``torch.arange`` of the tensor and boolean
masks), never the functions under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard

from lightning_vescale.placement import (
    RaggedShard,
    box_numel,
    chunk_bounds,
    flat_range_to_boxes,
    overlap_matrix,
    overlap_splits,
    ragged_ranges,
    slab_pieces,
)

settings.register_profile("lv", deadline=None, max_examples=150)
settings.load_profile("lv")

# Sizes include 1, primes and zero-free small composites.
dim_sizes = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 11])
shapes = st.lists(dim_sizes, min_size=0, max_size=4).map(tuple)


@st.composite
def shape_and_placement(draw, max_ranks: int = 5):
    """A shape and a valid RaggedShard on it: zeros, one-hot and prime sizes included."""
    shape = draw(st.lists(dim_sizes, min_size=0, max_size=4).map(tuple))
    k = draw(st.integers(0, len(shape)))
    dims = tuple(range(k))
    p = math.prod(shape[:k])
    divisors = [u for u in range(1, p + 1) if p % u == 0]
    total = draw(st.sampled_from(divisors))
    ranks = draw(st.integers(1, max_ranks))
    kind = draw(st.sampled_from(["random", "one_hot", "even"]))
    if kind == "one_hot" or ranks == 1:
        owner = draw(st.integers(0, ranks - 1))
        units = [total if r == owner else 0 for r in range(ranks)]
    elif kind == "even" and total % ranks == 0:
        units = [total // ranks] * ranks
    else:  # a random composition of `total` into `ranks` parts (zeros allowed)
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=ranks - 1,
                                    max_size=ranks - 1)))
        bounds = [0, *cuts, total]
        units = [bounds[i + 1] - bounds[i] for i in range(ranks)]
    return shape, RaggedShard(dims, units)


# -- RaggedShard validation ------------------------------------------------------------------------
@pytest.mark.parametrize("dims", [(1,), (0, 2), (1, 0), (-1,)])
def test_non_prefix_dims_raise(dims):
    with pytest.raises(ValueError, match="prefix"):
        RaggedShard(dims, (1, 1))


@pytest.mark.parametrize("units", [(-1, 2), (0, 0), (0,), ()])
def test_bad_units_raise(units):
    with pytest.raises(ValueError, match="local_units"):
        RaggedShard((0,), units)


def test_units_must_divide_p():
    with pytest.raises(ValueError, match="must divide P=6"):
        RaggedShard((0,), (2, 2)).validate((6, 3))
    with pytest.raises(ValueError, match="must divide P=1"):
        RaggedShard((), (1, 1)).validate((4,))
    RaggedShard((0, 1), (2, 2)).validate((6, 2))  # P = 12


def test_units_length_must_match_mesh():
    with pytest.raises(ValueError, match="2 entries but the mesh dimension has 3 ranks"):
        RaggedShard((0,), (1, 1)).validate((4,), mesh_size=3)
    RaggedShard((0,), (1, 1)).validate((4,), mesh_size=2)


def test_dims_longer_than_tensor_raise():
    with pytest.raises(ValueError, match="longer than the tensor"):
        RaggedShard((0, 1), (1,)).validate((4,))


def test_identity_and_pickle():
    import pickle

    a = RaggedShard([0, 1], [1, 0, 2])
    assert a == RaggedShard((0, 1), (1, 0, 2)) and hash(a) == hash(RaggedShard((0, 1), (1, 0, 2)))
    assert a != RaggedShard((0,), (1, 0, 2)) and a != Shard(0)
    assert pickle.loads(pickle.dumps(a)) == a
    assert not a.is_shard() and not a.is_replicate() and not a.is_partial()
    assert RaggedShard((), (0, 1)).is_one_hot and not a.is_one_hot


def test_pickles_use_the_public_path_and_fx_repr_evaluates():
    import pickle

    a = RaggedShard((0, 1), (1, 0, 2))
    for obj in (a, ragged_ranges((3, 2), a), flat_range_to_boxes((3, 2), 1, 5)):
        data = pickle.dumps(obj)
        assert b"lightning_vescale.placement" in data and b"_ragged_shard" not in data
        assert pickle.loads(data) == obj
    source, names = a.__fx_repr__()  # torch's opaque-object contract: (evaluable str, globals)
    assert eval(source, dict(names)) == a


# -- ragged_ranges ---------------------------------------------------------------------------------
@given(shape_and_placement())
def test_ragged_ranges_partition_in_rank_order(sp):
    shape, pl = sp
    numel = math.prod(shape)
    ranges = ragged_ranges(shape, pl)
    assert len(ranges) == len(pl.local_units)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    for (s0, e0), (s1, _) in zip(ranges, ranges[1:]):
        assert e0 == s1
    # units are atomic: every boundary falls on a unit boundary, sizes proportional to units
    p = math.prod(shape[: len(pl.dims)])
    unit = numel // pl.num_units
    assert unit * pl.num_units == numel and unit == (p // pl.num_units) * (numel // p if p else 0)
    for (s, e), u in zip(ranges, pl.local_units):
        assert s % unit == 0 if unit else True
        assert e - s == u * unit
        assert pl.local_numel(shape, ranges.index((s, e))) == e - s


# -- flat_range_to_boxes ---------------------------------------------------------------------------
@st.composite
def shape_and_range(draw):
    shape = draw(shapes)
    numel = math.prod(shape)
    a = draw(st.integers(0, numel))
    b = draw(st.integers(0, numel))
    return shape, min(a, b), max(a, b)


@given(shape_and_range())
def test_boxes_concatenate_to_the_range(sr):
    shape, start, end = sr
    full = torch.arange(math.prod(shape)).reshape(shape)
    boxes = flat_range_to_boxes(shape, start, end)
    pieces = []
    for offsets, sizes in boxes:
        assert len(offsets) == len(sizes) == len(shape)
        assert all(0 <= o and o + s <= n and s > 0 for o, s, n in zip(offsets, sizes, shape))
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        pieces.append(full[index].reshape(-1))
        assert box_numel((offsets, sizes)) == math.prod(sizes)
    got = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, torch.arange(start, end))
    # DCP chunk budget: at most 2^d - 1 rectangles (our decomposition needs at most 2d - 1)
    d = len(shape)
    assert len(boxes) <= max(1, 2 * d - 1) <= max(1, 2 ** d - 1)


def test_boxes_reject_out_of_range():
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_boxes((2, 3), 4, 7)
    with pytest.raises(ValueError, match="outside"):
        flat_range_to_boxes((2, 3), 3, 2)


# -- overlap_matrix --------------------------------------------------------------------------------
@given(shape_and_placement(max_ranks=4), st.data())
def test_overlap_matrix_is_set_intersection(sp, data):
    shape, src = sp
    ranks = len(src.local_units)
    p = math.prod(shape[: len(src.dims)])
    total = data.draw(st.sampled_from([u for u in range(1, p + 1) if p % u == 0]))
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=ranks - 1,
                                     max_size=ranks - 1)))
    bounds = [0, *cuts, total]
    dst = RaggedShard(src.dims, [bounds[i + 1] - bounds[i] for i in range(ranks)])
    a, b = ragged_ranges(shape, src), ragged_ranges(shape, dst)
    m = overlap_matrix(a, b)
    for r in range(ranks):
        for q in range(ranks):
            assert m[r][q] == len(set(range(*a[r])) & set(range(*b[q])))
        assert sum(m[r]) == a[r][1] - a[r][0]
        assert sum(row[r] for row in m) == b[r][1] - b[r][0]
        send, recv = overlap_splits(a, b, r)  # one rank's view of the same matrix
        assert send == m[r] and recv == [row[r] for row in m]


# -- chunk_bounds (torch.chunk / Shard semantics) --------------------------------------------------
@given(st.integers(0, 40), st.integers(1, 6))
def test_chunk_bounds_match_torch(size, n):
    bounds = chunk_bounds(size, n)
    chunks = torch.arange(size).chunk(n) if size else ()
    for r, (lo, hi) in enumerate(bounds):
        ref = chunks[r] if r < len(chunks) else torch.empty(0, dtype=torch.long)
        assert torch.equal(torch.arange(lo, hi), ref)
        ref_size, ref_offset = Shard.local_shard_size_and_offset(size, n, r)
        assert hi - lo == ref_size and (hi == lo or lo == ref_offset)


def test_chunk_bounds_rejects_zero_chunks():
    with pytest.raises(ValueError, match="num_chunks"):
        chunk_bounds(4, 0)


# -- slab_pieces -----------------------------------------------------------------------------------
@given(shape_and_range(), st.data())
def test_slab_pieces_are_the_range_within_the_slab_in_flat_order(sr, data):
    shape, start, end = sr
    if not shape:
        return
    dim = data.draw(st.integers(0, len(shape) - 1))
    lo = data.draw(st.integers(0, shape[dim]))
    hi = data.draw(st.integers(lo, shape[dim]))
    full = torch.arange(math.prod(shape)).reshape(shape)
    coord = torch.arange(shape[dim]).view([-1 if i == dim else 1 for i in range(len(shape))])
    mask = ((coord >= lo) & (coord < hi)).expand(shape).reshape(-1)
    flat_idx = torch.arange(math.prod(shape))
    expected = flat_idx[mask & (flat_idx >= start) & (flat_idx < end)]
    pieces = [
        full[tuple(slice(o, o + s) for o, s in zip(off, sizes))].reshape(-1)
        for off, sizes in slab_pieces(shape, start, end, dim, lo, hi)
    ]
    got = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    assert torch.equal(got, expected)
