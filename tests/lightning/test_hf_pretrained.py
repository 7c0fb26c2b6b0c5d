"""``pretrained_weights=`` of both strategies (issue 27): a Hugging Face Llama built on the meta
device in ``configure_model`` / ``init_module(empty_init=True)`` starts from the checkpoint, with
``transformers``' own logits (the rotary ``inv_freq`` recomputed), before any optimizer exists;
the key prefix the module holds the HF model under is found; bad arguments fail at construction;
the example's ``SaveHFWeights`` writes what ``from_pretrained`` reads."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from examples.hf_finetune import HFFinetune, SaveHFWeights, write_tiny_random_llama  # noqa: E402
from lightning_vescale import VeScaleFabricStrategy, VeScaleFSDPStrategy  # noqa: E402
from lightning_vescale._lightning.pretrained import find_prefix  # noqa: E402

X = torch.arange(24).reshape(2, 12) % 256


def _reference_logits(directory):
    from transformers import LlamaForCausalLM

    with torch.no_grad():
        return LlamaForCausalLM.from_pretrained(directory)(X).logits


class _RecordAtStart(Callback):
    """Each rank's logits on ``X`` when fit starts, and whether an optimizer existed at load."""

    def __init__(self, out_dir) -> None:
        self.out_dir = out_dir

    def on_fit_start(self, trainer, pl_module) -> None:
        with torch.no_grad():
            logits = pl_module(X)
        torch.save(logits, os.path.join(self.out_dir, f"logits{trainer.global_rank}.pt"))


@pytest.mark.parametrize("devices", [1, 2])
def test_trainer_starts_from_pretrained_weights(tmp_path, devices):
    src = write_tiny_random_llama(str(tmp_path / "src"))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False,
                         strategy=VeScaleFSDPStrategy(pretrained_weights=src,
                                                      start_method="fork"),
                         callbacks=[_RecordAtStart(str(tmp_path)),
                                    SaveHFWeights(str(tmp_path / "out"))])
    data = torch.utils.data.DataLoader(X.repeat(devices, 1), batch_size=2)
    trainer.fit(HFFinetune(src, lr=1e-2), data)
    ref = _reference_logits(src)
    for r in range(devices):
        torch.testing.assert_close(torch.load(tmp_path / f"logits{r}.pt"), ref, rtol=0, atol=0)
    from transformers import LlamaForCausalLM

    trained = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert not torch.equal(trained(X).logits, ref), "the saved weights are the trained ones"


