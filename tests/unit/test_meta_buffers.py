"""``fsdp.materialize`` and buffers (design note [meta-buffers]): a buffer built on a real
device keeps its value, one built on meta is recomputed by ``reset_parameters()`` or a Hugging
Face model's ``_init_weights``, and a non-persistent one nothing recomputes is named in a
warning instead of silently holding garbage."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_vescale.fsdp import materialize


class WithBuffers(nn.Module):
    def __init__(self, reset: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._reset = reset
        self.register_buffer("freq", torch.arange(4.0) + 1, persistent=False)
        self.register_buffer("stats", torch.ones(4))

    def reset_parameters(self) -> None:
        if self._reset:
            self.freq = torch.arange(4.0, device=self.lin.weight.device) + 1


def test_real_buffers_survive_materialize():
    model = WithBuffers(reset=False)
    model.lin.to_empty(device="meta")  # parameters on meta, buffers real
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize(model, "cpu")
    assert torch.equal(model.freq, torch.arange(4.0) + 1)
    assert torch.equal(model.stats, torch.ones(4))


def test_meta_buffer_recomputed_by_reset_parameters():
    with torch.device("meta"):
        model = WithBuffers(reset=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize(model, "cpu", init_params=False)
    assert torch.equal(model.freq, torch.arange(4.0) + 1)


def test_meta_buffer_nothing_recomputes_is_named():
    with torch.device("meta"):
        model = WithBuffers(reset=False)
    with pytest.warns(UserWarning, match=r"\['freq'\].*reset_parameters\(\)"):
        materialize(model, "cpu")
    assert model.freq.isnan().all()  # NaN, not plausible garbage


def test_hf_rotary_inv_freq_recomputed():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    ref = LlamaForCausalLM(cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize(model, "cpu", init_params=False)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq,
                               rtol=0, atol=0)
