"""The Trainer's ``fork``/``spawn`` launcher for sharded models (``strategy="vescale_fsdp_fork"``).

Lightning's multiprocessing launcher hands rank 0's ``lightning_module.state_dict()`` back to the
main process: with sharded parameters those are ``DTensor`` shards that cannot be loaded into the
(unsharded) main-process model. This launcher gathers *full* tensors instead.

Design note [saved-after-launch]
--------------------------------
After a fork/spawn ``fit`` the launching process holds rank 0's trained weights and nothing else:
the optimizer states and the loop progress (epoch, global step) lived in the workers, which have
exited. ``trainer.save_checkpoint()`` there can only write the weights, so rather than guess the
rest the strategy saves them, warns (:func:`warn_saved_after_launch`) and marks the file with
:data:`SAVED_AFTER_LAUNCH_KEY` (the start method); resuming ``fit`` from a file with that mark and
no optimizer state raises :func:`saved_after_launch_error`, which says what the file lacks and
why, instead of Lightning's ``ModelCheckpoint.save_weights_only`` ``KeyError``. Loading such a file
for ``validate``/``test``/``predict`` works as for any weights-only checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module
from typing_extensions import override

from lightning_vescale._lightning.requested_load import record_weights_only
from lightning_vescale._lightning.sharding import has_meta, reshard_all
from lightning_vescale.checkpoint import model_state
from lightning_vescale.checkpoint._sharded import read_side_file

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["VeScaleMultiProcessingLauncher", "SAVED_AFTER_LAUNCH_KEY", "in_launching_process",
           "warn_saved_after_launch", "saved_after_launch", "saved_after_launch_error"]

#: the checkpoint key that marks a file saved in the launching process (design note
#: [saved-after-launch]); its value is the start method (``"fork"``/``"spawn"``)
SAVED_AFTER_LAUNCH_KEY = "vescale_saved_after_launch"


def in_launching_process(launcher: Any) -> bool:
    """Whether this is the process that started fork/spawn workers (not a worker: no group)."""
    return isinstance(launcher, _MultiProcessingLauncher) and not (
        dist.is_available() and dist.is_initialized())


def warn_saved_after_launch(checkpoint: dict[str, Any], filepath: Any,
                            start_method: str) -> None:
    """Warn that ``checkpoint`` holds only the weights, and mark it (see [saved-after-launch])."""
    checkpoint[SAVED_AFTER_LAUNCH_KEY] = start_method
    rank_zero_warn(
        f"trainer.save_checkpoint({str(filepath)!r}) runs in the launching process after a "
        f"fork/spawn fit (start_method={start_method!r}), which holds only the model weights the "
        "workers returned: the checkpoint has no optimizer states, and the epoch/global step of "
        "this process, not the workers'. It loads for validate/test/predict or as initial "
        "weights, but cannot resume fit. For a resumable checkpoint save during fit "
        "(ModelCheckpoint, or trainer.save_checkpoint in a callback's on_train_end), or use "
        "start_method='popen'.")


def saved_after_launch(path: Any) -> Optional[str]:
    """The start method a sharded checkpoint directory was marked with, or ``None``."""
    try:
        return read_side_file(Path(path)).get(SAVED_AFTER_LAUNCH_KEY)
    except Exception:  # noqa: BLE001 - an unreadable side file is reported by the load itself
        return None


def saved_after_launch_error(path: Any, start_method: str) -> RuntimeError:
    """The error for resuming ``fit`` from a file marked by :func:`warn_saved_after_launch`."""
    return RuntimeError(
        f"Cannot resume fit from {str(path)!r}: this checkpoint was saved in the launching "
        f"process after a fork/spawn fit and holds only model weights (start_method="
        f"{start_method!r}); the optimizer states and the loop progress stayed in the worker processes, "
        "which had exited. Use it with trainer.validate/test/predict(ckpt_path=...) or load its "
        "'state_dict' as initial weights of a new fit, or resume from a checkpoint saved during "
        "fit (ModelCheckpoint, or trainer.save_checkpoint in a callback's on_train_end).")


class VeScaleMultiProcessingLauncher(_MultiProcessingLauncher):
    """``fork``/``spawn`` launcher that sends rank 0's *full* weights back to the main process
    and records the entry point's ``weights_only`` ([requested-weights-only])."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        record_weights_only(self._strategy, function, args, kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)

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
