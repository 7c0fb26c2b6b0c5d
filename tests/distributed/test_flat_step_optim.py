"""The package's optimizers use the flat step for their AdamW parts, bitwise as before.

* Muon's AdamW fallback passes RaggedShard DTensors with ``foreach=True``, so its element-wise
  work runs on whole DBuffer shards: equal to the same step with the flat step off.
* AdamW8bit's fp32-moment parameters (small tensors) that lie back to back in a shard step as
  one flat range: equal to the per-parameter path (a subclass that never forms runs).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_vescale.fsdp import fully_shard
from lightning_vescale.optim import AdamW8bit, Muon
from lightning_vescale.placement import flat_step_enabled
from lightning_vescale.placement._flat_step import flat_step_stats


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(17, 24)
        self.ln = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 48)
        self.ln2 = nn.LayerNorm(48)
        self.out = nn.Linear(48, 17)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.emb(idx))
        h = self.ln2(F.gelu(self.fc(h)))
        return F.cross_entropy(self.out(h).reshape(-1, 17), idx.reshape(-1))


def _model(**kw) -> nn.Module:
    torch.manual_seed(0)
    m = Net()
    fully_shard(m.fc, **kw)
    return fully_shard(m, **kw)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _data(steps: int):
    g = torch.Generator().manual_seed(dist.get_rank())
    return [torch.randint(0, 17, (3, 5), generator=g) for _ in range(steps)]


def _muon_body() -> dict:
    a, b = _model(), _model()
    oa = Muon(a.named_parameters(), lr=0.02, adamw_lr=3e-3)
    ob = Muon(b.named_parameters(), lr=0.02, adamw_lr=3e-3)
    same = []
    flat_step_stats.clear()
    for idx in _data(3):
        for m, o, flat in ((a, oa, True), (b, ob, False)):
            m(idx).backward()
            with flat_step_enabled(flat):
                o.step()
            o.zero_grad()
        same.append(all(torch.equal(_local(p), _local(q))
                        for p, q in zip(a.parameters(), b.parameters())))
    return {"same": same, "stats": dict(flat_step_stats)}


def test_muon_adamw_fallback_takes_the_flat_step(worlds):
    for r in worlds(2).run(_muon_body):
        assert all(r["same"]), r
        assert r["stats"].get("flat_calls", 0) > 0, r["stats"]
        assert r["stats"]["flat_runs"] < r["stats"]["flat_items"], r["stats"]


class _PerParameter(AdamW8bit):
    """The reference: AdamW8bit without fp32 runs (every small tensor on its own)."""

    @staticmethod
    def _step_fp32_runs(group, entries, bs):
        return set()


class _Counting(AdamW8bit):
    runs = 0

    @staticmethod
    def _step_fp32_runs(group, entries, bs):
        done = AdamW8bit._step_fp32_runs(group, entries, bs)
        _Counting.runs += len(done)
        return done


def _adamw8bit_body() -> dict:
    a, b = _model(granularity=64), _model(granularity=64)
    # block_size 64 with row granularity 64 keeps every quantized shard block-aligned
    oa = _Counting(a.parameters(), lr=3e-3, weight_decay=0.1, block_size=64, min_8bit_size=512)
    ob = _PerParameter(b.parameters(), lr=3e-3, weight_decay=0.1, block_size=64,
                       min_8bit_size=512)
    same = []
    for idx in _data(3):
        for m, o in ((a, oa), (b, ob)):
            m(idx).backward()
            o.step()
            o.zero_grad()
        same.append(all(torch.equal(_local(p), _local(q))
                        for p, q in zip(a.parameters(), b.parameters())))
    return {"same": same, "runs": _Counting.runs}


def test_adamw8bit_fp32_params_step_in_runs(worlds):
    results = worlds(2).run(_adamw8bit_body)
    for r in results:
        assert all(r["same"]), r
    assert sum(r["runs"] for r in results) > 0, results  # rank 0 holds the small tensors
