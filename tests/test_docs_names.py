"""The docs' prose names only states, events and guards the lifecycle table has.

Scenario: the table changes (a guard renamed or split, a state added) and the
generated diagram and table follow, but the sentences around them still name
the old ones. These tests read the prose of every docs page and the README
(code blocks and the generated diagram left out) and fail on a name the table
(``kvlife._lifecycle.TABLE``, ``GUARDS``) does not have:

* on every page: a drawn row label (`` `ack [more_stores]` ``) must be a row of
  the table; a code span made of the guards' words (`` `last_in_flight` ``) must
  be a guard; a chain of states (`` `IDLE → OFFLOADING` ``) must follow rows;
* on docs/lifecycle.md, the page about the table: every name in code is a
  state, event or guard of the table or a name the code has (an API name, an
  attribute, a module, a file); its table of states lists exactly the states;
* the README's headline names every state.
"""

from __future__ import annotations

import importlib
import inspect
import re
from itertools import pairwise
from pathlib import Path

import pytest

import kvlife
import kvlife.errors
from kvlife._lifecycle import GUARDS, TABLE, Event, Lifecycle, LifecycleSnapshot, State

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

STATES = {s.name for s in State}
EVENTS = {e.value for e in Event} | {e.name for e in Event}
ROW_LABELS = {f"{row.event.value} [{row.guard}]" for row in TABLE if row.guard}
ROWS = {(row.source.name, row.dest.name) for row in TABLE}
#: The words guards are made of (``last``, ``store``, ``loads``, ``in``, ``flight``, ...):
#: a name made only of these, with an underscore, reads as a guard.
GUARD_WORDS = {word for guard in GUARDS for word in guard.split("_")}
TABLE_NAMES = STATES | EVENTS | set(GUARDS)

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.DOTALL | re.MULTILINE)
_GENERATED = re.compile(r"<!-- generated:.*?<!-- end generated -->", re.DOTALL)
_SPAN = re.compile(r"`([^`]+)`")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ROW_LABEL = re.compile(r"([a-z_]+) \[([A-Za-z0-9_ ]+)\]")


def prose(text: str) -> str:
    """``text`` without its code blocks and generated blocks."""
    return _FENCE.sub("", _GENERATED.sub("", text))


def spans(text: str) -> list[str]:
    """The inline code spans of ``text``'s prose, whitespace collapsed (spans may wrap)."""
    return [" ".join(span.split()) for span in _SPAN.findall(prose(text))]


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def table_name_problems(span: str) -> list[str]:
    """What is wrong with ``span`` if it names a part of the table the table lacks."""
    found = _ROW_LABEL.fullmatch(span)
    if found and (found.group(1) in EVENTS or found.group(2) in GUARDS):
        return [] if span in ROW_LABELS else [f"`{span}` is no row of the table"]
    if "→" in span:
        names = [name.strip() for name in span.split("→")]
        if all(re.fullmatch(r"[A-Z_]+", name) for name in names):
            problems = [
                f"`{name}` (in `{span}`) is no state" for name in names if name not in STATES
            ]
            if not problems:
                problems = [
                    f"`{a} → {b}` (in `{span}`) is no row of the table"
                    for a, b in pairwise(names)
                    if (a, b) not in ROWS
                ]
            return problems
    if "_" in span and _IDENT.fullmatch(span) and set(span.split("_")) <= GUARD_WORDS:
        return [] if span in TABLE_NAMES else [f"`{span}` reads as a guard; the table has none"]
    return []


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_prose_names_only_rows_guards_and_states_the_table_has(page: Path) -> None:
    problems = [
        p for span in spans(page.read_text(encoding="utf-8")) for p in table_name_problems(span)
    ]
    assert not problems, (
        f"{_page_id(page)} names what kvlife._lifecycle.TABLE does not have "
        f"(guards: {', '.join(GUARDS)}): " + "; ".join(problems)
    )


def _code_names() -> set[str]:
    """Names the code has that the lifecycle page may show in code."""
    names = set(dir(kvlife)) | set(dir(kvlife.errors)) | set(dir(Lifecycle))
    names |= set(LifecycleSnapshot._fields) | set(dir(BaseException))
    names |= set(inspect.signature(kvlife.errors.LifecycleError).parameters)
    return names


def _resolves(dotted: str) -> bool:
    """``kvlife.a.b``: a module, or a module's attribute."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def lifecycle_page_problems(text: str) -> list[str]:
    """Every name in code on the lifecycle page that neither the table nor the code has."""
    known = TABLE_NAMES | _code_names()
    problems = []
    for span in spans(text):
        name = span.removesuffix("()")
        if table_name_problems(span):
            problems += table_name_problems(span)
        elif _IDENT.fullmatch(name) and name not in known:
            problems.append(f"`{span}` is no state, event or guard of the table, nor a code name")
        elif re.fullmatch(r"kvlife(\.[A-Za-z_]\w*)+", name) and not _resolves(name):
            problems.append(f"`{span}` does not resolve")
        elif re.fullmatch(r"[\w/.-]+\.py", span) and not (ROOT / span).is_file():
            problems.append(f"`{span}` is no file of the repository")
    return problems


def test_lifecycle_page_names_only_what_the_table_and_code_have() -> None:
    text = (ROOT / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    problems = lifecycle_page_problems(text)
    assert not problems, "docs/lifecycle.md: " + "; ".join(problems)


def test_lifecycle_page_lists_every_state() -> None:
    text = (ROOT / "docs" / "lifecycle.md").read_text(encoding="utf-8")
    section = text.split("## States", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([A-Z_]+)` \|", section, re.MULTILINE)
    assert listed == [s.name for s in State], "docs/lifecycle.md's table of states"


def test_readme_headline_names_every_state() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headline = readme.split("\n\n", 2)[1]  # the paragraph under the title
    named = {n for span in spans(headline) for n in re.findall(r"[A-Z_]{2,}", span)}
    assert named >= STATES, f"README's headline leaves out {sorted(STATES - named)}"


@pytest.mark.parametrize(
    ("span", "wrong"),
    [
        ("last_in_flight", True),
        ("more_in_flight", True),
        ("ack [last_load]", True),  # a guard of load_ack's, not of ack's
        ("ack [more_stores]", False),
        ("IDLE → OFFLOADING → FINISHED → RELEASED", False),
        ("IDLE → RELEASED", True),
        ("IDLE → UNLOADING", True),
        ("chunks_in_flight", False),  # a counter, not made of the guards' words
        ("loads_in_flight", False),
    ],
)
def test_the_check_tells_a_stale_name(span: str, wrong: bool) -> None:
    assert bool(table_name_problems(span)) is wrong
