"""The Trainer's ``fork``/``spawn`` launcher for sharded models (``strategy="vescale_fsdp_fork"``).

Lightning's multiprocessing launcher hands rank 0's ``lightning_module.state_dict()`` back to the
main process: with sharded parameters those are ``DTensor`` shards that cannot be loaded into the
(unsharded) main-process model. This launcher gathers *full* tensors instead.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn import Module
from typing_extensions import override

from lightning_vescale._lightning.sharding import has_meta, reshard_all
from lightning_vescale.checkpoint import model_state

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["VeScaleMultiProcessingLauncher"]


class VeScaleMultiProcessingLauncher(_MultiProcessingLauncher):
    """``fork``/``spawn`` launcher that sends rank 0's *full* weights back to the main process."""

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer",
                                   results: Any) -> Optional[_WorkerOutput]:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        reshard_all(trainer.strategy.model)
        state_dict = model_state(trainer.lightning_module, full=True)  # collective
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput,
                                         trainer: "pl.Trainer") -> None:
        if trainer.checkpoint_callback and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = str(worker_output.best_model_path)
        if worker_output.weights_path is not None:
            state = torch.load(worker_output.weights_path, map_location="cpu", weights_only=True)
            module = trainer.lightning_module
            if has_meta(module):
                # `assign=True` installs one tensor per key, which would untie tied parameters
                # (an embedding shared with the output head): tie them again afterwards.
                aliases = _alias_groups(module)
                module.load_state_dict(state, strict=False, assign=True)
                _retie(module, aliases)
            else:
                module.load_state_dict(state, strict=False)
            Path(worker_output.weights_path).unlink(missing_ok=True)
        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)


def _alias_groups(module: Module) -> list[list[str]]:
    """Qualified names of each parameter registered under more than one name (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(module: Module, groups: list[list[str]]) -> None:
    """Register the first name's parameter under every other name of its group."""
    for first, *others in groups:
        param = module.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._parameters[attr] = param
