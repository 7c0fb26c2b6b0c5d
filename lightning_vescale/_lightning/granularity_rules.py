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

``"matrix"`` with ``optimizer_block_size`` (the 8-bit quantization block) resolves to
``lcm(matrix, block)`` elements for large tensors: shard bounds fall between whole matrices and
on block boundaries. Whether a block may hold two matrices is the optimizer's question, not the
layout's: the strategies mark the parameters they shard per matrix, and ``AdamW8bit`` refuses a
stacked tensor whose matrix is not a multiple of its block (one scale would mix two experts'
moments; design note [adamw8bit]), naming block sizes that fit. SOAP, Shampoo and Muon, which
have no blocks, take the same layout; a 2-D tensor (one matrix) is never refused.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, Union

from lightning_vescale.planner import check_granularity

__all__ = ["GranularityRules"]

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

