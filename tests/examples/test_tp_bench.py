"""Smoke test of ``benchmarks/tp_fsdp.py`` at toy size (structure and consistency, no timings):
a world-4 ``(dp 2, tp 2)`` run counts every byte in a mesh dim (nothing unattributed, TP's
functional all-reduces once each), the same on every rank, equal tp bytes for both engines
(TP's collectives are torch's in both), equal losses, and a report with the ratio rows."""

from __future__ import annotations

import torch.distributed.tensor.parallel  # noqa: F401 - imported before the ranks fork

from benchmarks import tp_fsdp

import lightning_vescale.callbacks.memory  # noqa: F401 - (imports lightning: seconds per rank)
import lightning_vescale.fsdp  # noqa: F401


def test_tp_benchmark_counts_by_mesh_dim():
    cfg = {"vocab": 64, "dim": 32, "heads": 4, "layers": 1}
    res = tp_fsdp.run("2x2", cfg, batch=2, seq=8, steps=2, timeout=300)
    ours, theirs = res["vescale"], res["fsdp2"]
    assert ours["ranks_agree"] and theirs["ranks_agree"]
    for r in (ours, theirs):
        roles = {k.split("/")[1] for k in r["bytes"]}
        assert roles <= {"dp_shard", "tp"}, r["bytes"]  # no "other": waits are not transfers
        assert r["bytes"]["all_gather/dp_shard"] > 0 and r["bytes"]["reduce_scatter/dp_shard"] > 0
    assert ours["bytes"]["all_reduce/tp"] == theirs["bytes"]["all_reduce/tp"] > 0
    assert ours["losses"] == theirs["losses"]
    assert ours["memory"]["total"] > 0 and theirs["memory"]["total"] > 0
    text = tp_fsdp.report(res)
    assert "| **tp** | all |" in text and "ours / FSDP2" in text and "params_sharded" in text
