"""An opt-in check that every rank runs the same group's collective (a debugging aid).

Design note [fsdp-collective-check]
-----------------------------------
Every rank must run every group's forward and backward, in the same order: the all-gathers and
reduce-scatters of the ranks pair up by position only. A group that runs on some ranks and not
on others (a data-dependent branch: ``if x.sum() > 0: h = self.expert(h)``) makes the ranks
exchange each other's wrong buffers (silently when the sizes agree) and then wait for a
collective the others never issue: after the process group's timeout a bare error names no
module (FSDP2 behaves the same).

With ``LIGHTNING_VESCALE_CHECK_COLLECTIVES=1`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, torch's
switch for collective checks) every all-gather and reduce-scatter of a group, and the
end-of-backward gradient-flag all-reduce, is preceded by one all-gather of three integers over
the group's shard group: what the rank is about to run (kind), which group (its index in the
root's tree) and how many collectives that group ran before. The checks pair up exactly as the
collectives would, so at the first divergence every rank sees the others' entries and raises a
``RuntimeError`` naming the group (its module's FQN) and the ranks that skipped it, instead of
waiting. Off by default: it adds one small synchronous collective per collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["ENV", "check_collective", "enabled"]

ENV = "LIGHTNING_VESCALE_CHECK_COLLECTIVES"

KINDS = ("all-gather", "reduce-scatter", "gradient-flag all-reduce")


def enabled() -> bool:
    """Whether the check is on (read at every call, so a test or a debugger may flip it)."""
    return os.environ.get(ENV, "0") not in ("", "0") or \
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"


def check_collective(kind: str, index: int, count: int, *, group: dist.ProcessGroup,
                     device: torch.device, name_of: Callable[[int], str]) -> None:
    """Raise unless every rank of ``group`` is about to run the same collective.

    Args:
        kind: one of :data:`KINDS`.
        index: the sharding group's index in the root's tree (``-1``: none, the flag
            all-reduce).
        count: how many collectives that group ran before this one on this rank.
        group: the process group the collective runs on.
        device: where the collective's tensors live (the backend's device).
        name_of: a group index -> its module's FQN.
    """
    size = dist.get_world_size(group)
    if size == 1:
        return
    mine = torch.tensor([KINDS.index(kind), index, count], dtype=torch.int64, device=device)
    out = torch.empty(size * 3, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine, group=group)
    entries = [tuple(e) for e in out.view(size, 3).tolist()]
    if len(set(entries)) == 1:
        return
    ranks = dist.get_process_group_ranks(group)

    def what(e: tuple[int, ...]) -> str:
        target = f" of {name_of(e[1])!r}" if e[1] >= 0 else ""
        return f"{KINDS[e[0]]}{target} (its collective #{e[2]})"

    first = min(entries, key=lambda e: (e[1] < 0, e[1], e[2]))
    skipped = [r for r, e in zip(ranks, entries) if e != first]
    ran = [r for r, e in zip(ranks, entries) if e == first]
    at = "; ".join(f"rank {r}: {what(e)}" for r, e in zip(ranks, entries))
    target = repr(name_of(first[1])) if first[1] >= 0 else "the gradient-flag all-reduce"
    raise RuntimeError(
        f"fully_shard: the ranks do not run the same collective ({at}). Ranks {skipped} "
        f"skipped {target}, which ranks {ran} ran: a sharding group must run its forward and "
        "backward on every rank, in the same order (a data-dependent branch around a "
        "fully_shard module cannot be sharded; run the module on an empty batch instead). "
        f"Design note [fsdp-collective-check]; unset {ENV} to skip this check.")
