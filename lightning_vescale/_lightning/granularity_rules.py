"""Per-parameter granularity for the strategies: ``{name pattern: granularity}`` rules.

Design note [granularity-rules]
-------------------------------
A mixture-of-experts model wants two layouts at once: each expert of a stacked ``(E, out, in)``
weight whole on one rank (``"matrix"``, so Muon/SOAP orthogonalise experts without
communication) and the dense weights block-aligned for ``AdamW8bit`` (the default). The
strategies' ``granularity`` therefore also takes a mapping from ``fnmatch`` patterns over the
parameter's fully qualified name (as ``model.named_parameters()`` spells it) to any granularity
form, for example (YAML)::

    granularity:
      "*.experts.*": matrix
      "*": null          # everything else: the default (block-aligned large tensors)

The first pattern that matches wins (insertion order, as YAML and ``dict`` keep it); a
parameter no pattern matches gets the default (``None``). Every value is checked when the
strategy is built (the same forms as everywhere, planner/_granularity.py). A pattern that
matches no parameter of the model is an error at sharding time, naming the pattern and
parameter names close to it: a typo must not silently shard experts row-wise.

``"matrix"`` with ``optimizer_block_size`` (the 8-bit quantization block) keeps each expert
whole and its blocks inside it only if the block divides the matrix; the strategy refuses a
quantized-size matrix whose element count is not a multiple of the block (an ``AdamW8bit`` block
would mix two experts' moments under one scale) and names block sizes that fit.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from lightning_vescale.planner import check_granularity, matrix_numel

__all__ = ["GranularityRules", "check_matrix_fits_block"]

_Form = Union[int, str, None]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GranularityRules:
    """Ordered ``(pattern, granularity)`` rules; see design note [granularity-rules]."""

    rules: tuple[tuple[str, _Form], ...]
    #: patterns that matched at least one parameter so far (filled while sharding)
    used: set = dataclasses.field(default_factory=set, compare=False, repr=False)

    @classmethod
    def parse(cls, value: Mapping[Any, Any], *, name: str = "granularity") -> "GranularityRules":
        """Check a user's mapping: non-empty ``str`` patterns, each value a granularity form."""
        if not value:
            raise ValueError(f"{name} is an empty mapping; give patterns such as "
                             f"{{'*.experts.*': 'matrix'}}, or {name}=None for the default.")
        rules = []
        for pattern, form in value.items():
            if not isinstance(pattern, str) or not pattern.strip():
                raise TypeError(f"{name} keys must be parameter-name patterns (non-empty str, "
                                f"fnmatch syntax such as '*.experts.*'), got {pattern!r}.")
            check_granularity(form, name=f"{name}[{pattern!r}]")
            rules.append((pattern.strip(), form))
        return cls(rules=tuple(rules))

    def forms(self) -> tuple[_Form, ...]:
        """Every granularity the rules give (for the construction-time checks)."""
        return tuple(form for _, form in self.rules)

    def form_for(self, fqn: str) -> _Form:
        """The granularity of the parameter named ``fqn``: the first matching rule's, else
        ``None`` (the default)."""
        for pattern, form in self.rules:
            if fnmatch.fnmatchcase(fqn, pattern):
                self.used.add(pattern)
                return form
        return None

    def check_all_used(self, names: Sequence[str]) -> None:
        """Raise if a pattern matched none of ``names`` (the model's parameter names)."""
        unused = [p for p, _ in self.rules if p not in self.used]
        if not unused:
            return
        hints = {p: difflib.get_close_matches(p.replace("*", ""), names, n=3, cutoff=0.3)
                 for p in unused}
        shown = "; ".join(f"{p!r} (close names: {h})" if h else repr(p) for p, h in hints.items())
        raise ValueError(
            f"granularity: the pattern(s) {shown} match no parameter of the model. Patterns are "
            f"fnmatch globs over the fully qualified names of model.named_parameters(), e.g. "
            f"{names[:3]}; write '*.experts.*' to match every parameter under an 'experts' "
            "module, or remove the rule.")


def check_matrix_fits_block(fqn: str, shape: Sequence[int], block: Optional[int]) -> None:
    """``"matrix"`` on a tensor whose block-wise optimizer state is quantized in ``block``
    elements: every block must lie in one matrix (one expert), so ``block`` must divide the
    matrix's element count. Raises ``ValueError`` naming the sizes that fit."""
    if block is None:
        return
    m = matrix_numel(shape)
    if m % block == 0:
        return
    fits = math.gcd(m, block)
    raise ValueError(
        f"granularity 'matrix' for parameter {fqn!r} of shape {tuple(shape)}: one matrix has "
        f"{m} elements, not a multiple of optimizer_block_size={block}, so an AdamW8bit block "
        f"would hold two experts' moments under one scale. Use optimizer_block_size={fits} "
        f"(the largest block that divides {m} and {block}; state it on AdamW8bit(block_size="
        f"{fits}) too, or leave AdamW8bit's block_size=None to inherit it), or "
        "optimizer_block_size=None if no optimizer of this model is block-wise (Muon, SOAP, "
        "AdamW).")