class _Holder(torch.nn.Module):
    """Holds the HF model as ``model`` (keys ``model.model.layers...``), as LightningModules do."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor):
        return self.model(x)


def _fabric_body(src: str, prefix_module: bool):
    from lightning.fabric import Fabric
    from transformers import LlamaConfig, LlamaForCausalLM

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy(pretrained_weights=src))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        llama = LlamaForCausalLM(LlamaConfig.from_pretrained(src))
        module = _Holder(llama) if prefix_module else llama
    assert next(llama.parameters()).is_meta
    module = fabric.setup_module(module)
    with torch.no_grad():
        return module(X).logits


@pytest.mark.parametrize("prefix_module", [False, True], ids=["bare", "under-model"])
def test_fabric_setup_module_loads_pretrained(worlds, tmp_path, prefix_module):
    src = write_tiny_random_llama(str(tmp_path / "src"))
    ref = _reference_logits(src)
    for logits in worlds(2).run(_fabric_body, src, prefix_module):
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)


def test_find_prefix():
    module = ["model.model.embed.weight", "model.lm_head.weight", "head.weight"]
    assert find_prefix(module, ["model.embed.weight", "lm_head.weight"]) == ("model.", 2)
    assert find_prefix(module, ["head.weight"]) == ("", 1)  # shortest on a tie
    assert find_prefix(module, ["nothing"]) == ("", 0)


@pytest.mark.parametrize("cls", [VeScaleFSDPStrategy, VeScaleFabricStrategy])
def test_bad_pretrained_weights_argument(cls):
    with pytest.raises(TypeError, match="pretrained_weights must be a path"):
        cls(pretrained_weights=3)


@pytest.mark.parametrize("cls", [VeScaleFSDPStrategy, VeScaleFabricStrategy])
def test_pretrained_weights_are_checked_at_construction(cls, tmp_path):
    """Issue 34: a missing path or a FIFO passed construction and failed after every rank had
    started (93 s). Everything that does not need the model is checked in the constructor."""
    from safetensors.torch import save_file

    with pytest.raises(ValueError, match=r"pretrained_weights='.*nope'.*does not exist"):
        cls(pretrained_weights=tmp_path / "nope")
    os.mkfifo(tmp_path / "w.safetensors")  # opening it must not wait for a writer
    with pytest.raises(ValueError, match=r"pretrained_weights=.*w\.safetensors.*a FIFO"):
        cls(pretrained_weights=tmp_path / "w.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"neither model\.safetensors nor"):
        cls(pretrained_weights=tmp_path / "empty")
    (tmp_path / "bad.safetensors").write_bytes(b"\x04" + b"\0" * 7 + b"[1] ")
    with pytest.raises(ValueError, match=r"bad\.safetensors.*not an object"):
        cls(pretrained_weights=str(tmp_path / "bad.safetensors"))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "good.safetensors"))
    cls(pretrained_weights=tmp_path / "good.safetensors")  # a valid one passes


def test_a_checkpoint_of_another_model_is_named(tmp_path):
    from safetensors.torch import save_file

    from lightning_vescale._lightning.pretrained import load_pretrained

    save_file({"encoder.weight": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"none of its 1 tensors.*Linear.*'encoder\.weight'"):
        load_pretrained(torch.nn.Linear(2, 2), tmp_path / "other.safetensors", strict=True)


def _count_linear_inits(monkeypatch) -> list[int]:
    """Count ``nn.Linear.reset_parameters`` calls on real memory (the default init of a meta
    model's Linears at materialisation; those of construction on meta cost nothing)."""
    calls = [0]
    original = torch.nn.Linear.reset_parameters

    def counted(self):
        calls[0] += not self.weight.is_meta
        return original(self)

    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", counted)
    return calls


def _fabric_inits_body(src: str) -> tuple[int, torch.Tensor]:
    from lightning.fabric import Fabric
    from transformers import LlamaConfig, LlamaForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        calls = _count_linear_inits(mp)
        fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                        strategy=VeScaleFabricStrategy(pretrained_weights=src))
        fabric.launch()
        with fabric.init_module(empty_init=True):
            llama = LlamaForCausalLM(LlamaConfig.from_pretrained(src))
        module = fabric.setup_module(llama)
        with torch.no_grad():
            return calls[0], module(X).logits


def test_a_strict_load_skips_the_random_init(worlds, tmp_path):
    """Design note [pretrained-weights]: every parameter is loaded, so a meta model's parameters
    are allocated without running ``reset_parameters()`` first (was: every Linear initialised,
    then overwritten); the logits are still exactly transformers'."""
    src = write_tiny_random_llama(str(tmp_path / "src"))
    ref = _reference_logits(src)
    for calls, logits in worlds(2).run(_fabric_inits_body, src):
        assert calls == 0
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)


class _NonStrict(HFFinetune):
    strict_loading = False


def _non_strict_body(src: str, dropped: str):
    """A Trainer in this forked rank (world 1; a Trainer in the test process itself would leave
    its process group and MASTER_PORT to the next tests)."""
    with pytest.MonkeyPatch.context() as mp:
        calls = _count_linear_inits(mp)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=0, logger=False,
                             enable_checkpointing=False, enable_model_summary=False,
                             enable_progress_bar=False,
                             strategy=VeScaleFSDPStrategy(pretrained_weights=src))
        module = _NonStrict(src)
        trainer.fit(module, torch.utils.data.DataLoader(X, batch_size=2))
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in module.model.state_dict().items()}
    return calls[0], state[dropped], state["model.layers.1.mlp.down_proj.weight"]


