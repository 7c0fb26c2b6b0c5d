"""``checkpoint/_hf_convert.py`` (design note [hf-convert]): the runs of a tensor built by
``torch.stack`` / ``torch.cat`` of checkpoint tensors are exactly its elements, range by range;
a conversion that ``transformers`` declares for a model with an operation that is not stack/cat
(a transpose) falls back to the converter run on whole tensors; both load into the model and
save back as the checkpoint was."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_vescale.checkpoint._hf_convert import _Lazy, _Leaf, read_entry
from lightning_vescale.checkpoint._safetensors_format import TensorEntry


def _leaf(name: str, shape: tuple[int, ...], values: dict[str, torch.Tensor]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    values[name] = torch.arange(n, dtype=torch.float64) + 1000 * len(values)
    entry = TensorEntry(file=Path(name), name=name, dtype=torch.float64, shape=shape, begin=0,
                        end=8 * n)
    return _Lazy.wrap(torch.empty(shape, dtype=torch.float64, device="meta"), _Leaf(entry))


def test_runs_of_stack_then_cat_are_the_elements():
    """MoE: ``cat([stack(gates), stack(ups)], dim=1)`` (Mixtral/Qwen3-MoE's gate_up_proj)."""
    values: dict[str, torch.Tensor] = {}
    gates = [_leaf(f"g{e}", (3, 5), values) for e in range(4)]
    ups = [_leaf(f"u{e}", (3, 5), values) for e in range(4)]
    lazy = torch.cat([torch.stack(gates, dim=0), torch.stack(ups, dim=0)], dim=1)
    assert isinstance(lazy, _Lazy) and lazy.shape == (4, 6, 5)
    real = torch.cat([torch.stack([values[f"g{e}"].view(3, 5) for e in range(4)]),
                      torch.stack([values[f"u{e}"].view(3, 5) for e in range(4)])], dim=1)
    flat = real.reshape(-1)

    class _Entry:
        numel, dtype, node = flat.numel(), torch.float64, lazy.node

    def streams(entry):  # read_range on an in-memory "file" of that leaf's values
        import io

        return io.BytesIO(values[entry.name].numpy().tobytes())

    rng = random.Random(0)
    ranges = [(0, flat.numel())] + [sorted(rng.sample(range(flat.numel() + 1), 2))
                                    for _ in range(50)]
    for start, end in ranges:
        got = read_entry(streams, _Entry, start, end)  # type: ignore[arg-type]
        assert torch.equal(got, flat[start:end]), (start, end)


def test_other_operations_are_unsupported_on_lazy_tensors():
    from lightning_vescale.checkpoint._hf_convert import _Unsupported

    t = _leaf("w", (2, 3), {})
    with pytest.raises(_Unsupported):
        t.transpose(0, 1)
    assert t.shape == (2, 3) and t.size(1) == 3  # metadata still answers


def _tiny_model():
    """A ``transformers`` model whose declared conversion stacks per-expert tensors and
    transposes another (registered under its own model type)."""
    transformers = pytest.importorskip("transformers")
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )
    from transformers.core_model_loading import MergeModulelist, Transpose, WeightConverter

    class TinyConfig(transformers.PretrainedConfig):
        model_type = "vescale_tiny_convert"

    class TinyModel(transformers.PreTrainedModel):
        config_class = TinyConfig

        def __init__(self, config):
            super().__init__(config)
            self.experts = nn.Parameter(torch.randn(3, 4, 2))
            self.proj = nn.Linear(6, 4, bias=False)
            self.post_init()

        def _init_weights(self, module):
            pass

    if get_checkpoint_conversion_mapping("vescale_tiny_convert") is None:
        register_checkpoint_conversion_mapping("vescale_tiny_convert", [
            WeightConverter("experts.*.w", "experts", operations=[MergeModulelist(dim=0)]),
            WeightConverter("proj_t", "proj.weight", operations=[Transpose(0, 1)]),
        ])
    return TinyModel, TinyConfig


def test_declared_conversion_with_a_fallback_loads_and_saves(tmp_path):
    from safetensors.torch import load_file, save_file

    from lightning_vescale.checkpoint import checkpoint_keys, load_safetensors, save_safetensors

    model_cls, config_cls = _tiny_model()
    experts = [torch.randn(4, 2) for _ in range(3)]
    proj_t = torch.randn(6, 4)
    ckpt = {f"experts.{e}.w": experts[e] for e in range(3)} | {"proj_t": proj_t}
    save_file(ckpt, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = model_cls(config_cls())
    assert checkpoint_keys(tmp_path, model) == ["experts", "proj.weight"]
    assert load_safetensors(model, tmp_path) == ([], [])
    assert torch.equal(model.experts.data, torch.stack(experts))
    assert torch.equal(model.proj.weight.data, proj_t.T)
    save_safetensors(model, tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    # Stacked experts go back one per expert; a transpose is not a byte run: written as held.
    assert sorted(written) == ["experts.0.w", "experts.1.w", "experts.2.w", "proj.weight"]
    assert all(torch.equal(written[f"experts.{e}.w"], experts[e]) for e in range(3))
