"""Fine-tune a Hugging Face model with ``strategy="vescale_fsdp"``: HF weights in, HF weights out.

On CPU (2 processes; a tiny random Llama written with ``save_pretrained`` next to ``--out``
first, standing in for a download)::

    python examples/hf_finetune.py                       # ~30 s
    python examples/hf_finetune.py --steps 20 --out /tmp/llama-ft

On GPUs, a real 1B-8B model (any ``AutoModelForCausalLM`` directory: ``config.json`` plus
``model.safetensors`` or ``model.safetensors.index.json`` and its shards; the tokenizer files for
``--data``)::

    python examples/hf_finetune.py --model /models/Llama-3.2-1B --devices 8 --precision bf16-mixed \\
        --seq 2048 --batch 4 --steps 1000 --lr 2e-5 --data corpus.txt --out out/llama-1b-ft
    python examples/hf_finetune.py --model /models/Llama-3.1-8B --devices 8 --precision bf16-mixed \\
        --seq 4096 --batch 1 --steps 1000 --lr 1e-5 --data corpus.txt --out out/llama-8b-ft \\
        --save-dtype bf16

(8B on 8x80 GB: bf16 compute with fp32 master weights and AdamW states, ~16 bytes per parameter
sharded over 8 ranks ≈ 16 GB per GPU plus activations; add ``--nodes N`` under SLURM/torchrun
for more.)

What happens:

1. ``configure_model`` builds the model from its ``config.json`` on the *meta* device: no
   memory, no host ever holds the full model.
2. ``VeScaleFSDPStrategy(pretrained_weights=--model)`` shards it (each decoder layer a group),
   materialises each rank's shards (the rotary ``inv_freq`` buffers are recomputed, design note
   [meta-buffers]) and loads the checkpoint: each rank reads only the byte ranges of its own
   shards (``lightning_vescale.checkpoint.load_safetensors``), before the optimizer is built.
3. Training as usual. At the end, :class:`SaveHFWeights` writes the model with
   ``save_safetensors`` (every rank writes its own ranges; no gather) plus ``config.json``, so
   ``AutoModelForCausalLM.from_pretrained(--out)`` loads the fine-tuned model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import lightning_vescale  # noqa: E402,F401  (registers strategy="vescale_fsdp")
from lightning_vescale import VeScaleFSDPStrategy  # noqa: E402
from lightning_vescale.checkpoint import save_safetensors  # noqa: E402

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class HFFinetune(L.LightningModule):
    """A causal LM from a Hugging Face directory, built on meta in ``configure_model``."""

    def __init__(self, model_dir: str, lr: float = 1e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is not None:
            return
        config = AutoConfig.from_pretrained(self.hparams.model_dir)
        with torch.device("meta"):  # weights come from pretrained_weights, shard by shard
            self.model = AutoModelForCausalLM.from_config(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class SaveHFWeights(Callback):
    """At the end of ``fit``: Hugging Face safetensors shards + index + ``config.json`` in
    ``directory`` (a collective: runs on every rank, each writing its own byte ranges)."""

    def __init__(self, directory: str, dtype: Optional[torch.dtype] = None) -> None:
        self.directory, self.dtype = directory, dtype

    def on_fit_end(self, trainer: L.Trainer, pl_module: HFFinetune) -> None:
        save_safetensors(pl_module.model, self.directory, dtype=self.dtype)
        if trainer.is_global_zero:
            pl_module.model.config.save_pretrained(self.directory)


def write_tiny_random_llama(directory: str, *, hidden: int = 64, layers: int = 2,
                            vocab: int = 256, seed: int = 0) -> str:
    """A random tiny Llama as ``save_pretrained`` writes it (the stand-in for a download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def token_data(model_dir: str, data: Optional[str], seq: int, n: int) -> torch.Tensor:
    """``n`` sequences of ``seq`` tokens: ``data`` tokenized by the model's tokenizer, or random
    tokens (seeded) without ``--data``."""
    from transformers import AutoConfig

    if data is None:
        vocab = AutoConfig.from_pretrained(model_dir).vocab_size
        return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(Path(data).read_text())["input_ids"]
    usable = len(ids) // seq * seq
    if usable == 0:
        raise SystemExit(f"--data {data} has {len(ids)} tokens, fewer than --seq {seq}")
    return torch.tensor(ids[:usable]).view(-1, seq)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a Hugging Face model directory (default: a tiny random "
                   "Llama, written next to --out as tiny_random_llama/ if it is not there)")
    p.add_argument("--out", default="out/hf_finetune", help="where the fine-tuned weights go")
    p.add_argument("--data", help="a text file (tokenized with the model's tokenizer); default: "
                   "random tokens")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--save-dtype", choices=sorted(_DTYPES), help="dtype of the saved weights "
                   "(default: the training dtype)")
    p.add_argument("--start-method", default="popen", choices=["popen", "fork", "spawn"])
    return p


def main(argv: Optional[list[str]] = None) -> str:
    args = build_parser().parse_args(argv)
    if args.model is None:  # written once, by the launching process (before the ranks start)
        args.model = str(Path(args.out).parent / "tiny_random_llama")
        if "LOCAL_RANK" not in os.environ and not Path(args.model, "config.json").exists():
            write_tiny_random_llama(args.model)
    n = args.steps * args.batch * args.devices * args.nodes
    loader = torch.utils.data.DataLoader(token_data(args.model, args.data, args.seq, n),
                                         batch_size=args.batch)
    strategy = VeScaleFSDPStrategy(pretrained_weights=args.model,
                                   start_method=args.start_method)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices,
                        num_nodes=args.nodes, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=False,
                        callbacks=[SaveHFWeights(args.out, _DTYPES.get(args.save_dtype))])
    trainer.fit(HFFinetune(args.model, lr=args.lr), loader)
    if trainer.is_global_zero:
        print(f"fine-tuned {args.steps} steps from {args.model}; "
              f"Hugging Face weights in {args.out}")
    return args.out


if __name__ == "__main__":
    main()
