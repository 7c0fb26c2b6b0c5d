"""Finding and replacing the tensors in forward inputs and outputs (any nesting the user chose).

FSDP's hooks must see every tensor a module takes or returns: the pre-backward hook goes on each
output that requires grad (a tensor the hook misses is a group whose parameters are not
re-gathered in backward: a crash), the post-backward identity on each input, the mixed-precision
casts on each floating tensor. Users return dataclasses (nested too), namedtuples, dicts and
lists; ``torch.utils._pytree`` alone does not look into dataclasses, FSDP2's
``_apply_to_tensors`` does not look into pytree-registered classes. These helpers do both:
tensors, dataclass fields (those set by ``__init__``), namedtuples, lists/tuples/sets, mappings,
then any class registered with ``torch.utils._pytree``. Anything else is a leaf left as is.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["map_tensors", "tensors_in"]


def _is_dataclass_instance(x: Any) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


_Tensor = torch.Tensor
_PLAIN_SEQUENCES = (tuple, list)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``; containers are rebuilt (a
    dataclass with ``dataclasses.replace``), leaves that are no tensor are kept.

    Runs in every forward hook: the common shapes (a tensor, a plain tuple/list/dict) are
    tested first, with exact type checks.
    """
    kind = type(tree)
    if isinstance(tree, _Tensor):
        return fn(tree)
    if kind in _PLAIN_SEQUENCES:
        return kind(map_tensors(fn, v) for v in tree)
    if kind is dict:
        return {k: map_tensors(fn, v) for k, v in tree.items()}
    if _is_dataclass_instance(tree):
        changes = {f.name: map_tensors(fn, getattr(tree, f.name))
                   for f in dataclasses.fields(tree) if f.init and hasattr(tree, f.name)}
        return dataclasses.replace(tree, **changes)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return kind(*(map_tensors(fn, v) for v in tree))
    if isinstance(tree, (list, tuple, set, frozenset)):
        return kind(map_tensors(fn, v) for v in tree)
    if isinstance(tree, Mapping):
        out = copy.copy(tree)
        for k, v in tree.items():
            out[k] = map_tensors(fn, v)  # type: ignore[index]
        return out
    node = pytree.SUPPORTED_NODES.get(kind)
    if node is not None:
        children, context = node.flatten_fn(tree)
        return node.unflatten_fn([map_tensors(fn, c) for c in children], context)
    return tree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` (same traversal as :func:`map_tensors`, in no particular
    order), without rebuilding.

    Iterative on purpose: a recursive closure is a reference cycle (function <-> cell) that
    would hold the found tensors, and with them their autograd graphs and hooks, until the
    cycle collector runs.
    """
    out: list[torch.Tensor] = []
    stack = [tree]
    pop, push, add = stack.pop, stack.extend, out.append
    while stack:
        x = pop()
        kind = type(x)
        if isinstance(x, _Tensor):
            add(x)
        elif kind in _PLAIN_SEQUENCES:
            push(x)
        elif kind is dict:
            push(x.values())
        elif _is_dataclass_instance(x):
            push([getattr(x, f.name) for f in dataclasses.fields(x) if hasattr(x, f.name)])
        elif isinstance(x, (list, tuple, set, frozenset)):
            push(x)
        elif isinstance(x, Mapping):
            push(x.values())
        else:
            node = pytree.SUPPORTED_NODES.get(kind)
            if node is not None:
                push(node.flatten_fn(x)[0])
    return out
