"""Design notes: every ``[note-name]`` the package cites is defined, and every note is indexed.

A note is defined as a block in a docstring: a line ``Design note [name]`` underlined with a
line of dashes as long as it (the form every note of the package uses). A citation is ``[name]``
in a comment or a string (docstrings included) of ``lightning_vescale/``: lowercase words joined
by hyphens, not right after a word character or a closing bracket (``x[i]``, ``a[r-1]``), not a
``type: ignore[...]`` code, and a single word only where it names a note or follows "note". The
indexes are the docstring of ``lightning_vescale/fsdp/__init__.py`` (notes of layer 3) and
``lightning_vescale/NOTES.md`` (every other note).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "lightning_vescale"
INDEXES = [PKG / "fsdp" / "__init__.py", PKG / "NOTES.md"]

_NAME = r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*"
_DEFINITION = re.compile(rf"^[ \t]*Design note \[({_NAME})\][ \t]*\n[ \t]*(-+)[ \t]*$", re.M)
_CITATION = re.compile(rf"(?<![\w\]\)\.'\"`=])\[({_NAME})\]")
_IGNORE = re.compile(rf"ignore\[{_NAME}(?:, *{_NAME})*\]")


def _texts(path: Path) -> list[str]:
    """The comments and string literals of a Python file."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append(_IGNORE.sub("", tok.string))
        elif tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            out.append(tok.string)
    return out


def _sources() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def definitions() -> dict[str, list[str]]:
    """Note name -> the files defining it."""
    out: dict[str, list[str]] = {}
    for path in _sources():
        text = path.read_text()
        for m in _DEFINITION.finditer(text):
            title_len = len(m.group(0).split("\n")[0].strip())
            assert len(m.group(2)) == title_len, (
                f"{path}: the underline of 'Design note [{m.group(1)}]' must be "
                f"{title_len} dashes long, not {len(m.group(2))}")
            out.setdefault(m.group(1), []).append(str(path.relative_to(PKG)))
    return out


def _is_citation(text: str, m: re.Match, defined: set[str]) -> bool:
    """A hyphenated name always is; a single word (``[hsdp]``) when it names a note or follows
    the word "note(s)" (so ``{fqn: ...}["params": [fqn]]`` or ``+ [inf]`` are not)."""
    name = m.group(1)
    return "-" in name or name in defined or bool(
        re.search(r"notes?\s*(\[[^\]]*\][\s,]*)*$", text[max(0, m.start() - 80):m.start()]))


def citations() -> dict[str, set[str]]:
    """Note name -> the files citing it."""
    defined = set(definitions())
    out: dict[str, set[str]] = {}
    for path in _sources():
        for text in _texts(path):
            for m in _CITATION.finditer(text):
                if _is_citation(text, m, defined):
                    out.setdefault(m.group(1), set()).add(str(path.relative_to(PKG)))
    return out


def _indexed() -> set[str]:
    names: set[str] = set()
    for index in INDEXES:
        text = index.read_text()
        if index.suffix == ".py":
            text = _texts(index)[0]  # the module docstring
        names.update(_CITATION.findall(text))
    return names


def test_every_note_is_defined_once():
    defs = definitions()
    assert defs, "no design note found: has the definition form changed?"
    twice = {name: files for name, files in defs.items() if len(files) > 1}
    assert not twice, f"notes defined more than once: {twice}"
    for name, files in defs.items():
        assert len(files) == 1


def test_every_cited_note_exists():
    defs = definitions()
    missing = {name: sorted(files) for name, files in citations().items() if name not in defs}
    assert not missing, f"cited but not defined (a 'Design note [name]' block): {missing}"


def test_every_note_is_in_an_index():
    unindexed = sorted(set(definitions()) - _indexed())
    assert not unindexed, (f"notes missing from the indexes ({', '.join(map(str, INDEXES))}): "
                           f"{unindexed}")


def test_the_indexes_name_only_defined_notes():
    stale = sorted(_indexed() - set(definitions()))
    assert not stale, f"indexes name notes that do not exist: {stale}"
