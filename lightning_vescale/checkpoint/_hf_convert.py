"""Checkpoints whose layout is not the module's: ``transformers``' own conversion, range by range.

Design note [hf-convert]
------------------------
``transformers`` 5 holds the experts of a Mixture-of-Experts model stacked (Mixtral, Qwen3-MoE:
``mlp.experts.gate_up_proj`` of shape ``(E, 2I, H)``, ``mlp.experts.down_proj``) while checkpoints
(and its own ``save_pretrained``) keep one tensor per expert (``block_sparse_moe.experts.N.w1
.weight``, ``mlp.experts.N.gate_proj.weight``...). ``from_pretrained`` converts with the
*conversion mapping* the library declares for the model (``transformers.conversion_mapping
.get_model_conversion_mapping``: ``WeightRenaming`` and ``WeightConverter`` objects whose
``operations`` are e.g. ``MergeModulelist(dim=0)`` then ``Concatenate(dim=1)``). We use that same
declaration, never a table of our own, and run transformers' own renaming
(``core_model_loading.rename_source_key``, keys in ``dot_natural_key`` order) and its own
converters' ``convert`` — but on *virtual* tensors (:class:`_Lazy`: a meta tensor that records
what it is made of), so that no byte is read while converting:

* a checkpoint tensor is a leaf (its :class:`TensorEntry`); ``torch.stack`` / ``torch.cat`` (all
  that ``MergeModulelist`` and ``Concatenate`` do) build a :class:`_Cat` node over their inputs;
* the converted tensor is then a :class:`VirtualEntry`: its name, shape and dtype (from the meta
  computation, so transformers' own shape rules apply), and its *runs*: for any flat element
  range ``[start, end)`` of the row-major result, the list of ``(leaf, leaf_start, leaf_end)``
  ranges that make it, in order. For a concatenation along ``dim`` the result is, for each index
  of the leading dims, the children's contiguous blocks one after the other, so a range maps to
  at most ``2 x children`` runs per leading index, each one contiguous in its file;
* ``load_safetensors`` reads a converted tensor exactly as a stored one: a ``RaggedShard`` rank
  reads the runs of its own flat range (design note [hf-load]) — still only its own bytes.

An operation other than stack / concatenation (a transpose, a permutation for rotary...) cannot
be described as runs: such a target is computed by running the converter on the whole source
tensors (every rank reads them whole, one converter at a time) and cut to the local part; the
MoE conversions of Mixtral / Qwen-MoE / DeepSeek-style models never need it.

Saving (``save_safetensors(layout="save_pretrained")``) goes the other way with the same runs:
``transformers``' own ``revert_weight_conversion`` on meta tensors names and shapes the file
tensors ``save_pretrained`` would write, the forward conversion of those (virtual, as above) says
which runs of the module tensor each file tensor is (:func:`save_layout`), and a rank writes the
runs of its own range into the files. A checkpoint already in the module's layout
(``layout="state_dict"``) matches no converter and loads as it is. Models that are not ``transformers`` models, and a ``transformers``
that declares no conversion, are left alone (the checkpoint's own keys).
"""

from __future__ import annotations

import math
import sys
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn

from lightning_vescale.checkpoint._safetensors_format import TensorEntry, read_range

__all__ = ["SavedAs", "VirtualEntry", "convert_entries", "find_hf_model", "read_entry",
           "save_layout"]


Streams = Callable[[TensorEntry], Any]  # the open file of a checkpoint tensor


class _Node:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def runs(self, start: int, end: int) -> list[tuple["_Node", int, int]]:
        raise NotImplementedError


@dataclass(eq=False)
class _Leaf(_Node):
    entry: TensorEntry

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return tuple(self.entry.shape)

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.entry.dtype

    def runs(self, start: int, end: int) -> list[tuple[_Node, int, int]]:
        return [(self, start, end)] if end > start else []


