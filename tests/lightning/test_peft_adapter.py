"""peft LoRA on a tiny transformers Llama at 2 ranks: ``save_peft_adapter`` (design note
[peft-adapter-save]) from the Trainer and from Fabric.

``PeftModel.save_pretrained()`` itself fails on a sharded model (``invalid python storage``) and
writes nothing. The Trainer runs (fork launcher) train the same module with the same data under
``vescale_fsdp_fork`` and ``ddp_fork``; DDP saves with peft's own ``save_pretrained``. Checked:
only the adapter tensors change, our adapter files equal DDP's, and
``PeftModel.from_pretrained`` on a fresh base model gives the trained model's logits.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_vescale.checkpoint import model_state
from lightning_vescale.checkpoint import save_peft_adapter

pytest.importorskip("peft")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from tests.lightning._lit import trainer  # noqa: E402

VOCAB, SEQ = 64, 8


def _base():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))


def _lora(base):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj"]))


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


class LoraLlama(pl.LightningModule):
    """A LoRA-wrapped tiny Llama; at the end of fit: the adapter (ours: ``save_peft_adapter``,
    DDP: peft's ``save_pretrained``) and rank 0's full state dict into ``out_dir/<tag>``."""

    def __init__(self, out_dir: str, tag: str) -> None:
        super().__init__()
        self.out_dir, self.tag = Path(out_dir), tag
        self.model = _lora(_base())

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.model(input_ids=x, labels=x).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def on_train_end(self) -> None:
        if self.tag == "ddp":  # the reference: peft's own save
            self.model.save_pretrained(str(self.out_dir / "ddp"),
                                       is_main_process=self.global_rank == 0)
        else:
            save_peft_adapter(self.model, self.out_dir / "ours")  # on every rank
        state = model_state(self.model, full=True)  # collective; {} on rank 1
        if self.global_rank == 0:
            torch.save(state, self.out_dir / f"{self.tag}_state.pt")


def _fit(out: Path, strategy: str, tag: str) -> None:
    pl.seed_everything(0, verbose=False)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens(16)), batch_size=2)
    trainer(strategy, max_steps=3).fit(LoraLlama(str(out), tag), data)


def _adapter_files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.mark.slow
def test_trainer_lora_adapter_equals_ddp_and_loads(tmp_path):
    from peft import PeftModel

    _fit(tmp_path, "vescale_fsdp_fork", "ours")
    _fit(tmp_path, "ddp_fork", "ddp")
    initial = _lora(_base()).state_dict()
    trained = torch.load(tmp_path / "ours_state.pt")
    assert trained.keys() == initial.keys()
    changed = {k for k in initial if not torch.equal(initial[k], trained[k])}
    adapters = {k for k in initial if "lora_" in k}
    assert changed and changed <= adapters, sorted(changed - adapters)  # only adapters train
    assert any(".lora_B." in k for k in changed)  # B starts at zero: training reached it

    ours, ddp = _adapter_files(tmp_path / "ours"), _adapter_files(tmp_path / "ddp")
    assert ours.keys() == ddp.keys() and len(ours) == len(adapters)
    for k in ours:  # the same sums in the same order as DDP: bitwise
        assert torch.equal(ours[k], ddp[k]), (k, (ours[k] - ddp[k]).abs().max())
    assert (tmp_path / "ours" / "adapter_config.json").read_text() == \
        (tmp_path / "ddp" / "adapter_config.json").read_text()

    x = _tokens(2, seed=5)
    reference = _lora(_base())
    reference.load_state_dict(trained)
    loaded = PeftModel.from_pretrained(_base(), str(tmp_path / "ours"))
    torch.testing.assert_close(_logits(loaded, x), _logits(reference, x), rtol=0, atol=0)


def _fabric_lora_run(out: str):
    from lightning.fabric import Fabric
    from peft import PeftModel

    from lightning_vescale import VeScaleFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy())
    fabric.launch()
    peft_model = _lora(_base())
    model = fabric.setup_module(peft_model)
    with pytest.raises(RuntimeError, match="invalid python storage"):  # why the call exists
        peft_model.save_pretrained(f"{out}/direct_rank{dist.get_rank()}")
    opt = fabric.setup_optimizers(torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-2))
    xs = _tokens(4 * dist.get_world_size(), seed=2).view(4, dist.get_world_size(), 1, SEQ)
    for x in xs:
        fabric.backward(model(input_ids=x[dist.get_rank()], labels=x[dist.get_rank()]).loss)
        opt.step()
        opt.zero_grad()
    save_peft_adapter(model, f"{out}/fabric")  # Fabric's wrapper: the PeftModel inside
    state = model_state(model.module, full=True)
    if dist.get_rank() != 0:
        return None
    x = _tokens(2, seed=5)
    reference = _lora(_base())
    reference.load_state_dict(state)
    loaded = PeftModel.from_pretrained(_base(), f"{out}/fabric")
    return _logits(loaded, x), _logits(reference, x)


@pytest.mark.slow
def test_fabric_lora_adapter_loads(worlds, tmp_path):
    loaded, reference = worlds(2).run(_fabric_lora_run, str(tmp_path))[0]
    torch.testing.assert_close(loaded, reference, rtol=0, atol=0)
    assert not (tmp_path / "direct_rank0" / "adapter_model.safetensors").exists()


def test_one_process_writes_what_save_pretrained_writes(tmp_path):
    """No process group, plain model: the same files as peft's own call; user errors."""
    model = _lora(_base())
    model.save_pretrained(str(tmp_path / "peft"))
    holder = torch.nn.ModuleDict({"model": model})
    save_peft_adapter(holder, tmp_path / "ours")  # found inside the holder
    ours, theirs = _adapter_files(tmp_path / "ours"), _adapter_files(tmp_path / "peft")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    with pytest.raises(TypeError, match="state_dict="):
        save_peft_adapter(model, tmp_path / "x", state_dict={})
    with pytest.raises(ValueError, match="holds 0"):
        save_peft_adapter(torch.nn.Linear(2, 2), tmp_path / "x")
    with pytest.raises(ValueError, match="'nope'"):
        save_peft_adapter(model, tmp_path / "x", selected_adapters=["nope"])
