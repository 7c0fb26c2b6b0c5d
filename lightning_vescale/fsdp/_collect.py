"""Which parameters one ``fully_shard`` call takes, checked, with their granularity resolved.

A group owns the parameters of its module that no inner group owns. A parameter registered
under several names (tied weights) is one parameter with several *owners* ``(module, attr)`` and
*aliases* (its names relative to the module); it must not be split across groups.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vescale.fsdp._param_group import Owner
from lightning_vescale.fsdp._state import get_state, states_in
from lightning_vescale.planner import resolve_granularity

__all__ = ["CollectedParam", "GranularityArg", "check_param", "collect_params",
           "resolve_granularities"]

#: The ``granularity`` argument of ``fully_shard``.
GranularityArg = Union[None, int, str, Mapping[str, Union[int, str]],
                       Callable[[str, nn.Parameter], Union[int, str]]]


class CollectedParam(NamedTuple):
    """One parameter a ``fully_shard`` call takes."""

    name: str  #: first name relative to the module (what ``named_parameters`` reports)
    param: nn.Parameter
    owners: list[Owner]  #: every ``(module, attr)`` that registers it
    aliases: list[str]  #: every name relative to the module, in owner order


def collect_params(module: nn.Module) -> list[CollectedParam]:
    """``module``'s parameters that no inner group owns, in ``named_parameters`` order.

    Raises:
        ValueError: a parameter is tied to a parameter of an inner group.
    """
    inner_ids: set[int] = set()
    for st in states_in(module):
        if st.group is not None:
            for mp in st.group.params:
                inner_ids.update((id(mp.sharded), id(mp.unsharded)))
                orig = mp.original_weakref() if mp.original_weakref is not None else None
                if orig is not None:  # still referenced elsewhere, e.g. by a tied head
                    inner_ids.add(id(orig))
    found: dict[int, CollectedParam] = {}
    seen_modules: set[int] = set()

    def visit(m: nn.Module, prefix: str) -> None:
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        for attr, p in m._parameters.items():
            if p is None:
                continue
            name = prefix + attr
            if id(p) in inner_ids:
                raise ValueError(
                    f"parameter {name!r} is shared with (tied to) a parameter of an inner "
                    "fully_shard group; tied parameters must live in one group: call "
                    "fully_shard on a common ancestor only (e.g. leave the embedding and the "
                    "output head to the root).")
            entry = found.setdefault(id(p), CollectedParam(name, p, [], []))
            if not any(o.module is m and o.attr == attr for o in entry.owners):
                entry.owners.append(Owner(m, attr))
                entry.aliases.append(name)
        for cname, child in m._modules.items():
            if child is None or get_state(child) is not None:
                continue
            visit(child, prefix + cname + ".")

    visit(module, "")
    return list(found.values())


def check_param(name: str, param: nn.Parameter) -> None:
    """Raise if ``fully_shard`` cannot shard ``param`` (named ``name`` in the messages).

    Raises:
        ValueError: ``param`` is already a DTensor.
        TypeError: a sparse, complex or non-floating-point parameter.
    """
    if isinstance(param, DTensor):
        raise ValueError(
            f"parameter {name!r} is already a DTensor (sharded by FSDP2, tensor parallelism or "
            "another engine); fully_shard needs plain tensors.")
    if param.layout != torch.strided or param.is_sparse:
        raise TypeError(f"parameter {name!r} has layout {param.layout}; fully_shard supports "
                        "dense (strided) parameters only.")
    if param.is_complex():
        raise TypeError(f"parameter {name!r} is complex ({param.dtype}); fully_shard supports "
                        "real floating-point parameters; store it as a real view "
                        "(torch.view_as_real).")
    if not param.is_floating_point():
        raise TypeError(f"parameter {name!r} has dtype {param.dtype}; fully_shard shards "
                        "floating-point parameters only; register integer/bool state as a "
                        "buffer (module.register_buffer) instead.")


def resolve_granularities(granularity: GranularityArg,
                          named_params: Sequence[tuple[str, nn.Parameter]]) -> dict[str, int]:
    """The ``granularity`` argument resolved to elements, once, per parameter name.

    Every form a user can write (one int/str for all, a dict, a callable) goes through the
    planner's :func:`~lightning_vescale.planner.resolve_granularity` here, with the parameter's
    shape, so the group and the planner only ever see element counts.

    Raises:
        ValueError: a mapping names a parameter that is not in ``named_params``; a value is not
            a granularity (the planner's message names the valid forms).
        TypeError: an argument of another type, or a callable returning something else.
    """
    names = [n for n, _ in named_params]
    if granularity is None or (isinstance(granularity, (int, str))
                               and not isinstance(granularity, bool)):
        given: dict[str, object] = {n: granularity for n in names}
    elif isinstance(granularity, Mapping):
        unknown = sorted(set(granularity) - set(names))
        if unknown:
            raise ValueError(
                f"granularity has keys {unknown} that are not parameters of this group; valid "
                f"names (relative to the module): {names}")
        given = {n: granularity.get(n, 1) for n in names}
    elif callable(granularity):
        given = {}
        for name, param in named_params:
            g = granularity(name, param)
            if isinstance(g, bool) or not isinstance(g, (int, str)):
                raise TypeError(
                    f"the granularity callable returned {g!r} for parameter {name!r}; it must "
                    "return a block size in elements (int), 'row' or '<k>rows' (return 1 for "
                    "element-wise sharding).")
            given[name] = g
    else:
        raise TypeError(f"granularity must be None, an int, a str, a dict name->int or a "
                        f"callable (name, param)->int, got {type(granularity).__name__}")
    shapes = dict(named_params)
    return {n: resolve_granularity(g, tuple(shapes[n].shape),  # type: ignore[arg-type]
                                   name=f"granularity[{n!r}]")
            for n, g in given.items()}
