"""The error every checkpoint load failure is reported as (design note [checkpoint-trust])."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["CheckpointLoadError", "CheckpointRefusedError"]


class CheckpointLoadError(RuntimeError):
    """A checkpoint file is missing, damaged, fails its checksum, or holds a refused object.

    In a distributed run the message starts with ``[rank r]``, the rank that found the problem
    (``rank`` defaults to this process's global rank).
    """

    def __init__(self, detail: str, *, rank: int | None = None) -> None:
        if rank is None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
        self.detail, self.rank = detail, rank
        super().__init__(detail if rank is None else f"[rank {rank}] {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        # DCP hands a rank's failure to the other ranks pickled; the default reduce re-runs
        # __init__ there, which would prefix the receiving rank too ("[rank 1] [rank 0] ...").
        return (_rebuild_load_error, (type(self), self.args), self.__dict__)


class CheckpointRefusedError(CheckpointLoadError):
    """The checkpoint holds an object that safe loading (``weights_only=True``) refuses to
    unpickle; ``weights_only=False`` loads it, for checkpoints from a source you trust."""


def _rebuild_load_error(cls: type[CheckpointLoadError], args: tuple[Any, ...]
                        ) -> CheckpointLoadError:
    """Unpickle a :class:`CheckpointLoadError` as it was raised (message and rank unchanged)."""
    err = cls.__new__(cls, *args)
    err.args = args
    return err
