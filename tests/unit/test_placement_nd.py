"""Which mesh dim a RaggedShard redistribution acts on (design note [ragged-nd]); no PG."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from lightning_vescale.placement import RaggedShard
from lightning_vescale.placement._dtensor import _ragged_pair_dim

R = Replicate()
RS = RaggedShard((0,), (1, 2))
RS2 = RaggedShard((0,), (2, 1))


@pytest.mark.parametrize("src, dst, dim", [
    ((RS,), (R,), 0),
    ((RS,), (Shard(1),), 0),
    ((Partial(),), (RS,), 0),
    ((R, RS), (R, R), 1),
    ((R, RS), (R, RS2), 1),
    ((R, RS), (R, Shard(0)), 1),
    ((R, Shard(2)), (R, RS), 1),
    ((R, R), (R, RS), 1),
    ((R, Partial()), (R, RS), 1),
    ((R, RS), (R, Partial()), 1),
    ((RS, R), (Shard(0), R), 0),
    ((R, R, RS), (R, R, R), 2),
])
def test_supported_pairs_act_on_the_ragged_dim(src, dst, dim):
    assert _ragged_pair_dim(src, dst) == dim


@pytest.mark.parametrize("src, dst", [
    ((R, RS), (Shard(0), RS)),        # a Shard on the replicate dim
    ((R, RS), (Shard(0), R)),         # two dims change
    ((Partial(), RS), (R, R)),        # a Partial on the replicate dim
    ((R, RS), (RS, R)),               # the ragged dim moves
    ((RS, RS), (R, R)),               # two ragged dims
    ((R, Partial()), (Shard(0), RS)),
])
def test_other_pairs_raise_with_the_way_out(src, dst):
    with pytest.raises(NotImplementedError, match="Redistribute in steps"):
        _ragged_pair_dim(src, dst)
