"""The Trainer snippets of the README and the docs, runnable as they are shown (``tests/examples``
checks that their code blocks are verbatim excerpts of this file and runs it).

    python examples/trainer_usage.py          # every GPU of this machine, or its CPU

``devices`` and ``accelerator`` are left to Lightning (``"auto"``): every GPU of the machine, or
one CPU process here. Each Trainer trains the example GPT for a few steps.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the examples package

from examples.train_gpt import CharDataModule, GPTModule  # noqa: E402


def main() -> None:
    # Every example writes under ./out/ (git-ignored): Lightning's logs and checkpoints of the
    # Trainers below too (a Trainer argument given in PL_TRAINER_<NAME> is its default; the
    # snippets of the README and the docs stay the lines a user writes).
    os.environ.setdefault("PL_TRAINER_DEFAULT_ROOT_DIR", "out")

    # -- README and docs: the first lines -----------------------------------------------------
    import lightning as L
    import lightning_vescale  # registers the "vescale_fsdp" strategy

    trainer = L.Trainer(strategy="vescale_fsdp", precision="bf16-mixed", max_steps=10)
    trainer.fit(GPTModule(), CharDataModule())

    # -- docs/guides/trainer.md ---------------------------------------------------------------
    from lightning_vescale import VeScaleFSDPStrategy

    strategy = VeScaleFSDPStrategy(
        sharding_units=["Block"],      # classes (or class names) that become sharding groups
        granularity=None,              # element-wise; tensors of 4096+ elements align to
                                       # optimizer_block_size (or: an int, "row", "<k>rows")
        optimizer_block_size=256,      # AdamW8bit's block: no quantization block straddles ranks
        reshard_after_forward=True,    # ZeRO-3; False keeps parameters gathered until backward
        state_dict_type="sharded",     # or "full": one file from rank 0, loadable without us
        device_mesh=None,              # or (replicas, shard_size): HSDP, e.g. (nodes, gpus)
    )
    trainer = L.Trainer(strategy=strategy, precision="bf16-mixed", max_steps=10)
    trainer.fit(GPTModule(), CharDataModule())

    # -- docs/guides/memory-profiling.md ------------------------------------------------------
    from lightning_vescale import MemoryProfiler

    trainer = L.Trainer(strategy="vescale_fsdp", max_steps=10,
                        callbacks=[MemoryProfiler(plot_dir="out/memory")])  # out/memory/*.png
    trainer.fit(GPTModule(), CharDataModule())

    assert lightning_vescale.__version__ and trainer.global_step == 10


if __name__ == "__main__":
    main()
