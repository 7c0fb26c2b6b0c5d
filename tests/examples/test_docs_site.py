"""The documentation site builds, its figures come from scripts, and it renders in a browser.

* ``mkdocs build --strict`` (the ``[docs]`` extra): a broken link or anchor, a page missing from
  the nav, a docstring mkdocstrings cannot parse or an unresolved reference fails the build.
* Every image a page shows is drawn by a script under ``docs/``, ``benchmarks/`` or
  ``examples/`` (no hand-made figures), and the Concepts figures come from the real planner: the
  planner output that ``docs/concepts/planner.md`` prints is what ``docs/draw_figures.py``
  computes today.
* The troubleshooting page shows the words of the error messages users meet (issue 34's
  checks among them), as the package writes them.
* Headless Chromium (Debian's ``chromium`` package; ``.ci/run`` installs it) opens the index, a
  guide and an API page of the built site over HTTP; a console error or a request that fails
  (a missing image, script or stylesheet) fails the test. Screenshots go to ``out/docs_site/``.
(The code blocks of the pages are checked by ``test_readme.py``.)
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.examples.test_examples import env

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SCREENSHOTS = ROOT / "out" / "docs_site"

# Where each figure folder's images come from (what redraws them).
FIGURE_SOURCES = {
    "docs/concepts/img/": "docs/draw_figures.py",
    "docs/memory/": "examples/memory_profile.py",  # --out docs/memory (RESULTS_memory.md)
    "docs/guides/img/": "benchmarks/dryrun_chart.py",  # the dry run's chart (guides/dryrun.md)
    "benchmarks/figures/": "benchmarks/*.py",       # each names its file; checked below
}


def _build(site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=ROOT, env=dict(env(), NO_MKDOCS_2_WARNING="1"),
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("mkdocs is missing: pip install -e '.[docs]' (the README's test command does)")
    out = tmp_path_factory.mktemp("site")
    proc = _build(out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return out


@pytest.mark.slow  # mkdocstrings reads the whole package: 10-30 s
def test_site_builds_strictly(site):
    for page in ("index.html", "getting-started/index.html", "guides/trainer/index.html",
                 "reference/optim/index.html", "benchmarks/fsdp/index.html",
                 "changelog/index.html"):
        assert (site / page).is_file(), page
    api = (site / "reference" / "optim" / "index.html").read_text()
    assert "AdamW8bit" in api and "block_size" in api  # rendered from the docstring
    changelog = (site / "changelog" / "index.html").read_text()
    first = next(line for line in (ROOT / "CHANGELOG.md").read_text().splitlines()
                 if line.startswith("## "))
    assert first.removeprefix("## ").split()[0].strip("[]") in changelog


# The contract's public names (ARCHITECTURE.md, "Public names") beyond the package's __all__.
CONTRACT_SUBMODULE_NAMES = {
    "lightning_vescale.optim": ["AdamW8bit", "Muon", "SOAP", "Shampoo", "FlatParamOptimizer"],
    "lightning_vescale.checkpoint": ["load_safetensors", "save_safetensors", "consolidate"],
    # what fully_shard returns: "a module with FSDP2's FSDPModule methods (unshard, reshard,
    # set_requires_gradient_sync, prefetch setters...)"; their reference is this class's
    "lightning_vescale.fsdp": ["VeScaleFSDPModule"],
}


def test_api_reference_covers_the_public_names():
    """Every public name of the contract that exists has a ``::: path`` entry in the reference
    (a name added to ``__all__``, or the dry run when it lands, fails here until documented)."""
    import lightning_vescale

    documented = set()
    for page in (DOCS / "reference").glob("*.md"):
        documented |= {line.split()[1].rsplit(".", 1)[-1] for line in page.read_text().splitlines()
                       if line.startswith("::: ")}
    wanted = set(lightning_vescale.__all__)
    for names in CONTRACT_SUBMODULE_NAMES.values():
        wanted |= set(names)
    missing = sorted(wanted - documented)
    assert not missing, f"add to docs/reference/*.md: {missing}"
    if (ROOT / "lightning_vescale" / "dryrun").exists() or \
            (ROOT / "lightning_vescale" / "dryrun.py").exists():
        text = "".join(p.read_text() for p in (DOCS / "reference").glob("*.md"))
        assert "::: lightning_vescale.dryrun" in text, "document lightning_vescale.dryrun"


# Words of error messages that name a fix (issue 34's checks among them), each as the package
# writes it and as docs/troubleshooting.md shows it, so that searching the page for the words of
# a message finds its entry. A reworded message fails here until the page follows.
TROUBLESHOOTING_MESSAGES = [
    "mixes files of",                        # checkpoint/_hf_files.py: files of two saves
    "No space left on",                      # checkpoint/_files.py: a full disk, every format
    "cannot be loaded",                      # _lightning/pretrained.py: checked at construction
    "is damaged or not a safetensors file",  # checkpoint/_safetensors_format.py: the header
    "overlap those of tensor",
    "appears twice",
    "belong to no tensor",
    "two matrices' (experts') moments",      # optim/adamw8bit.py: 'matrix' with a block
    "did you mean",                          # _lightning/granularity_rules.py: a pattern
    "but an earlier rule",                   # ... shadowed by an earlier one
    "nonzero values quantize to 0",          # _dbuffer_quant.py: an outlier's block
    "CommPolicy: reduce_scatter_dtype=",     # fsdp/_comm_policy.py: a float8 wire refused
]


def test_troubleshooting_shows_the_messages_users_meet():
    source = "\n".join(p.read_text() for p in (ROOT / "lightning_vescale").rglob("*.py"))
    page = " ".join((DOCS / "troubleshooting.md").read_text().split())  # lines rewrapped
    for words in TROUBLESHOOTING_MESSAGES:
        assert words in source, f"no message of the package says {words!r} any more"
        assert words in page, f"docs/troubleshooting.md does not show {words!r}"


def _images(text: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)


def test_every_figure_comes_from_a_script():
    shown = []
    for page in sorted(DOCS.rglob("*.md")):
        shown += [(page.parent / src).resolve() for src in _images(page.read_text())]
    for results in sorted((ROOT / "benchmarks").glob("RESULTS_*.md")):
        shown += [(results.parent / src).resolve() for src in _images(results.read_text())]
    assert len(shown) >= 5
    scripts = "\n".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))
    for image in shown:
        assert image.is_file(), f"missing figure {image}"
        rel = image.relative_to(ROOT).as_posix()
        folder = next((f for f in FIGURE_SOURCES if rel.startswith(f)), None)
        assert folder is not None, f"{rel}: no script draws it (see FIGURE_SOURCES)"
        if folder == "benchmarks/figures/":
            assert image.name in scripts, f"{rel}: no benchmarks/*.py names it"


@pytest.mark.slow  # a script in a fresh process (torch, matplotlib): ~10 s
def test_concept_figures_are_the_planners(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "docs/draw_figures.py", "--out", str(tmp_path)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    drawn = {p.name for p in tmp_path.glob("*.png")}
    committed = {p.name for p in (DOCS / "concepts" / "img").glob("*.png")}
    assert drawn == committed
    page = (DOCS / "concepts" / "planner.md").read_text()
    m = re.search(r"<!-- output: docs/draw_figures.py layout.txt -->\n```text\n(.*?)\n```",
                  page, re.S)
    assert m, "planner.md lost its planner output block"
    assert m.group(1) == (tmp_path / "layout.txt").read_text().rstrip("\n"), (
        "docs/concepts/planner.md shows a stale layout: rerun python docs/draw_figures.py and "
        "paste docs/concepts/img/layout.txt")


# -- headless Chromium ----------------------------------------------------------------------------
class _Handler(http.server.SimpleHTTPRequestHandler):
    failures: list[str]

    def log_message(self, fmt, *args) -> None:  # keep pytest's output clean
        pass

    def send_error(self, code, message=None, explain=None) -> None:
        self.failures.append(f"{code} {self.path}")
        super().send_error(code, message, explain)


def _chromium() -> str | None:
    return next((shutil.which(n) for n in ("chromium", "chromium-browser")
                 if shutil.which(n)), None)


def _open(site: Path, page: str, shot: Path) -> tuple[list[str], list[str]]:
    """Open ``page`` of ``site`` in headless Chromium over HTTP and screenshot it; return the
    console messages and the requests that failed."""
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (.ci/run installs it: apt-get install chromium)")
    failures: list[str] = []
    handler = functools.partial(type("H", (_Handler,), {"failures": failures}),
                                directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    shot.parent.mkdir(parents=True, exist_ok=True)
    shot.unlink(missing_ok=True)
    url = f"http://127.0.0.1:{server.server_address[1]}/{page}"
    try:
        proc = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--enable-logging=stderr", "--v=0", "--window-size=1280,1600",
             "--virtual-time-budget=5000", f"--screenshot={shot}", url],
            capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert shot.is_file() and shot.stat().st_size > 1000, f"no screenshot of {url}"
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return console, failures


@pytest.mark.slow
@pytest.mark.parametrize("page", ["", "guides/trainer/", "reference/optim/"])
def test_pages_render_in_chromium(site, page):
    shot = SCREENSHOTS / f"{page.strip('/').replace('/', '_') or 'index'}.png"
    console, failures = _open(site, page, shot)
    assert shot.stat().st_size > 10_000, f"{shot}: a blank page?"
    assert not console, f"console messages on /{page}:\n" + "\n".join(console)
    assert not failures, f"requests that failed on /{page}: {failures}"


@pytest.mark.slow
def test_chromium_check_sees_errors(tmp_path):
    """The check above can fail: a script error and a missing image are both caught."""
    (tmp_path / "index.html").write_text(
        '<html><body><img src="missing.png"><script>undefinedFunction();</script></body></html>')
    console, failures = _open(tmp_path, "", tmp_path / "shot.png")
    assert any("undefinedFunction" in line for line in console), console
    assert any("missing.png" in f for f in failures), failures