def test_a_non_strict_load_initialises_what_the_checkpoint_lacks(worlds, tmp_path):
    """A checkpoint without one Linear's weight, loaded non-strictly: that weight gets the model's
    own init (``reset_parameters``), not uninitialised memory; the rest is the checkpoint's."""
    from safetensors.torch import load_file, save_file

    src = write_tiny_random_llama(str(tmp_path / "src"))
    dropped = "model.layers.0.mlp.down_proj.weight"
    weights = load_file(os.path.join(src, "model.safetensors"))
    kept = {k: v for k, v in weights.items() if k != dropped}
    save_file(kept, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    [(calls, w, loaded)] = worlds(1).run(_non_strict_body, src, dropped)
    assert calls > 0
    torch.testing.assert_close(loaded, weights["model.layers.1.mlp.down_proj.weight"])
    bound = 1 / w.shape[1] ** 0.5  # nn.Linear's kaiming_uniform_(a=sqrt(5)) bound
    assert torch.isfinite(w).all() and 0 < w.abs().max() <= bound


def _write_family(name: str, directory: str) -> None:
    """A tiny Mixtral (experts stacked in the model, one tensor per expert on disk) or Gemma
    (``embed_scale``: a non-persistent buffer of a module with a weight) from save_pretrained."""
    import transformers as T

    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = {"mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**common,
                                                                      num_local_experts=4)),
             "gemma": lambda: T.GemmaForCausalLM(T.GemmaConfig(**common, head_dim=8))}[name]
    torch.manual_seed(0)
    model().save_pretrained(directory, max_shard_size="60KB")


class _RecordAtEnd(Callback):
    """Rank 0's logits on ``X`` when fit ends (before ``SaveHFWeights`` writes the weights)."""

    def __init__(self, out_dir) -> None:
        self.out_dir = out_dir

    def on_fit_end(self, trainer, pl_module) -> None:
        pl_module.eval()
        with torch.no_grad():
            logits = pl_module(X)
        if trainer.global_rank == 0:
            torch.save(logits, os.path.join(self.out_dir, "end.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "gemma"])
def test_trainer_pretrained_weights_families(tmp_path, name):
    """``Trainer(strategy=VeScaleFSDPStrategy(pretrained_weights=...))`` at 2 ranks, 20 steps,
    model built on meta in ``configure_model``: it starts at ``from_pretrained``'s logits (was:
    Mixtral refused, Gemma NaN on transformers >= 5.5), trains to finite losses, and
    ``SaveHFWeights`` writes what ``from_pretrained`` reads back with the in-training logits.
    (Equality with one process / DDP: tests/distributed/test_hf_families.py.)"""
    from transformers import AutoModelForCausalLM

    src = str(tmp_path / "src")
    _write_family(name, src)
    steps, seq = 20, 12
    base = torch.randint(3, 256, (4 * steps, seq), generator=torch.Generator().manual_seed(1))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False,
                         strategy=VeScaleFSDPStrategy(pretrained_weights=src,
                                                      start_method="fork"),
                         callbacks=[_RecordAtStart(str(tmp_path)), _RecordAtEnd(str(tmp_path)),
                                    SaveHFWeights(str(tmp_path / "out"))])
    trainer.fit(HFFinetune(src, lr=1e-2), torch.utils.data.DataLoader(base, batch_size=2))
    with torch.no_grad():
        start = AutoModelForCausalLM.from_pretrained(src)(X).logits
    for r in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"logits{r}.pt"), start, rtol=0, atol=0)
    end = torch.load(tmp_path / "end.pt")
    assert torch.isfinite(end).all() and not torch.equal(end, start)
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(trained(X).logits, end, rtol=0, atol=0)
