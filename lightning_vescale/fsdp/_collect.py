"""Which parameters one ``fully_shard`` call takes, checked, with their granularity resolved.

A group owns the parameters of its module (or of the modules of a ``fully_shard([a, b])`` list)
that no inner group owns. A parameter registered under several names (tied weights) is one
parameter with several *owners* ``(module, attr)`` and *aliases* (its names relative to the
module); it must not be split across groups. Every parameter a call takes is recorded
(``_replaced.py``), so that a later call meeting it again, in an ancestor or in a *sibling*
module (an output head tied to an already sharded embedding), raises FSDP2's ``ValueError``
naming both and the fix (``fully_shard([embedding, head])``) instead of splitting the tie.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vescale.fsdp._extensions import check_no_all_gather_extension
from lightning_vescale.fsdp._param_group import Owner
from lightning_vescale.fsdp._replaced import mark_replaced, taken_by
from lightning_vescale.fsdp._state import get_state, states_in
from lightning_vescale.planner import default_granularity, resolve_granularity

__all__ = ["CollectedParam", "GranularityArg", "check_param", "collect_params",
           "remember_taken", "resolve_granularities"]

#: The ``granularity`` argument of ``fully_shard``.
GranularityArg = Union[None, int, str, Mapping[str, Union[int, str]],
                       Callable[[str, nn.Parameter], Union[int, str]]]


class CollectedParam(NamedTuple):
    """One parameter a ``fully_shard`` call takes."""

    name: str  #: its key in the group: first name relative to its module (``"k.name"`` in lists)
    param: nn.Parameter
    owners: list[Owner]  #: every ``(module, attr)`` that registers it
    aliases: list[str]  #: every name relative to the group's module, in owner order
    #: every name relative to the list's module ``k``, as ``(k, name)`` (``k`` is 0 for one module)
    scoped_aliases: list[tuple[int, str]]


def remember_taken(collected: Sequence[CollectedParam], where: str) -> None:
    """Record that ``collected`` were sharded (replaced) by the ``fully_shard`` call described by
    ``where`` (e.g. ``"Embedding"``), so that a later call finding one of them raises (a tie
    across groups) and so does an optimizer stepping one (design note [fsdp-replaced])."""
    for c in collected:
        mark_replaced(c.param, f"{where}.{c.aliases[0]}" if where else c.aliases[0],
                      original=True)


def _describe(modules: Sequence[nn.Module], k: int, name: str) -> str:
    label = type(modules[k]).__name__
    return f"{label}.{name}" if len(modules) == 1 else f"[{k}] {label}.{name}"


def collect_params(modules: Sequence[nn.Module]) -> list[CollectedParam]:
    """The parameters of ``modules`` (one ``fully_shard`` call) that no inner group owns, in
    ``named_parameters`` order, module by module; a parameter tied across them is one entry.

    Raises:
        ValueError: a parameter is tied to a parameter an earlier ``fully_shard`` call took (an
            inner group, or a sibling group): FSDP2's rule, checked at the call.
    """
    inner_ids: set[int] = set()
    for module in modules:
        for st in states_in(module):
            if st.group is not None:
                for mp in st.group.params:
                    inner_ids.update((id(mp.sharded), id(mp.unsharded)))
    tops = {id(m) for m in modules}
    found: dict[int, CollectedParam] = {}
    seen_modules: set[int] = set()

    def visit(m: nn.Module, k: int, prefix: str) -> None:
        if id(m) in seen_modules:
            return
        seen_modules.add(id(m))
        for attr, p in m._parameters.items():
            if p is None:
                continue
            rel = prefix + attr
            here = _describe(modules, k, rel)
            earlier = taken_by(p)
            if id(p) in inner_ids or earlier is not None:
                where = f"the earlier fully_shard group of {earlier}" if earlier else \
                    "an inner fully_shard group"
                raise ValueError(
                    f"parameter {here} is shared with (tied to) a parameter already managed by "
                    f"{where}; a tie across two groups would be silently broken. Put the tied "
                    "modules in one group: fully_shard([module_a, module_b]) (e.g. the "
                    "embedding and the output head), or leave both to a common ancestor's "
                    "fully_shard call.")
            name = rel if len(modules) == 1 else f"{k}.{rel}"
            entry = found.setdefault(id(p), CollectedParam(name, p, [], [], []))
            if not any(o.module is m and o.attr == attr for o in entry.owners):
                entry.owners.append(Owner(m, attr))
                entry.aliases.append(rel if len(modules) == 1 else f"{k}.{rel}")
                entry.scoped_aliases.append((k, rel))
        for cname, child in m._modules.items():
            if child is None or get_state(child) is not None or id(child) in tops:
                continue
            visit(child, k, prefix + cname + ".")

    for k, module in enumerate(modules):
        visit(module, k, "")
    return list(found.values())


def check_param(name: str, param: nn.Parameter) -> None:
    """Raise if ``fully_shard`` cannot shard ``param`` (named ``name`` in the messages).

    Integer and bool parameters (``requires_grad=False``: they cannot require grad) are sharded
    like frozen floating-point ones, in a DBuffer of their own dtype that mixed precision never
    casts (FSDP2 shards them too).

    Raises:
        ValueError: ``param`` is already a DTensor.
        TypeError: a sparse or complex parameter.
        ValueError: ``param`` defines FSDP2's all-gather extension (``fsdp_pre_all_gather``).
    """
    if isinstance(param, DTensor):
        raise ValueError(
            f"parameter {name!r} is already a DTensor (sharded by FSDP2, tensor parallelism or "
            "another engine); fully_shard needs plain tensors.")
    if param.layout != torch.strided or param.is_sparse:
        raise TypeError(f"parameter {name!r} has layout {param.layout}; fully_shard supports "
                        "dense (strided) parameters only.")
    check_no_all_gather_extension(name, param)  # design note [fsdp-all-gather-extension]
    if param.is_complex():
        raise TypeError(f"parameter {name!r} is complex ({param.dtype}); fully_shard supports "
                        "real floating-point parameters; store it as a real view "
                        "(torch.view_as_real).")


def resolve_granularities(granularity: GranularityArg,
                          named_params: Sequence[tuple[str, nn.Parameter]]) -> dict[str, int]:
    """The ``granularity`` argument resolved to elements, once, per parameter name.

    Every form a user can write (one int/str for all, a dict, a callable) goes through the
    planner's :func:`~lightning_vescale.planner.resolve_granularity` here, with the parameter's
    shape, so the group and the planner only ever see element counts. ``None`` is the
    planner's :func:`~lightning_vescale.planner.default_granularity` (the strategies' default:
    element-wise, multiples of 256 for tensors of 4096+ elements, AdamW8bit's blocks).

    Raises:
        ValueError: a mapping names a parameter that is not in ``named_params``; a value is not
            a granularity (the planner's message names the valid forms).
        TypeError: an argument of another type, or a callable returning something else.
    """
    names = [n for n, _ in named_params]
    if granularity is None:  # the strategies' default: 256-aligned for large tensors
        return {n: default_granularity(tuple(p.shape)) for n, p in named_params}
    if isinstance(granularity, (int, str)) and not isinstance(granularity, bool):
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
