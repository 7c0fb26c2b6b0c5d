"""``ReshardPolicy``: what a group does with its gathered parameters after forward, decided once.

Design note [fsdp-reshard-policy]
---------------------------------
``reshard_after_forward`` (``fully_shard``'s, the strategies', a YAML config's) is mapped to a
:class:`ReshardPolicy` by one function, :func:`reshard_policy`, which is also the one place that
says which values fit; everything else reads the policy:

* ``None`` -> ``auto`` (FSDP2's default, and the strategies'): every group reshards after
  forward except the root (backward needs it first) and the last group of the recorded forward
  order when a backward follows (its backward comes right after the forward, so it keeps its
  parameters: one all-gather less per step, what torchtitan does by hand with
  ``reshard_after_forward=False`` on the last block). The last group is known from the second
  iteration on (the first one records the order). On gloo with CPU tensors, the groups just
  before the last one whose gathered bytes together fit one fused exchange (1 MiB) keep theirs
  too: there each all-gather is a rendezvous of every rank, which costs more than the memory
  (design note [fsdp-gloo-fusion], ``RootContext.keeps_into_backward``).
* ``True`` -> ``always``: every group reshards after forward, the root and the last group too.
* ``False`` (or ``1``) -> ``never``: parameters stay gathered until backward.
* an ``int`` ``k`` (``1 < k < shard size``, dividing it) -> ``to k ranks``: after forward keep
  the parameters sharded over groups of ``k`` ranks (FSDP2's int form), so backward all-gathers
  among ``k`` ranks only. ``k`` equal to the shard size is ``always``.

:meth:`ReshardPolicy.ranks_after_forward` turns a policy and the group's place in the
iteration into one number, the ranks the parameters stay sharded over (``1``: kept whole), which
is all ``ParamGroup.reshard_after_forward_now`` needs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

__all__ = ["ReshardPolicy", "reshard_policy"]

ReshardMode = Literal["auto", "always", "never", "partial"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReshardPolicy:
    """When a group frees its gathered parameters after forward (design note
    [fsdp-reshard-policy]). Build it with :func:`reshard_policy`.

    Args:
        mode: ``"auto"``, ``"always"``, ``"never"``, or ``"partial"`` (to ``ranks`` ranks).
        ranks: ``"partial"`` only: keep the parameters sharded over groups of this many ranks.
    """

    mode: ReshardMode = "auto"
    ranks: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "always", "never", "partial"):
            raise ValueError(f"ReshardPolicy(mode={self.mode!r}): expected 'auto', 'always', "
                             "'never' or 'partial'.")
        if (self.mode == "partial") != (self.ranks is not None):
            raise ValueError(f"ReshardPolicy(mode={self.mode!r}, ranks={self.ranks!r}): ranks "
                             "is given with mode='partial' only, and then required.")

    def ranks_after_forward(self, *, shard_size: int, is_root: bool,
                            is_last_in_forward: bool) -> int:
        """Over how many ranks the group's parameters stay sharded after its forward:
        ``shard_size`` reshards fully, ``1`` keeps them gathered, ``k`` reshards to ``k``.

        ``is_last_in_forward``: the group is the last of the recorded forward order (or, on
        gloo, in the small tail before it) and a backward follows (``auto`` keeps it gathered,
        as the root).
        """
        if self.mode == "always":
            return shard_size
        if self.mode == "never":
            return 1
        if self.mode == "partial":
            assert self.ranks is not None
            return self.ranks
        return 1 if is_root or is_last_in_forward else shard_size

    def to_arg(self) -> bool | int | None:
        """The ``reshard_after_forward`` value this policy came from (``None`` for ``auto``)."""
        return {"auto": None, "always": True, "never": False}.get(self.mode, self.ranks)


_FITS = ("None (auto: the root and the last group keep their parameters into backward), True "
         "(always reshard), False (keep them until backward) or an int k dividing the shard "
         "group size (reshard to groups of k ranks)")


def reshard_policy(value: Any, shard_size: int | None = None) -> ReshardPolicy:
    """The :class:`ReshardPolicy` for a ``reshard_after_forward`` value (None/bool/int, or a
    policy, returned as it is). With ``shard_size`` an int must divide it; without (a strategy's
    constructor, before any mesh exists) it must be at least 1.

    Raises:
        TypeError: not None, a bool, an int or a ReshardPolicy (e.g. the string ``"yes"``).
        ValueError: an int that does not fit the shard group.
    """
    if isinstance(value, ReshardPolicy):
        if value.ranks is not None and shard_size is not None:
            reshard_policy(value.ranks, shard_size)
        return value
    if value is None:
        return ReshardPolicy(mode="auto")
    if isinstance(value, bool):
        return ReshardPolicy(mode="always" if value else "never")
    if not isinstance(value, int):
        raise TypeError(f"reshard_after_forward={value!r} ({type(value).__name__}) is not "
                        f"supported; use {_FITS}.")
    if value < 1 or (shard_size is not None and (value > shard_size or shard_size % value)):
        where = f" {shard_size}" if shard_size is not None else ""
        raise ValueError(f"reshard_after_forward={value} does not fit the shard group "
                         f"size{where}: use {_FITS}.")
    if value == 1:
        return ReshardPolicy(mode="never")  # FSDP2 warns: one rank keeps everything
    if shard_size is not None and value == shard_size:
        return ReshardPolicy(mode="always")
    return ReshardPolicy(mode="partial", ranks=value)
