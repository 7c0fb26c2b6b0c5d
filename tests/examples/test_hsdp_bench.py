"""Smoke tests of the HSDP benchmark and its network model (structure and consistency, never timings).

* ``benchmarks.hsdp_network_model``: the ring formulas, per-rank sizes equal to the planner's and
  to FSDP2's ``torch.chunk`` padding, HSDP sizes independent of the node count, and the printed
  report labels itself a model.
* ``benchmarks.hsdp``: a tiny world-4 run of all four (engine, layout) pairs; the counter puts
  every byte in the right group (full sharding: nothing across replicas; HSDP: the cross-replica
  all-reduce is exactly one gradient shard, i.e. the reduce-scatter's buffer over the shard
  size), all ranks count the same, and all pairs train to the same losses.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks import hsdp, hsdp_network_model as nm
from examples.gpt import GPT, GPTConfig
from lightning_vescale.planner import (
    PRESETS,
    fsdp2_even_rowwise,
    plan_layout,
    transformer_groups,
)
from lightning_vescale.planner.presets import with_overrides

# a 4-block LLaMA-shaped toy: the model's structure with planning in milliseconds
TOY = with_overrides(PRESETS["llama3-70b"], layers=4, hidden=256, ffn=704, heads=8, kv_heads=2,
                     vocab=1000)


def test_ring_formulas():
    assert nm.ring_all_gather_s(800.0, 1, 1.0, 1.0) == 0.0
    # (n-1)/n * B / bw + (n-1) * latency
    assert nm.ring_all_gather_s(800.0, 4, 100.0, 0.5) == pytest.approx(3 / 4 * 8 + 3 * 0.5)
    assert nm.ring_all_reduce_s(800.0, 4, 100.0, 0.5) == pytest.approx(2 * (6 + 1.5))


def test_model_sizes_come_from_the_planner_and_fsdp2_chunking():
    policy = nm.default_granularity()
    sizes = nm.group_sizes(TOY, 64)
    groups = transformer_groups(TOY, "block")
    assert [g.name for g in sizes] == [name for name, _ in groups]
    for g, (_, params) in zip(sizes, groups):
        entries = []
        for name, shape in params:  # the strategy's rule, written out
            g_elems = 256 if math.prod(shape) >= 4096 else 1
            assert policy(name, torch.empty(shape, device="meta")) == g_elems
            entries.append((name, shape, g_elems))
        assert g.shard["ours"] == plan_layout(entries, 64).shard_size
        assert g.shard["fsdp2"] == fsdp2_even_rowwise(params, 64).shard_size
        assert g.numel == sum(math.prod(s) for _, s in params)
    assert [g.gathers["ours"] for g in sizes] == [2, 2, 2, 1, 1]  # last block and root kept
    assert [g.gathers["fsdp2"] for g in sizes] == [2, 2, 2, 2, 1]
    kept = nm.group_sizes(TOY, 64, fsdp2_keeps_last_block=True)
    assert [g.gathers["fsdp2"] for g in kept] == [2, 2, 2, 1, 1]


def test_model_table_structure():
    net = nm.Network()
    rows = nm.model_table(TOY, (1, 2, 4), net)
    assert [(r["ours"].layout, r["ours"].nodes) for r in rows] == [
        ("full", 1), ("full", 2), ("full", 4), ("hsdp", 1), ("hsdp", 2), ("hsdp", 4)]
    for r in rows:
        o, f = r["ours"], r["fsdp2"]
        assert (o.shard_ranks, o.replicas) == (f.shard_ranks, f.replicas)
        assert o.shard_ranks * o.replicas == o.gpus == 8 * o.nodes
        for s in (o, f):
            assert s.total_s == pytest.approx(s.ag_s + s.rs_s + s.ar_s + s.copy_s)
            assert s.shard_elems >= s.real_elems and 0 <= s.padding < 1
        # FSDP2 pays a copy-out of every all-gather on top of the casts both engines do
        assert f.copy_bytes > o.copy_bytes
        if o.layout == "full":
            assert f.ar_bytes == 0 and f.ar_s == 0.0
            assert o.ar_bytes == sum(len(p) for _, p in transformer_groups(TOY))  # flags only
    hsdp_rows = [r for r in rows if r["ours"].layout == "hsdp"]
    # HSDP shards inside a node: per-rank sizes do not depend on the node count
    assert len({r["ours"].shard_elems for r in hsdp_rows}) == 1
    assert len({r["fsdp2"].shard_elems for r in hsdp_rows}) == 1
    assert hsdp_rows[0]["fsdp2"].ar_s == 0.0  # one node: no replicas
    assert 0 < hsdp_rows[1]["fsdp2"].ar_s < hsdp_rows[2]["fsdp2"].ar_s
    # the cross-replica all-reduce carries one fp32 gradient shard per group
    f = hsdp_rows[2]["fsdp2"]
    assert f.ar_bytes == f.shard_elems * nm.REDUCE_BYTES
    assert f.rs_bytes == f.shard_elems * f.shard_ranks * nm.REDUCE_BYTES


def test_model_report_is_labelled_a_model(capsys):
    nm.main(["--nodes", "8", "16"])
    out = capsys.readouterr().out
    assert out.startswith("MODEL, not a measurement")
    assert "450 GB/s" in out and "50 GB/s" in out and "10 us" in out
    assert out.count("full sharding") >= 2 and out.count("HSDP") >= 2
    nm.main(["--nodes", "8", "--markdown", "--fsdp2-keeps-last-block"])
    assert "| layout |" in capsys.readouterr().out


def test_bench_counts_by_group_and_pairs_agree():
    cfg = dict(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
    res = hsdp.run(4, cfg, batch=2, steps=1, warmup=1, runs=1, timeout=600)
    pairs = res["pairs"]
    assert set(pairs) == {f"{e}/{lay}" for e in hsdp.ENGINES for lay in hsdp.LAYOUTS}
    n_tensors = len(list(GPT(GPTConfig(**cfg)).parameters()))  # tied head: counted once
    for key, p in pairs.items():
        engine, layout = key.split("/")
        b = p["bytes"]
        assert p["ranks_agree"], key
        assert p["median_step_s"] > 0 and p["steps_timed"] == 1
        assert not any(k.endswith("/other") for k in b), (key, b)
        rs = b["reduce_scatter/shard"]
        assert rs >= 4 * res["nparams"]  # fp32 gradients, plus padding
        assert b["all_gather/shard"] > rs  # everything once, the resharded blocks twice
        ar = b.get("all_reduce/replicate", 0)
        flags = 0
        if engine == "vescale":  # one byte per parameter, once over all data-parallel ranks
            flags = n_tensors
            if layout == "full":
                assert b["all_reduce/shard"] == n_tensors, (key, b)
            else:  # one all-reduce over the flattened (replicate x shard) group of 4
                assert "all_reduce/shard" not in b, (key, b)
        sent = p["sent"]  # ring bytes per rank: (n-1)/n of the buffer, all-reduce twice that
        m = 4 if layout == "full" else 2
        assert sum(v for k, v in sent.items() if k.endswith("/shard")) == pytest.approx(
            (m - 1) / m * (b["all_gather/shard"] + rs + 2 * b.get("all_reduce/shard", 0)))
        if layout == "full":
            assert ar == 0 and "all_reduce/replicate" not in p["calls"], (key, b)
        else:
            # 2 * (2-1)/2 of the gradient shard, 2 * (4-1)/4 of the flags
            assert sent["all_reduce/replicate"] == pytest.approx(ar - flags + 1.5 * flags)
            # the cross-replica all-reduce: one gradient shard = the reduce-scatter buffer / 2
            assert ar - flags == rs // 2, (key, b)
    ref = pairs["fsdp2/full"]["losses"]
    for key, p in pairs.items():
        assert p["losses"] == pytest.approx(ref, rel=1e-5), key
    text = hsdp.report(res)
    assert "full: step time vescale / fsdp2" in text and "hsdp: step time" in text


def test_quantized_model_halves_the_bytes_of_fsdp2_bf16():
    """CommPolicy(int8 all-gather, bf16 gradients) in the network model (issue 25): one byte
    plus a scale per 256 elements for quantized tensors, bf16 elsewhere and for gradients."""
    net = nm.Network()
    qn = nm.quantized_numel(TOY)
    groups = transformer_groups(TOY, "block")
    assert qn == [sum(math.prod(s) for _, s in p if len(s) >= 2 and math.prod(s) >= 4096)
                  for _, p in groups]
    for layout in nm.LAYOUTS:
        sizes = nm.group_sizes(TOY, 8 if layout == "hsdp" else 16)
        q = nm.model_step_quantized(layout, 2, sizes, qn, net)
        o = nm.model_step("ours", layout, 2, sizes, net)
        assert q.rs_bytes == o.rs_bytes // 2  # bf16 instead of fp32 gradients
        assert 0.5 < q.ag_bytes / o.ag_bytes < 0.55  # int8 + scales vs bf16, small tensors bf16
        assert q.comm_s < o.comm_s


@pytest.mark.slow  # plans LLaMA-3-70B (~5 s)
def test_quantized_report_names_zeropp_as_published(capsys):
    nm.main(["--nodes", "8", "--quantized", "--markdown"])
    out = capsys.readouterr().out
    assert "ours int8 comm (ms)" in out and "ZeRO++ (published, not modelled)" in out
