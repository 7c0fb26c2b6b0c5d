"""Shard a Hugging Face ``transformers`` model with ``strategy="vescale_fsdp"`` (optional).

    pip install transformers
    python examples/hf_transformers.py                  # 2 CPU processes (or every GPU)
    python examples/hf_transformers.py --steps 50 --layers 4

The model is built from a config (``LlamaConfig`` -> ``LlamaForCausalLM``): no download, random
weights. Nothing in the model needs to change: its decoder layers live in an ``nn.ModuleList``
(``model.model.layers``), so each layer becomes a sharding group by default; naming them instead
is ``sharding_units=["LlamaDecoderLayer"]``. Needs ``transformers`` (not a dependency of this
package); without it the script says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import transformers
except ImportError:  # pragma: no cover - depends on the environment
    transformers = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import lightning as L  # noqa: E402

import lightning_vescale  # noqa: E402,F401  (registers strategy="vescale_fsdp")
from lightning_vescale import VeScaleFSDPStrategy  # noqa: E402


class HFCausalLM(L.LightningModule):
    """Any ``AutoModelForCausalLM``-style model: ``model(input_ids=..., labels=...).loss``."""

    def __init__(self, layers: int = 2, hidden: int = 64, vocab: int = 256, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, tie_word_embeddings=False)
        self.model = transformers.LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def main(argv: list[str] | None = None) -> float:
    if transformers is None:
        raise SystemExit("examples/hf_transformers.py needs the transformers package: "
                         "pip install transformers")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    L.seed_everything(0, verbose=False)
    model = HFCausalLM(layers=args.layers)
    tokens = torch.randint(0, model.hparams.vocab, (512, 65),
                           generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(
        strategy=VeScaleFSDPStrategy(sharding_units=["LlamaDecoderLayer"]),
        devices="auto" if torch.cuda.is_available() else 2, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    trainer.fit(model, torch.utils.data.DataLoader(tokens, batch_size=8, shuffle=True))
    loss = float(trainer.callback_metrics["train_loss"])
    if trainer.is_global_zero:
        print(f"transformers {transformers.__version__} LlamaForCausalLM: {trainer.world_size} "
              f"ranks, {trainer.global_step} steps, loss {loss:.4f}")
    return loss


if __name__ == "__main__":
    main()
