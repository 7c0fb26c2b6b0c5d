"""``examples/moe.py`` trains with ``Trainer(strategy="vescale_fsdp")`` on CPU (2 processes, a few
steps, each optimizer), and its GPU config runs at toy size on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

import lightning_vescale  # noqa: F401
from tests.examples._probe import Probe, load

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "moe_8gpu.yaml"
TINY = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.num_nodes=1",
        "--trainer.precision=32-true", "--trainer.max_steps=3", "--model.n_layer=2",
        "--model.n_head=2", "--model.n_embd=32", "--model.block_size=16", "--model.n_expert=6",
        "--model.top_k=2", "--model.expert_ffn=16", "--data.block_size=16",
        "--data.batch_size=4", "--data.length=64", "--data.val_length=8",
        "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.strategy.init_args.start_method=fork"]


# ~2 s per optimizer here (fork launcher, in-process): not slow
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "muon"])
def test_moe_example_trains_on_cpu(tmp_path, optimizer):
    from examples.moe import main

    cli = main(args=["--config", str(CONFIG), *TINY, f"--model.optimizer={optimizer}"],
               run=False)
    cli.trainer.callbacks.append(Probe(str(tmp_path), "moe"))
    cli.trainer.fit(cli.model, cli.datamodule)
    for rank in load(tmp_path, "moe"):
        assert len(rank["losses"]) == 3 and all(x == x for x in rank["losses"])


def test_moe_example_writes_under_out(tmp_path, monkeypatch):
    """Run as the README shows (Lightning's logger and checkpoints on) from an empty directory:
    everything lands under ./out/, as for every example (it wrote ./lightning_logs/)."""
    from examples.moe import main

    monkeypatch.chdir(tmp_path)
    args = [a for a in TINY if not a.startswith(("--trainer.logger", "--trainer.enable_check"))]
    cli = main(args=["--config", str(CONFIG), *args, "--trainer.max_steps=1"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert {p.name for p in tmp_path.iterdir()} == {"out"}
    assert (tmp_path / "out" / "lightning_logs").is_dir()
