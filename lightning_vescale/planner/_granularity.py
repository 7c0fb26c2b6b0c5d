"""Granularity: the forms a user may write, and their one resolution to elements.

A tensor's *granularity* is the number of consecutive elements (in its flat, row-major order)
that form one unsplittable block: every rank's range of the tensor starts and ends on a block
boundary, or at the tensor's end. Block-wise optimizers need it (an 8-bit state block, a
quantization tile, a whole matrix for Muon), and so does anything that must not see half a row.

Every layer that takes a granularity from a user (``plan_layout``, ``fully_shard``, the Trainer
and Fabric strategies, the planner's command line) accepts the same forms and resolves them
here, so the meaning of ``"row"`` cannot drift between layers:

* ``None``: no constraint of its own (element-wise, 1; a caller's ``multiple_of`` still applies);
* an ``int >= 1``: elements (a decimal string such as ``"4096"`` too, as a command line gives it);
* ``"element"``: 1;
* ``"row"``: one row of the innermost matrix, ``shape[-1]`` elements for tensors with 2 or more
  dims (a stacked-expert ``(E, out, in)`` weight keeps its matrices' rows whole), 1 for 0-/1-D
  tensors (norm weights and biases are vectors of one-element rows);
* ``"<k>rows"`` (e.g. ``"32rows"``): ``k`` such rows, the tile of a row-blocked quantizer;
* ``"matrix"``: the innermost (trailing) 2-D matrix whole, ``shape[-2] * shape[-1]`` elements
  for tensors with 2 or more dims: a whole 2-D weight, one expert of a stacked-expert
  ``(E, out, in)`` weight (so every expert lies on one rank; Muon orthogonalises experts
  there without communication), one ``kh x kw`` kernel of a conv weight. A 1-D tensor is one
  ``(1, n)`` matrix, i.e. whole (a bias or norm weight on one rank); a 0-D tensor is 1.

Strings are case-insensitive (``"elements"``, ``"rows"``, ``"32 rows"`` and ``"32-row"`` are
read too). Two functions, in the order a caller needs them:

* :func:`check_granularity` when the argument arrives (no shape yet): the form is valid, or a
  ``TypeError``/``ValueError`` names the valid forms;
* :func:`resolve_granularity` once the tensor's shape is known: elements, optionally rounded up
  to a multiple of an optimizer's block (``multiple_of``).

A result larger than the tensor's numel means "the whole tensor on one rank"; "whole matrix
per rank" for Muon-style optimizers is ``"matrix"`` (``granularity=numel`` for a 2-D tensor).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from typing import NamedTuple

__all__ = [
    "DEFAULT_BLOCK_ALIGN",
    "DEFAULT_BLOCK_MIN_NUMEL",
    "GRANULARITY_FORMS",
    "Granularity",
    "check_granularity",
    "default_granularity",
    "is_matrix_granularity",
    "matrix_numel",
    "resolve_granularity",
]

#: The default granularity's block for large tensors: ``AdamW8bit``'s quantization block
#: (``lightning_vescale.optim.DEFAULT_BLOCK_SIZE``; restated here, a lower layer, and kept equal
#: by a test).
DEFAULT_BLOCK_ALIGN = 256
#: Tensors with at least this many elements get the aligned default (``AdamW8bit`` keeps fp32
#: states below it: ``lightning_vescale.optim.DEFAULT_MIN_8BIT_SIZE``).
DEFAULT_BLOCK_MIN_NUMEL = 4096

#: A granularity as a user writes it (``None``, where accepted, is spelled out in signatures).
Granularity = int | str

#: The valid forms, as error messages name them.
GRANULARITY_FORMS = ("an int >= 1 (elements), 'element', 'row', '<k>rows' (e.g. '32rows') or "
                     "'matrix'")

_ROWS = re.compile(r"(\d+)\s*-?\s*rows?")


class _Form(NamedTuple):
    """A parsed granularity: ``count`` elements, ``count`` rows of the innermost matrix, or
    (``matrix``) that whole matrix."""

    count: int
    rows: bool
    matrix: bool = False


@functools.lru_cache(maxsize=256)
def _parse_text(text: str) -> _Form | None:
    text = text.strip().lower()
    if text in ("element", "elements", "elem"):
        return _Form(count=1, rows=False)
    if text in ("row", "rows"):
        return _Form(count=1, rows=True)
    if text in ("matrix", "matrices", "mat"):
        return _Form(count=1, rows=False, matrix=True)
    match = _ROWS.fullmatch(text)
    if match and int(match.group(1)) >= 1:
        return _Form(count=int(match.group(1)), rows=True)
    if text.isdigit() and int(text) >= 1:
        return _Form(count=int(text), rows=False)
    return None


def _parse(granularity: Granularity | None, name: str) -> _Form:
    if granularity is None:
        return _Form(count=1, rows=False)
    if isinstance(granularity, bool) or not isinstance(granularity, (int, str)):
        raise TypeError(
            f"{name} must be {GRANULARITY_FORMS} or None, got {granularity!r} "
            f"({type(granularity).__name__})."
        )
    if isinstance(granularity, int):
        if granularity < 1:
            raise ValueError(
                f"{name} must be >= 1 element, got {name}={granularity}; use 1 for element-wise "
                "sharding."
            )
        return _Form(count=granularity, rows=False)
    form = _parse_text(granularity)
    if form is None:
        raise ValueError(f"{name}={granularity!r} is not understood; use {GRANULARITY_FORMS}.")
    return form


def check_granularity(
    granularity: Granularity | None, *, name: str = "granularity"
) -> Granularity | None:
    """Validate a user's granularity before any shape is known; return it unchanged.

    Args:
        granularity: ``None``, an ``int >= 1``, ``"element"``, ``"row"``, ``"<k>rows"`` or
            ``"matrix"`` (see this module's docstring).
        name: the argument's name in error messages (e.g. ``"--granularity"``).

    Raises:
        TypeError: not ``None``, an ``int`` or a ``str`` (``bool`` included); names the forms.
        ValueError: an ``int < 1`` or a string that is none of the forms; names the forms.
    """
    _parse(granularity, name)
    return granularity


def resolve_granularity(
    granularity: Granularity | None,
    shape: Sequence[int],
    *,
    multiple_of: int | None = None,
    name: str = "granularity",
) -> int:
    """Granularity in elements for a tensor of ``shape``: the one resolution of every form.

    ``multiple_of`` rounds the result up to the least common multiple with it, for block-wise
    optimizer states that must not straddle ranks (e.g. ``multiple_of=256``: ``None`` gives 256,
    ``"row"`` of a ``(64, 96)`` matrix gives ``lcm(96, 256) = 768``).

    ``name`` is the argument's name in error messages.

    Raises:
        TypeError, ValueError: as :func:`check_granularity`; ``ValueError`` for a
            ``multiple_of`` that is not an ``int >= 1``.
    """
    form = _parse(granularity, name)
    if form.matrix:
        elements = matrix_numel(shape)
    elif form.rows:
        shape = tuple(shape)
        row = shape[-1] if len(shape) >= 2 else 1
        elements = max(form.count * row, 1)
    else:
        elements = form.count
    if multiple_of is None:
        return elements
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of must be an int >= 1 or None, got {multiple_of!r}")
    return math.lcm(elements, multiple_of)


def is_matrix_granularity(granularity: Granularity | None) -> bool:
    """Whether ``granularity`` is the ``"matrix"`` form (in any spelling this module reads)."""
    form = _parse_text(granularity) if isinstance(granularity, str) else None
    return form is not None and form.matrix


def matrix_numel(shape: Sequence[int]) -> int:
    """Elements of the innermost 2-D matrix of a tensor of ``shape`` (what ``"matrix"`` means):
    ``shape[-2] * shape[-1]`` for 2+ dims, the whole tensor for 1-D, 1 for 0-D; at least 1
    (an empty tensor's granularity is irrelevant, but must be valid)."""
    shape = tuple(int(s) for s in shape)
    inner = shape[-2:] if len(shape) >= 2 else shape
    return max(math.prod(inner), 1)


def default_granularity(shape: Sequence[int]) -> int:
    """The granularity (elements) that ``granularity=None`` means everywhere a layout is built
    (``fully_shard``, the Trainer/Fabric strategies' default ``optimizer_block_size``, the
    planner's command line): element-wise, and multiples of :data:`DEFAULT_BLOCK_ALIGN` for
    tensors of at least :data:`DEFAULT_BLOCK_MIN_NUMEL` elements, so that ``AdamW8bit``'s
    quantization blocks never straddle ranks. Alignment moves shard bounds (and padding), never
    values."""
    large = math.prod(tuple(shape)) >= DEFAULT_BLOCK_MIN_NUMEL
    return resolve_granularity(None, shape, multiple_of=DEFAULT_BLOCK_ALIGN if large else None)
