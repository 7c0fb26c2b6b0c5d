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
takes no parameter of the model is an error at sharding time, naming the pattern and either a
pattern built from the real names that would match (``'*.expert.*'`` -> ``'*.experts.*'``),
the names close to it, or the earlier rule that shadows it: a typo must not silently shard
experts row-wise.

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
from typing import Any, Optional, Union

from lightning_vescale.planner import check_granularity

__all__ = ["GranularityRules", "suggest_pattern"]

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
        """Raise if a pattern took none of ``names`` (the model's parameter names): it matches
        none of them (the error suggests a pattern that does, built from the names, when one
        is close), or every name it matches is taken by an earlier rule (first match wins)."""
        unused = [p for p, _ in self.rules if p not in self.used]
        if not unused:
            return
        problems = [self._why_unused(p, names) for p in unused]
        raise ValueError(
            f"granularity: {' '.join(problems)} Patterns are fnmatch globs over the fully "
            f"qualified names of model.named_parameters(), e.g. {list(names[:3])}; fix the "
            "pattern or remove the rule.")

    def _why_unused(self, pattern: str, names: Sequence[str]) -> str:
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if matched:  # shadowed: an earlier rule takes every name it matches
            earlier = next(p for p, _ in self.rules if fnmatch.fnmatchcase(matched[0], p))
            return (f"The rule {pattern!r} matches {len(matched)} parameter(s) (e.g. "
                    f"{matched[0]!r}) but an earlier rule, {earlier!r}, takes each of them "
                    f"(the first matching rule wins): put {pattern!r} before {earlier!r}.")
        hint = suggest_pattern(pattern, names)
        if hint is not None:
            hits = [n for n in names if fnmatch.fnmatchcase(n, hint)]
            return (f"The pattern {pattern!r} matches no parameter of the model; did you mean "
                    f"{hint!r} (it matches {len(hits)}, e.g. {hits[0]!r})?")
        close = difflib.get_close_matches(pattern.replace("*", ""), names, n=3, cutoff=0.3)
        return (f"The pattern {pattern!r} matches no parameter of the model"
                + (f" (close names: {close})." if close else "."))


def _name_parts(names: Sequence[str]) -> list[str]:
    return sorted({part for n in names for part in n.split(".")})


def suggest_pattern(pattern: str, names: Sequence[str]) -> Optional[str]:
    """A pattern like ``pattern`` that matches some of ``names``, built from them, or ``None``.

    Each dot-separated segment that matches no part of any name is replaced by the closest part
    (``'*.expert.*'`` -> ``'*.experts.*'``) or, without a close one, dropped
    (``'model.experts.*'`` on a model whose names do not start with ``model``); then the result
    is tried as it is and widened to match anywhere (``'experts'`` -> ``'*.experts.*'``). The
    first candidate that differs from ``pattern``, names something (not only wildcards) and
    matches a name wins.
    """
    parts = _name_parts(names)
    repaired, kept = [], []
    for seg in pattern.split("."):
        if any(fnmatch.fnmatchcase(part, seg) for part in parts):
            repaired.append(seg)
            kept.append(seg)
            continue
        close = difflib.get_close_matches(seg.replace("*", "").replace("?", ""), parts, n=1,
                                          cutoff=0.6)
        repaired.append(close[0] if close else seg)
        if close:
            kept.append(close[0])
    candidates: list[str] = []
    for base in (".".join(repaired), ".".join(kept)):
        core = base.strip("*.")
        candidates += [base] + ([f"*.{core}.*", f"*.{core}", f"{core}.*", f"*{core}*"]
                                if core else [])
    for cand in candidates:
        if cand.strip("*?.") and cand != pattern and \
                any(fnmatch.fnmatchcase(n, cand) for n in names):
            return cand
    return None
