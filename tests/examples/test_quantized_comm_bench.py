"""Smoke test of ``benchmarks/quantized_comm.py`` at toy sizes (structure, never timings)."""

from __future__ import annotations

import pytest

from benchmarks import quantized_comm as qc


@pytest.mark.slow  # three forked worlds and a codec pass (~10 s)
def test_every_measurement_runs_at_toy_size(tmp_path):
    table = qc.run_steps(2, dict(n_layer=1, n_embd=64, n_head=2, block_size=16), 2, 1, 1)
    assert all(name in table for name in qc.ENGINES)
    assert "(0.2" in table  # the int8 rows' all-gather ratio (0.2x)
    assert "| int8 |" in qc.run_codec(mib=1, repeats=1)
    png = tmp_path / "curves.png"
    out = qc.run_parity(dict(n_layer=1, n_embd=64, n_head=2, block_size=16), [0], 3, 2, 1e-3,
                        str(png))
    assert "| mean |" in out and png.exists()
