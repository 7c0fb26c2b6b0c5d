"""``tests/README.md`` maps every package module to its tests: every test file is named there, so
the table cannot silently fall behind the suite (issue 22, "tests you can find")."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_is_in_the_table():
    text = (TESTS / "README.md").read_text()
    missing = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py")
                     if p.name not in text and p.stem not in text)
    assert not missing, f"add these to tests/README.md's module table: {missing}"
