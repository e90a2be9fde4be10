"""Every failure on docs/failures.md names tests that exist.

Scenario: a test is renamed or deleted and the failure-semantics page keeps
citing it. These tests read the page and the test files and fail with the
stale reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "failures.md"
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def sections() -> dict[str, str]:
    """Each ``## `` section of the page, by title."""
    parts = re.split(r"^## (.+)$", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def references() -> list[tuple[str, str, str]]:
    """Every ``tests/<file>.py::<test>`` cited, with the section citing it."""
    return [
        (title, path, name)
        for title, body in sections().items()
        for path, name in REFERENCE.findall(body)
    ]


def test_every_failure_section_cites_a_test() -> None:
    found = sections()
    assert len(found) >= 10, f"docs/failures.md lost its sections: {sorted(found)}"
    for title, body in found.items():
        row = next((line for line in body.splitlines() if line.startswith("| shown by |")), "")
        assert REFERENCE.search(row), f"section {title!r} has no 'shown by' row citing a test"


@pytest.mark.parametrize(("title", "path", "name"), references())
def test_each_cited_test_exists(title: str, path: str, name: str) -> None:
    source = ROOT / path
    assert source.is_file(), f"{title!r} cites {path}, which does not exist"
    defined = re.search(rf"^def {name}\(", source.read_text(encoding="utf-8"), re.MULTILINE)
    assert defined, f"{title!r} cites {path}::{name}, which {path} does not define"
