"""The strategies' ``comm_policy`` argument (issue 25): checked in the constructor, made per-group.

Both strategies give one :class:`~lightning_vescale.CommPolicy` to every ``fully_shard`` call
they make (each unit, then the root). Two things differ from a hand-written ``fully_shard``:

* ``block_size=None`` becomes the strategy's ``optimizer_block_size`` (256 by default), so the
  all-gather's blocks are ``AdamW8bit``'s blocks and the strategy's granularity policy already
  aligns large tensors to them;
* a ``quantize`` dict is matched per group by name *or* ``fnmatch`` pattern
  (``{"*.qkv.weight": False}``), since its keys cannot name parameters relative to every group;
  a key that matches nothing in one group is not an error there.

A dict (``comm_policy: {all_gather: int8}`` in YAML) is accepted; mistakes fail at construction.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any, Optional

from torch import nn

from lightning_vescale.fsdp import CommPolicy
from lightning_vescale.fsdp._comm_policy import as_comm_policy

__all__ = ["NamePatternRule", "validate_comm_policy"]


@dataclasses.dataclass(frozen=True)
class NamePatternRule:
    """``(name, param) -> bool`` from a ``{name or pattern: bool}`` dict (exact names first,
    then the first matching pattern); ``None`` where nothing matches: the default rule."""

    rules: tuple[tuple[str, bool], ...]
    min_numel: int

    def __call__(self, name: str, param: nn.Parameter) -> bool:
        for key, value in self.rules:
            if key == name:
                return value
        for key, value in self.rules:
            if fnmatch.fnmatchcase(name, key):
                return value
        return (param.is_floating_point() and param.dim() >= 2
                and param.numel() >= self.min_numel)


def validate_comm_policy(comm_policy: Any, optimizer_block_size: Optional[int]
                         ) -> Optional[CommPolicy]:
    """The ``comm_policy`` argument as the policy every group gets (see the module docstring).

    Raises:
        TypeError, ValueError, RuntimeError: as :class:`CommPolicy` (the message names the field).
    """
    policy = as_comm_policy(comm_policy)
    if policy is None or not policy.is_active:
        return None
    if policy.block_size is None:
        policy = dataclasses.replace(policy, block_size=policy.resolved_block_size(
            optimizer_block_size))
    if isinstance(policy.quantize, Mapping):
        policy = dataclasses.replace(policy, quantize=NamePatternRule(
            tuple(policy.quantize.items()), policy.min_numel))
    return policy
