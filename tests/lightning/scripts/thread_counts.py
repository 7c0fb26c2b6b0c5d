"""Record every rank's CPU thread settings under a Trainer or Fabric launch.

    python tests/lightning/scripts/thread_counts.py {trainer|fabric|both} OUT_DIR STRATEGY [...]

Each STRATEGY (a Trainer/Fabric strategy name: ``vescale_fsdp``, ``ddp``, ``vescale_fsdp_fork``,
``ddp_spawn``, ...) is launched in turn at 2 ranks; inside the launched function (the Trainer's
``fit``, or the function given to ``Fabric.launch``) each rank writes
``OUT_DIR/<api>_<strategy>_rank<r>.json`` with ``torch.get_num_threads()`` and the
``OMP_NUM_THREADS`` it sees (``both``: the Trainer, then Fabric). The subprocess-script
launcher re-runs this script per rank, and a launch leaves ``OMP_NUM_THREADS`` set in the
process that ran it, so a ``vescale_fsdp``/``ddp`` run must be the only one of its invocation;
fork/spawn ones can share one (each worker is a new process). Under torchrun pass one STRATEGY
(``both`` is fine there: torchrun exports ``OMP_NUM_THREADS`` before any launch).
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402

import lightning_vescale  # noqa: E402,F401  (registers strategy="vescale_fsdp" and variants)


def _record(out_dir: str, api: str, strategy: str, rank: int) -> None:
    state = {"torch_threads": torch.get_num_threads(),
             "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    (Path(out_dir) / f"{api}_{strategy}_rank{rank}.json").write_text(json.dumps(state))


class Recorder(pl.LightningModule):
    """One linear layer, one step; records the thread settings when the fit starts."""

    def __init__(self, out_dir: str, strategy: str) -> None:
        super().__init__()
        self.out_dir, self.strategy_name = out_dir, strategy
        self.layer = torch.nn.Linear(4, 4)

    def on_fit_start(self) -> None:
        _record(self.out_dir, "trainer", self.strategy_name, self.global_rank)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run_trainer(out_dir: str, strategy: str) -> None:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                       batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Recorder(out_dir, strategy), data)


def _fabric_main(fabric: Fabric, out_dir: str, strategy: str) -> None:
    _record(out_dir, "fabric", strategy, fabric.global_rank)
    fabric.barrier()


def run_fabric(out_dir: str, strategy: str) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch(_fabric_main, out_dir, strategy)


if __name__ == "__main__":
    api, out, *strategies = sys.argv[1:]
    for name in strategies:
        if api in ("trainer", "both"):
            run_trainer(out, name)
        if api in ("fabric", "both"):
            run_fabric(out, name)
