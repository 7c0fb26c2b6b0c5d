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
``RuntimeError`` naming the groups (their modules' FQNs) and the ranks at each, instead of
waiting. It says which ranks skipped a group only where the entries prove it (ranks at the
end-of-backward all-reduce went without the group the others are about to run); between two
groups it names both: the ranks may run both in another order, and a group's index in the tree
says nothing about when it runs (a branch may call a module registered after the next one).
Off by default: it adds one small synchronous collective per collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ENV", "check_collective", "enabled"]

ENV = "LIGHTNING_VESCALE_CHECK_COLLECTIVES"

KINDS = ("all-gather", "reduce-scatter", "gradient-flag all-reduce")


def _encoded(key: str) -> Any:
    encode = getattr(os.environ, "encodekey", None)
    return None if encode is None else encode(key)


#: the two variables as ``os.environ`` stores them (bytes on POSIX), for the fast path below
_KEYS = (_encoded(ENV), _encoded("TORCH_DISTRIBUTED_DEBUG"))


def enabled() -> bool:
    """Whether the check is on (read at every call, so a test or a debugger may flip it).

    Several hooks per group and step ask: when neither variable is set (the usual case) two
    lookups in ``os.environ``'s own mapping answer, without ``os.environ.get``'s encoding."""
    data = getattr(os.environ, "_data", None)
    if type(data) is dict and None not in _KEYS and _KEYS[0] not in data \
            and _KEYS[1] not in data:
        return False
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
    raise RuntimeError(_divergence_message(entries, dist.get_process_group_ranks(group),
                                           name_of))


def _divergence_message(entries: list[tuple[int, ...]], ranks: list[int],
                        name_of: Callable[[int], str]) -> str:
    """The error for ranks about to run different collectives (``entries[i]``: rank
    ``ranks[i]``'s ``(kind, index, count)``).

    Only what the entries prove is said: a rank at the gradient-flag all-reduce has finished its
    backward, so the groups the others are about to run are ones it went without. Between two
    groups, which one the other ranks skipped cannot be told at this point (the ranks may run
    both in another order, or one on some ranks only): both are named, with the ranks at each.
    The groups' indices (registration order) say nothing about the order they run in.
    """
    def what(e: tuple[int, ...]) -> str:
        target = f" of {name_of(e[1])!r}" if e[1] >= 0 else ""
        return f"{KINDS[e[0]]}{target} (its collective #{e[2]})"

    at = "; ".join(f"rank {r}: {what(e)}" for r, e in zip(ranks, entries))
    by_entry: dict[tuple[int, ...], list[int]] = {}
    for r, e in zip(ranks, entries):
        by_entry.setdefault(e, []).append(r)
    groups = [e for e in by_entry if e[1] >= 0]
    names = list(dict.fromkeys(repr(name_of(e[1])) for e in groups))
    done = [r for e, rs in by_entry.items() if e[1] < 0 for r in rs]
    if done:
        running = [r for e, rs in by_entry.items() if e[1] >= 0 for r in rs]
        verdict = (f"Ranks {done} finished their backward (at the gradient-flag all-reduce) "
                   f"without {' and '.join(names)}, which ranks {running} are about to run")
    elif len(names) == 1:  # one group, different collectives of it
        where = ", ".join(f"ranks {rs} at its {what(e)}" for e, rs in by_entry.items())
        verdict = f"The ranks run {names[0]} a different number of times ({where})"
    else:
        where = ", ".join(f"ranks {rs} at {name_of(e[1])!r}" for e, rs in by_entry.items())
        verdict = (f"One of {' and '.join(names)} runs on some ranks only, or the ranks run "
                   f"them in different orders ({where}; which rank went without which group "
                   "cannot be told before a rank reaches the other group)")
    return (
        f"fully_shard: the ranks do not run the same collective ({at}). {verdict}: a sharding "
        "group must run its forward and backward on every rank, in the same order (a "
        "data-dependent branch around a fully_shard module cannot be sharded; run the module "
        "on an empty batch instead). "
        f"Design note [fsdp-collective-check]; unset {ENV} to skip this check.")