@dataclass(eq=False)
class _Cat(_Node):
    """``torch.cat(children, dim)`` (``stack`` is a cat of children viewed with a size-1 dim)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int
    children: list[_Node]
    inner: list[int]  # elements of each child per index of the leading dims

    def runs(self, start: int, end: int) -> list[tuple[_Node, int, int]]:
        out: list[tuple[_Node, int, int]] = []
        block = sum(self.inner)
        pos = start
        while pos < end:
            outer, r = divmod(pos, block)
            off = 0
            for child, inner in zip(self.children, self.inner):
                if r < off + inner:
                    a = r - off
                    b = min(inner, a + end - pos)
                    out += child.runs(outer * inner + a, outer * inner + b)
                    pos += b - a
                    r += b - a
                    if pos >= end:
                        break
                off += inner
        return out


@dataclass(eq=False)
class _Computed(_Node):
    """A target that only the converter itself can compute (from whole source tensors)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    compute: Callable[[Streams], Tensor]
    cache: list[Tensor] = field(default_factory=list)

    def runs(self, start: int, end: int) -> list[tuple[_Node, int, int]]:
        return [(self, start, end)] if end > start else []

    def full(self, streams: Streams) -> Tensor:
        if not self.cache:
            self.cache.append(self.compute(streams).reshape(-1))
        return self.cache[0]


class _Unsupported(Exception):
    """An operation the runs cannot describe (the converter is then run on real tensors)."""


_CATS = {torch.cat, torch.concat, torch.concatenate, torch.stack}


class _Lazy(Tensor):
    """A meta tensor that knows what it is made of (:class:`_Node`); only ``stack``/``cat`` are
    allowed on it (anything else that makes a tensor raises :class:`_Unsupported`)."""

    node: _Node

    @staticmethod
    def wrap(meta: Tensor, node: _Node) -> "_Lazy":
        t = Tensor._make_subclass(_Lazy, meta)
        t.node = node
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _CATS:
            tensors = list(args[0] if args else kwargs["tensors"])
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if not all(isinstance(t, _Lazy) for t in tensors):
                raise _Unsupported(f"{func.__name__} of tensors that are not the checkpoint's")
            dim %= out.dim()  # stack: each child is the cat of its size-1 view, same blocks
            inner = [math.prod(t.shape[dim:]) for t in tensors]
            node = _Cat(shape=tuple(out.shape), dtype=out.dtype, dim=dim,
                        children=[t.node for t in tensors], inner=inner)
            return _Lazy.wrap(out, node)
        if _has_tensor(out):
            raise _Unsupported(getattr(func, "__name__", repr(func)))
        return out


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_tensor(o) for o in obj.values())
    return False


@dataclass(frozen=True, kw_only=True)
class VirtualEntry:
    """A tensor of the module's layout made of checkpoint tensors (see the design note)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    node: _Node
    sources: tuple[str, ...]  # the checkpoint keys it is made of
    file: Path  # the file of its first source (for messages)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


Entry = Union[TensorEntry, VirtualEntry]


def read_entry(streams: Streams, entry: Entry, start: int = 0,
               end: Optional[int] = None, *, out: Optional[Tensor] = None) -> Tensor:
    """Elements ``[start, end)`` of the flattened ``entry`` (1-D, its dtype), read run by run
    (``streams(leaf_entry)`` gives the open file of a checkpoint tensor)."""
    end = entry.numel if end is None else end
    if isinstance(entry, TensorEntry):
        return read_range(streams(entry), entry, start, end, out=out)
    if out is None:
        out = torch.empty(end - start, dtype=entry.dtype)
    pos = 0
    for node, s, e in _coalesce(entry.node.runs(start, end)):
        piece = out[pos:pos + e - s]
        if isinstance(node, _Leaf):
            if node.dtype == out.dtype and out.device.type == "cpu":
                read_range(streams(node.entry), node.entry, s, e, out=piece)
            else:
                piece.copy_(read_range(streams(node.entry), node.entry, s, e))
        else:
            assert isinstance(node, _Computed)
            piece.copy_(node.full(streams)[s:e])
        pos += e - s
    assert pos == end - start, (pos, start, end)
    return out


def _coalesce(runs: list[tuple[_Node, int, int]]) -> list[tuple[_Node, int, int]]:
    out: list[tuple[_Node, int, int]] = []
    for node, s, e in runs:
        if out and out[-1][0] is node and out[-1][2] == s:
            out[-1] = (node, out[-1][1], e)
        else:
            out.append((node, s, e))
    return out


def find_hf_model(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """The outermost ``transformers.PreTrainedModel`` in ``module`` (itself included) and its
    name in it, or ``None`` (also when ``transformers`` was never imported: nothing to find)."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - a broken install: no conversion
        return None
    for name, m in module.named_modules():
        if isinstance(m, PreTrainedModel):
            return name, m
    return None


