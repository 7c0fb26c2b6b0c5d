"""Vocabulary shared by the engine's modules: the training state and "is a backward running".

Design note [fsdp-training-state]
---------------------------------
Where a module's state and a parameter group are in the iteration is one enum each (as FSDP2's
``TrainingState``), not a set of booleans that must be kept consistent by hand:

* ``FSDPState.training_state``: ``FORWARD`` from the outermost pre-forward to its post-forward,
  ``PRE_BACKWARD`` once a gradient reached the module's outputs in this backward (its
  pre-backward hook ran; it runs once per backward), ``IDLE`` otherwise.
* ``ParamGroup.training_state``: ``PRE_BACKWARD`` once the group was unsharded for backward,
  ``POST_BACKWARD`` once its backward is complete (resharded; reduce-scatter issued if needed),
  ``IDLE`` otherwise. The backward prefetch skips groups that are not ``IDLE``.

Both go back to ``IDLE`` at the end of every backward (the root's final callback) and at the
root's pre-forward (so a backward that raised leaves nothing behind).
"""

from __future__ import annotations

from enum import Enum, auto

import torch

__all__ = ["TrainingState", "in_backward"]


class TrainingState(Enum):
    """Where a module state or a parameter group is in the iteration (see the design note)."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread."""
    return torch._C._current_graph_task_id() != -1
