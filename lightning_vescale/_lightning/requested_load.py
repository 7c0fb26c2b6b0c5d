"""The ``weights_only`` the user passed to ``fit``/``validate``/``test``/``predict``.

Design note [requested-weights-only]
------------------------------------
Lightning 2.6 hands ``trainer.fit(..., ckpt_path=..., weights_only=False)``'s ``weights_only``
to ``Strategy.load_checkpoint`` only when the strategy restores *before* setup; a strategy that
restores after setup (ours: the module must be sharded first) gets ``None``
(``trainer.py``: ``_restore_modules_and_callbacks(ckpt_path)``), so the README's trust opt-out
silently did nothing through the Trainer. Every Trainer entry point goes through
``strategy.launcher.launch(trainer_fn, *args, ...)`` when the strategy has a launcher, with
``weights_only`` among the arguments; so the strategy always has one:

* the script launcher and the fork/spawn launcher record the argument and launch as before;
* where the processes were started outside (torchrun, SLURM), :class:`DirectLauncher` records it
  and calls the function in place, which is what Lightning does with no launcher.

``load_checkpoint`` uses the recorded value when Lightning passes ``None``. A fork/spawn worker
sees it too: the strategy is copied (fork) or pickled (spawn) after the recording.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from lightning.fabric.strategies.launchers.launcher import _Launcher
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

__all__ = ["DirectLauncher", "RecordingScriptLauncher", "record_weights_only"]


def record_weights_only(strategy: Any, function: Callable, args: tuple, kwargs: dict) -> None:
    """Store on ``strategy`` the ``weights_only`` that ``function(*args, **kwargs)`` receives
    (``None`` where it takes none or it was not given)."""
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
        value: Optional[bool] = bound.arguments.get("weights_only")
    except (TypeError, ValueError):
        value = None
    strategy._requested_weights_only = value


class RecordingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher (re-runs the script per rank) that records ``weights_only``."""

    def __init__(self, strategy: Any, *args: Any) -> None:
        super().__init__(*args)
        self._vescale_strategy = strategy

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        record_weights_only(self._vescale_strategy, function, args, kwargs)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class DirectLauncher(_Launcher):
    """For processes started outside (torchrun, SLURM, or the ranks > 0 that the script launcher
    re-ran): records ``weights_only`` and runs the Trainer function in this process.

    Like Lightning's script launcher on such a rank, it first gives the process its share of the
    CPUs (``OMP_NUM_THREADS`` and ``torch.set_num_threads``, unless the user exported
    ``OMP_NUM_THREADS``): without it every rank but 0 ran with all cores, oversubscribing the
    machine (steps 2.5-33x slower than DDP) and computing with other float results than DDP."""

    def __init__(self, strategy: Any) -> None:
        self._vescale_strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        record_weights_only(self._vescale_strategy, function, args, kwargs)
        _set_num_threads_if_needed(num_processes=self._vescale_strategy.num_processes)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher started no process."""