def _conversion(hf: nn.Module) -> Optional[tuple[list, list, Callable[[str], Any]]]:
    """transformers' renamings and converters for ``hf`` and its key sort, or ``None``."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
        )
    except ImportError:  # transformers 4: no conversion mapping, checkpoints are the layout
        return None
    mapping = get_model_conversion_mapping(hf) or []
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    if not renamings and not converters:
        return None
    return renamings, converters, dot_natural_key


def convert_entries(module: nn.Module, entries: dict[str, TensorEntry]) -> dict[str, Entry]:
    """The checkpoint's tensors as ``from_pretrained`` would name and shape them for the
    ``transformers`` model in ``module`` (design note [hf-convert]); unchanged for any other
    module or a checkpoint in the model's own layout. Keys stay relative to that model (the
    checkpoint's own key space: ``key_map`` applies after)."""
    found = find_hf_model(module)
    conversion = _conversion(found[1]) if found is not None else None
    if conversion is None:
        return dict(entries)
    from transformers.core_model_loading import rename_source_key

    hf = found[1]
    renamings, converters, sort_key = conversion
    model_keys = dict.fromkeys(hf.state_dict(), True)
    prefix = getattr(hf, "base_model_prefix", None) or None
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    out: dict[str, Entry] = {}
    groups: dict[str, list[tuple[str, str, TensorEntry]]] = {}  # target -> its sources
    for key in sorted(entries, key=sort_key):
        entry = entries[key]
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if renamed not in model_keys and key in model_keys:
            renamed, pattern = key, None
        if renamed not in model_keys:
            out[key] = entry  # unexpected: reported under its own name
        elif pattern is None:
            out[renamed] = entry
        else:
            groups.setdefault(renamed, []).append((key, pattern, entry))
    for first, members in groups.items():
        template = by_pattern[members[0][1]]
        try:
            realized = _filled(template, first, members, _leaf).convert(
                first, model=hf, config=hf.config)
            nodes = {k: (v[0] if isinstance(v, list) else v).node for k, v in realized.items()}
        except _Unsupported:
            nodes = _computed(template, first, members, hf)
        srcs = tuple(k for k, _, _ in members)
        for name, node in nodes.items():
            out[name] = VirtualEntry(name=name, shape=tuple(node.shape), dtype=node.dtype,
                                     node=node, sources=srcs, file=members[0][2].file)
    return out


def _leaf(entry: TensorEntry) -> Tensor:
    return _Lazy.wrap(torch.empty(entry.shape, dtype=entry.dtype, device="meta"), _Leaf(entry))


def _filled(template: Any, first: str, members: list[tuple[str, str, TensorEntry]],
            make: Callable[[TensorEntry], Tensor]) -> Any:
    """A fresh copy of the converter ``template`` holding ``make(entry)`` of each source, as
    ``from_pretrained`` fills one per target (``add_tensor``)."""
    conv = deepcopy(template)
    for key, pattern, entry in members:
        conv.add_tensor(first, key, pattern, make(entry))
    return conv


