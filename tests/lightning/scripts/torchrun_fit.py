"""A tiny fit under torchrun (processes created externally: TorchElasticEnvironment).

    torchrun --nproc_per_node 2 tests/lightning/scripts/torchrun_fit.py OUT_DIR
Writes OUT_DIR/torchrun_rank<r>.pt with the rank's losses; rank 0 prints "OK <world size>".
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

import lightning_vescale  # noqa: E402,F401  (registers strategy="vescale_fsdp")
from tests.lightning._lit import TinyGPT, dataloader, trainer  # noqa: E402


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    t = trainer("vescale_fsdp", devices=2, max_steps=2)
    t.fit(TinyGPT(out_dir=out_dir, tag="torchrun"), dataloader())
    assert type(t.strategy.cluster_environment).__name__ == "TorchElasticEnvironment"
    if t.is_global_zero:
        print(f"OK {t.world_size}")


if __name__ == "__main__":
    main(sys.argv[1])
