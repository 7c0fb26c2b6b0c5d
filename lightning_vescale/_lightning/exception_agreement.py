"""Agreeing out of band that every rank is handling an exception (design note [failures]).

While a Trainer handles an exception, its ``on_exception`` hooks may start a collective (a
checkpoint save). If only this rank failed, its peers are blocked in another collective and the
save would wait for them until the process-group timeout. :class:`ExceptionAgreement` lets the
strategy enter such a collective only after every rank has said, through the default group's
TCP store, that it is handling an exception too (the rest of the note is in ``strategy.py``).
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

__all__ = ["EXCEPTION_AGREEMENT_WINDOW", "ExceptionAgreement", "all_ranks_arrive"]

#: Upper bound on how long a rank handling an exception waits for its peers before a collective
#: checkpoint save; the process-group ``timeout`` bounds it too. Read at each agreement (tests
#: shorten it).
EXCEPTION_AGREEMENT_WINDOW = timedelta(seconds=15)


def all_ranks_arrive(key: str, world_size: int, window: timedelta) -> bool:
    """Whether all ``world_size`` ranks reach ``key`` within ``window``: one answer for all.

    Out of band (the default group's TCP store, not a collective), so it cannot pair with a
    collective a healthy peer is blocked in. Each rank counts itself in at ``key``. The first
    rank that sees every rank counted, or whose window runs out, records the decision at
    ``key/decision`` with an atomic ``compare_set``; every rank returns that one decision, so a
    rank that arrives after another gave up does not enter the collective alone. A store that is
    gone (its host rank died) counts as "not all ranks".
    """
    decision_key = f"{key}/decision"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.add(key, 1)
        deadline = time.monotonic() + window.total_seconds()
        while True:
            if store.check([decision_key]):
                return store.get(decision_key) == b"all"
            if store.add(key, 0) >= world_size:
                return store.compare_set(decision_key, "", "all") == b"all"
            if time.monotonic() >= deadline:
                return store.compare_set(decision_key, "", "missing") == b"all"
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - an unreachable store means a peer process is gone
        return False


class ExceptionAgreement:
    """One strategy's agreement state: a key per run, the decision cached for that run."""

    def __init__(self) -> None:
        self._runs = 0
        self._all_in_exception: Optional[bool] = None

    def new_run(self) -> None:
        """A new fit/validate/...: a fresh store key, no decision yet."""
        self._runs += 1
        self._all_in_exception = None

    def check(self, what: str, *, rank: int, timeout: Optional[timedelta]) -> None:
        """Return if every rank is handling an exception too; else raise, naming ``what``.

        Call only while this rank handles an exception. ``timeout`` is the process group's.
        """
        if not dist.is_available() or not dist.is_initialized():
            return
        world = dist.get_world_size()
        if world == 1 or self._all_in_exception:
            return
        if self._all_in_exception is None:
            window = min(timeout or EXCEPTION_AGREEMENT_WINDOW, EXCEPTION_AGREEMENT_WINDOW)
            self._all_in_exception = all_ranks_arrive(
                f"lightning_vescale/exception/{self._runs}", world, window)
        if not self._all_in_exception:
            original = sys.exc_info()[1]
            cause = f" ({type(original).__name__}: {original})" if original is not None else ""
            raise RuntimeError(
                f"Rank {rank} is handling an exception{cause} but the other ranks are "
                f"not, so the collective `{what}` (e.g. a checkpoint save from an `on_exception` "
                "hook such as OnExceptionCheckpoint) cannot run: it would wait for them until the "
                "process-group timeout. Nothing was written; any previous checkpoint is untouched. "
                "Fix the original error shown above."
            )
