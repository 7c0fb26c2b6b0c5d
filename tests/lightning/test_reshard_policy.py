"""The one ``reshard_after_forward`` rule in Trainer and Fabric runs: all-gathers per step.

With the strategies' default (``reshard_after_forward=None``: :class:`ReshardPolicy` "auto") the
root keeps its parameters after forward and so does the last group of the recorded forward
order (its backward comes first), as with ``fully_shard``'s own default. TinyGPT has two blocks
and the root, one trainable DBuffer each: a step all-gathers root + block 0 + block 1 in forward
and block 0 again in backward = 4 (5 when the last block is resharded after forward, as with an
explicit ``reshard_after_forward=True``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_vescale._gloo_exchange import unfused
from lightning_vescale import VeScaleFSDPStrategy
from lightning_vescale.testing import CopyCommCounter
from tests.lightning._lit import TinyGPT, dataloader, trainer

_GATHER_OPS = ("c10d._allgather_base_", "c10d.allgather_", "c10d.allgather_into_tensor_coalesced_")


def _gathers(counter: CopyCommCounter) -> int:
    return sum(n for op, n in counter.by_op.items() if op in _GATHER_OPS)


class CountGathers(Callback):
    """Counts the all-gathers of each training step (forward, backward, optimizer step)."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.per_step: list[int] = []
        self._counter: CopyCommCounter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._counter = CopyCommCounter()
        self._counter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        assert self._counter is not None
        self._counter.__exit__(None, None, None)
        self.per_step.append(_gathers(self._counter))

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save(self.per_step, Path(self.out_dir) / f"gathers_rank{trainer.global_rank}.pt")


def _trainer_gathers(tmp_path: Path, **strategy_kwargs) -> list[list[int]]:
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    strategy = VeScaleFSDPStrategy(start_method="fork", **strategy_kwargs)
    t = trainer(strategy, max_steps=3, callbacks=[CountGathers(str(tmp_path))])
    with unfused():  # each all-gather counted as issued (the ranks fork inside: they inherit it)
        t.fit(TinyGPT(), dataloader())
    return [torch.load(tmp_path / f"gathers_rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize(("kwargs", "per_step"), [
    ({}, 4),  # the default: "auto", the last block keeps its parameters into backward
    ({"reshard_after_forward": None}, 4),
    ({"reshard_after_forward": True}, 5),  # the user chose: every block reshards
    ({"reshard_after_forward": False}, 3),  # nothing is gathered twice
])
def test_trainer_all_gathers_per_step(tmp_path, kwargs, per_step):
    for rank_counts in _trainer_gathers(tmp_path, **kwargs):
        # the first step records the forward order: the last group is known from step 2 on
        assert rank_counts[1:] == [per_step] * 2, rank_counts
