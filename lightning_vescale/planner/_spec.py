"""A group's tensors as the planner reads them: :class:`TensorSpec` and input normalisation.

:func:`~lightning_vescale.planner.plan_layout` and the baselines take ``TensorSpec`` records or
plain ``(name, shape)`` / ``(name, shape, granularity)`` tuples. This module validates them once
and resolves every granularity to elements (:mod:`lightning_vescale.planner._granularity`), so
the search only ever sees integers. The planner's contract is ``ValueError`` for any bad input,
naming the tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from lightning_vescale.planner._granularity import (
    Granularity,
    check_granularity,
    resolve_granularity,
)

__all__ = ["TensorSpec", "check_count", "resolve_entries", "resolve_entry"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a group: ``name``, ``shape`` and optional ``granularity``.

    ``granularity`` is any form :func:`~lightning_vescale.planner.check_granularity` accepts
    (elements as an ``int >= 1``, ``"element"``, ``"row"``, ``"<k>rows"``); ``None`` takes the
    ``granularity`` given to :func:`~lightning_vescale.planner.plan_layout`. In a
    :class:`~lightning_vescale.planner.LayoutPlan` it is resolved to elements.
    """

    name: str
    shape: tuple[int, ...]
    granularity: Granularity | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TensorSpec name must be a non-empty str, got name={self.name!r}")
        try:
            raw = tuple(self.shape)
        except TypeError as exc:
            raise ValueError(
                f"TensorSpec {self.name!r}: shape must be a sequence of ints, got "
                f"shape={self.shape!r}"
            ) from exc
        if not all(type(d) is int and d >= 0 for d in raw):  # slow path: int-likes, errors
            if not all(
                hasattr(d, "__index__") and not isinstance(d, bool) and d.__index__() >= 0
                for d in raw
            ):
                raise ValueError(
                    f"TensorSpec {self.name!r}: shape must hold non-negative ints, got "
                    f"shape={self.shape!r}"
                )
            raw = tuple(d.__index__() for d in raw)
        object.__setattr__(self, "shape", raw)
        if self.granularity is not None:
            try:
                check_granularity(self.granularity)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"TensorSpec {self.name!r}: {exc}") from None

    @classmethod
    def _trusted(cls, name: str, shape: tuple[int, ...], granularity: int) -> TensorSpec:
        # Internal: build an already-validated spec without re-validating (planning speed).
        spec = object.__new__(cls)
        object.__setattr__(spec, "name", name)
        object.__setattr__(spec, "shape", shape)
        object.__setattr__(spec, "granularity", granularity)
        return spec

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)


def resolve_entry(index: int, item: object, default: Granularity | None) -> TensorSpec:
    """``tensors[index]`` as a ``TensorSpec`` whose granularity is in elements.

    ``default`` (already validated by the caller) applies when the entry gives no granularity.
    """
    if isinstance(item, TensorSpec):
        spec = item
    elif isinstance(item, tuple) and len(item) in (2, 3):
        spec = TensorSpec(*item)
    else:
        raise ValueError(
            f"tensors[{index}]={item!r} must be a TensorSpec or a tuple (name, shape) / "
            "(name, shape, granularity)."
        )
    gran = spec.granularity if spec.granularity is not None else default
    if type(gran) is int and gran >= 1:  # fast path: already in elements
        g = gran
    else:
        try:
            g = resolve_granularity(gran, spec.shape)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tensor {spec.name!r}: {exc}") from None
    return TensorSpec._trusted(spec.name, spec.shape, g)


def resolve_entries(tensors: Iterable, default: Granularity | None) -> list[TensorSpec]:
    """Every entry of ``tensors`` resolved (:func:`resolve_entry`); names must be unique."""
    try:
        check_granularity(default)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"plan_layout: {exc}") from None
    out: list[TensorSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(tensors):
        spec = resolve_entry(i, item, default)
        if spec.name in seen:
            raise ValueError(f"tensor name {spec.name!r} appears twice; names must be unique.")
        seen.add(spec.name)
        out.append(spec)
    if not out:
        raise ValueError("tensors is empty; a sharding group needs at least one tensor.")
    return out


def check_count(name: str, value: object, minimum: int) -> int:
    """``value`` when it is an ``int >= minimum`` (not a bool), else a ``ValueError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {name}={value!r}")
    return value