def _computed(template: Any, first: str, members: list[tuple[str, str, TensorEntry]],
              hf: nn.Module) -> dict[str, _Node]:
    """Targets of a converter whose operations are not stack/cat: run it for real on whole
    tensors when first read (shapes from a run on plain meta tensors)."""
    def meta(e: TensorEntry) -> Tensor:
        return torch.empty(e.shape, dtype=e.dtype, device="meta")

    shapes = _filled(template, first, members, meta).convert(first, model=hf, config=hf.config)
    results: dict[str, Tensor] = {}

    def run(streams: Streams) -> dict[str, Tensor]:
        if not results:
            def whole(e: TensorEntry) -> Tensor:
                return read_range(streams(e), e).view(e.shape)

            done = _filled(template, first, members, whole).convert(
                first, model=hf, config=hf.config)
            results.update({k: v[0] if isinstance(v, list) else v for k, v in done.items()})
        return results

    out: dict[str, _Node] = {}
    for name, value in shapes.items():
        value = value[0] if isinstance(value, list) else value
        out[name] = _Computed(shape=tuple(value.shape), dtype=value.dtype,
                              compute=lambda streams, name=name: run(streams)[name])
    return out


@dataclass(frozen=True, kw_only=True)
class SavedAs:
    """How a module tensor is written in ``save_pretrained``'s layout: the file tensors it is
    cut into (``pieces``: file key in the module's key space, name of its leaf in ``entry``,
    shape; in the order of ``entry``'s leaves) and ``entry``, the module tensor seen as made of
    them (its runs map a flat range to leaf ranges)."""

    pieces: tuple[tuple[str, str, tuple[int, ...]], ...]
    entry: VirtualEntry


def save_layout(module: nn.Module, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]
                ) -> dict[str, SavedAs]:
    """For the tensors of ``module`` (names as in its ``state_dict``, with shape and dtype) that
    ``save_pretrained`` writes in another layout (stacked experts written one per expert), how:
    ``transformers``' own ``revert_weight_conversion`` on meta tensors names and shapes the file
    tensors, and the forward conversion of those (design note [hf-convert]) says which range of
    the module tensor each one is. Others are absent (written as they are), also one whose
    conversion is not stack/cat (``from_pretrained`` reads a tensor under its module name)."""
    found = find_hf_model(module)
    if found is None or _conversion(found[1]) is None:
        return {}
    from transformers.core_model_loading import revert_weight_conversion

    prefix, hf = found
    pre = f"{prefix}." if prefix else ""
    mine = {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}
    meta = {k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in mine.items()}
    reverted = revert_weight_conversion(hf, meta)
    if set(reverted) == set(meta):
        return {}
    fake = {k: TensorEntry(file=Path(k), name=k, dtype=v.dtype, shape=tuple(v.shape), begin=0,
                           end=v.numel() * v.dtype.itemsize) for k, v in reverted.items()}
    out: dict[str, SavedAs] = {}
    for name, entry in convert_entries(hf, fake).items():
        if name not in mine or (isinstance(entry, TensorEntry) and entry.name == name):
            continue
        if isinstance(entry, TensorEntry):  # renamed only (Mixtral's block_sparse_moe.gate)
            entry = VirtualEntry(name=name, shape=entry.shape, dtype=entry.dtype,
                                 node=_Leaf(entry), sources=(entry.name,), file=entry.file)
        leaves = _leaves(entry.node)
        if leaves is None or entry.shape != tuple(mine[name][0]):
            continue  # not byte runs of files (a transpose...): written as the module holds it
        out[pre + name] = SavedAs(
            pieces=tuple((pre + leaf.entry.name, leaf.entry.name, tuple(leaf.shape))
                         for leaf in leaves),
            entry=entry)
    return out


def _leaves(node: _Node) -> Optional[list[_Leaf]]:
    if isinstance(node, _Leaf):
        return [node]
    if isinstance(node, _Cat):
        out: list[_Leaf] = []
        for child in node.children:
            sub = _leaves(child)
            if sub is None:
                return None
            out += sub
        return out
    return None
