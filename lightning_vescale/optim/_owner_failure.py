"""Layer 4: a failure in owner-side work reaches every rank through the return collective.

Design note [owner-failure]
---------------------------
SOAP/Shampoo (split matrices, design note [distributed-soap]) and Muon ([distributed-muon]) move
a matrix to its owner rank with one all-to-all, compute there (``eigh``/QR, inverse roots,
Newton–Schulz) and move the result back with a second one. A rank that raised between the two
(``eigh`` failing on a non-finite factor, an out-of-memory, a check that fails on that rank's
data only) used to leave its peers blocked in the second all-to-all until the process-group
timeout, and one that raised in local work with no collective after it (SOAP's initialising
step sends nothing back) left them stepping on alone, to block in their next collective.

Now one :class:`StepFailures` per step records the *first* exception of this rank's owner-side
(and local matrix) work (:meth:`StepFailures.run`) instead of letting it escape; from then on
the rank skips that work but keeps joining every collective of the step, sending zeros. Every
return all-to-all carries **one marker element per destination** in front of that
destination's piece (0: fine, 1: this sender has failed in this step): the return payloads grow
by ``world`` elements and nothing else changes: no extra collective, and the markers are kept
on the device (a running maximum per sender). The payload values are untouched, so a step
without failure is bitwise the same as before. SOAP's initialising step, which returns no
update, sends the markers alone (``world`` elements, first step only). Local matrices are
stepped before the owned ones, so a failure there travels with the owned parameters'
exchanges.

At the end of the step (:meth:`StepFailures.raise_if_failed`) every rank reads the markers
once: **one device-to-host read per step** (not per parameter or bucket), and only for steps
that ran an owner exchange; a GPU step without failure pays that one synchronisation at its
end. If any sender failed, the ranks of the group exchange what failed with one
``all_gather_object`` (failure path only) and every rank raises the *same* ``RuntimeError``
naming the failing global rank(s), what they were computing (the parameter) and the original
error; on a failing rank it is chained (``raise ... from``) to the original. The step is then
incomplete (some parameters or states stepped, others not) on every rank: reload a checkpoint.

Not covered (no collective to carry a marker, by design): a failure on a rank whose step runs
no owner exchange at all (one process, every matrix whole under ``granularity="matrix"``, Muon
with no split matrix): the original exception is raised there alone, unchanged, as one in any
local code is, and its peers block in their next collective (the next forward's all-gather)
until the timeout. Under HSDP
the agreement is within the shard group; replicas compute on the same data, so they fail alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["StepFailures"]

T = TypeVar("T")


class StepFailures:
    """One optimizer step's owner-side failures (design note [owner-failure])."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.error: Exception | None = None
        self.where = ""
        self._markers: dict[Any, Tensor] = {}  # group -> max marker received per group rank

    @property
    def failed(self) -> bool:
        """Whether this rank's work has raised in this step."""
        return self.error is not None

    def run(self, where: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``; ``None`` (nothing run) once this rank has failed in this
        step. An ``Exception`` it raises is recorded with ``where`` (what it computed, for the
        message: "stepping parameter #0 of group 0") and ``None`` is returned."""
        if self.error is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank by raise_if_failed
            self.error, self.where = err, where
            return None

    def marker(self, like: Tensor) -> Tensor:
        """This rank's one-element marker, of ``like``'s dtype and device: 1 failed, 0 fine."""
        return like.new_full((1,), 1.0 if self.failed else 0.0)

    def with_markers(self, payload: Tensor, splits: Sequence[int]) -> tuple[Tensor, list[int]]:
        """``payload`` (cut ``splits`` per destination) with this rank's marker in front of each
        destination's piece, and the splits of the result (each one larger)."""
        mark, pieces, off = self.marker(payload), [], 0
        for n in splits:
            pieces += [mark, payload[off:off + n]]
            off += n
        return torch.cat(pieces), [n + 1 for n in splits]

    def strip_markers(self, recv: Tensor, splits: Sequence[int], group: Any) -> Tensor:
        """The payload of ``recv`` (received with :meth:`with_markers` from every rank of
        ``group``; ``splits``: the payload per source, without markers), its markers noted."""
        marks, pieces, off = [], [], 0
        for n in splits:
            marks.append(recv[off:off + 1])
            pieces.append(recv[off + 1:off + 1 + n])
            off += n + 1
        self.note(group, torch.cat(marks))
        return torch.cat(pieces)

    def note(self, group: Any, marks: Tensor) -> None:
        """Record the markers received from each rank of ``group`` (on the device)."""
        prev = self._markers.get(group)
        self._markers[group] = marks if prev is None else torch.maximum(prev, marks)

    def raise_if_failed(self) -> None:
        """Raise the step's failure on every rank that heard of it (see the design note);
        return if none did. One host read of the markers per group that exchanged any."""
        failed = [g for g, m in self._markers.items() if _marked(m)]
        if not failed:
            if self.error is not None:  # no exchange carried it: this rank's alone, unchanged
                raise self.error
            return
        reports: dict[int, str] = {}
        mine = self._report()
        for group in failed:  # the same groups, in the same order, on every rank of each
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, mine, group=group)
            reports.update(r for r in gathered if r is not None)
        if mine is not None:
            reports.setdefault(*mine)
        text = "; ".join(f"rank {r} failed {reports[r]}" for r in sorted(reports))
        err = RuntimeError(
            f"{self.who}: {text}. Every rank of the shard group raises this error (design note "
            "[owner-failure]); the step is incomplete on every rank: reload the parameters and "
            "optimizer states from a checkpoint before going on.")
        raise err from self.error

    def _report(self) -> tuple[int, str] | None:
        if self.error is None:
            return None
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        return rank, f"{self.where} ({type(self.error).__name__}: {self.error})"


def _marked(markers: Tensor) -> bool:
    """Whether any received marker is set. FakeTensor markers (the dry run,
    ``lightning_vescale.dryrun``: the fake process group carries no data) are never set; a
    failure on this rank still raises through ``error``."""
    if type(markers).__name__ == "FakeTensor":
        from torch._subclasses.fake_tensor import is_fake
        if is_fake(markers):
            return False
    return bool(markers.ne(0).any().item())
