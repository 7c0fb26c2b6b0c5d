"""``fsdp.materialize`` and buffers (design note [meta-buffers]): a buffer built on a real
device keeps its value, one built on meta is recomputed by ``reset_parameters()`` or a Hugging
Face model's ``_init_weights`` whatever its owner holds (through a throwaway copy: no parameter
is touched, no random number drawn), integer buffers included, and a non-persistent one nothing
recomputes is an error naming it instead of silently holding garbage (issue 33)."""

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


def test_meta_buffer_nothing_recomputes_is_an_error():
    with torch.device("meta"):
        model = WithBuffers(reset=False)
    with pytest.raises(RuntimeError, match=r"\['freq'\].*reset_parameters\(\)"):
        materialize(model, "cpu")
    assert model.freq.isnan().all()  # NaN, not plausible garbage


class OwnsParamsAndBuffers(nn.Module):
    """Like Gemma's scaled embedding / Bert's embeddings: parameters and non-persistent buffers
    (one integer) in the same module, recomputed by its ``reset_parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("scale", torch.tensor(2.0), persistent=False)
        self.register_buffer("ids", torch.arange(5).expand(1, -1), persistent=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        self.scale.fill_(2.0)
        self.ids.copy_(torch.arange(5).expand(1, -1))


@pytest.mark.parametrize("init_params", [False, True])
def test_owner_with_parameters_recomputed_without_touching_them(init_params):
    """The buffers are recomputed, the parameters and the RNG stream are left alone (was: an owner
    with parameters was skipped: NaN scale, uninitialised integer ids)."""
    with torch.device("meta"):
        model = OwnsParamsAndBuffers()
    materialize(model, "cpu", init_params=init_params)
    with torch.no_grad():
        model.weight.fill_(7.0)  # "loaded"
    state = torch.get_rng_state()
    with torch.device("meta"):
        again = OwnsParamsAndBuffers()
    materialize(again, "cpu", init_params=False)
    assert torch.equal(torch.get_rng_state(), state), "no random number drawn"
    assert torch.equal(model.weight, torch.full((3, 4), 7.0))
    for m in (model, again):
        assert torch.equal(m.scale, torch.tensor(2.0))
        assert torch.equal(m.ids, torch.arange(5).expand(1, -1))


def test_integer_buffer_nothing_recomputes_is_zero_and_named():
    class IntBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("ids", torch.arange(512), persistent=False)

    with torch.device("meta"):
        model = IntBuffer()
    with pytest.raises(RuntimeError, match=r"\['ids'\]"):
        materialize(model, "cpu", init_params=False)
    assert torch.equal(model.ids, torch.zeros(512, dtype=torch.long)), "never uninitialised"


@pytest.mark.parametrize("family", ["gemma", "gemma2", "bert"])
def test_hf_buffers_of_owners_with_parameters(family):
    """Gemma's ``embed_scale`` (transformers >= 5.5: a buffer of the embedding, which has a
    weight) and Bert's integer ``position_ids``/``token_type_ids`` equal a normally built
    model's after ``materialize(init_params=False)`` (was: NaN and uninitialised memory)."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2)
    cls, cfg = {
        "gemma": (transformers.GemmaForCausalLM,
                  transformers.GemmaConfig(**small, num_key_value_heads=1, head_dim=8)),
        "gemma2": (transformers.Gemma2ForCausalLM,
                   transformers.Gemma2Config(**small, num_key_value_heads=1, head_dim=8)),
        "bert": (transformers.BertForMaskedLM,
                 transformers.BertConfig(**small, max_position_embeddings=600)),
    }[family]
    ref = cls(cfg)
    with torch.device("meta"):
        model = cls(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize(model, "cpu", init_params=False)
    ref_buffers = dict(ref.named_buffers())
    assert ref_buffers
    for name, b in model.named_buffers():
        assert torch.equal(b, ref_buffers[name]), name


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
