"""MkDocs hooks: pages made from files that live outside ``docs/`` (one source of truth).

* ``benchmarks/RESULTS_<name>.md`` becomes the page ``benchmarks/<name>.md``, and the figures
  it shows (``benchmarks/figures/*.png``) are copied beside it, so the tables on the site are
  the files the benchmark scripts regenerate, never a copy that can go stale.
* ``CHANGELOG.md`` becomes ``changelog.md``.
* Sphinx roles left in docstrings (``:func:`x```) render as plain code, not as ``:func:`` text.

A RESULTS file that the ``nav`` of ``mkdocs.yml`` does not list is a warning, so
``mkdocs build --strict`` fails until it is listed (MkDocs' ``validation.omitted_files``).
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def results_pages() -> dict[str, Path]:
    """Site path -> source file of every benchmark results page."""
    return {f"benchmarks/{p.stem.removeprefix('RESULTS_')}.md": p
            for p in sorted((ROOT / "benchmarks").glob("RESULTS_*.md"))}


def on_files(files: Files, config) -> Files:
    for uri, path in results_pages().items():
        files.append(File.generated(config, uri, content=path.read_text()))
    for png in sorted((ROOT / "benchmarks" / "figures").glob("*.png")):
        files.append(File.generated(config, f"benchmarks/figures/{png.name}",
                                    abs_src_path=str(png)))
    files.append(File.generated(config, "changelog.md",
                                content=(ROOT / "CHANGELOG.md").read_text()))
    return files


_ROLE = re.compile(r":(?:func|meth|class|data|attr|mod|exc|obj):\s*(<code>)")


def on_page_content(html: str, page, config, files) -> str:
    return _ROLE.sub(r"\1", html)
