"""The exhaustive checker: it runs every interleaving, passes on kvlife, and can fail.

Interleaving counts are pinned from an independent count (a memoized
recursion over the same configuration written separately), so the walk can
neither skip nor repeat an interleaving unnoticed.
"""

from __future__ import annotations

import json

import pytest
from mutant_runtimes import MUTANTS

from kvlife import FinishReason
from kvlife.cli import main
from kvlife.testing.exhaustive import (
    CheckConfig,
    CheckConfigError,
    check_exhaustively,
    count_interleavings,
)

REASONS = tuple(FinishReason)


@pytest.mark.parametrize(
    ("requests", "chunks", "reasons", "failures", "count"),
    [
        (1, 1, 1, False, 3),
        (1, 2, 3, False, 33),
        (1, 3, 3, True, 1263),
        (2, 1, 3, False, 171),
        (2, 1, 3, True, 549),
        (2, 2, 1, False, 851),
        (2, 2, 3, False, 7659),
        (2, 3, 3, False, 869499),
    ],
)
def test_interleaving_counts(
    requests: int, chunks: int, reasons: int, failures: bool, count: int
) -> None:
    cfg = CheckConfig(requests, chunks, REASONS[:reasons], failures)
    assert count_interleavings(cfg) == count


def test_kvlife_keeps_every_rule_in_every_interleaving() -> None:
    report = check_exhaustively(CheckConfig(requests=2, chunks=2))
    assert report.ok, report.violations
    assert report.interleavings == report.total == 7659 and report.violating == 0


def test_failed_copies_too() -> None:
    report = check_exhaustively(CheckConfig(requests=2, chunks=1, failures=True))
    assert report.ok and report.interleavings == 549


#: The smallest bound at which each seeded bug can show, and the rule it breaks first.
BOUNDS = {
    "state-keyed-by-rid": (CheckConfig(requests=2, chunks=1), {"copy-owner", "InvalidStep"}),
    "release-in-flight": (CheckConfig(requests=1, chunks=1), {"release-in-flight"}),
    "host-double-free": (CheckConfig(requests=1, chunks=1), {"DoubleFree"}),
    "ack-order-chain": (CheckConfig(requests=1, chunks=2), {"hash-chain"}),
    "late-ack-to-newest": (CheckConfig(requests=2, chunks=1), {"ForeignFree"}),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_checker_finds_each_mutant_with_a_short_trace(name: str) -> None:
    cfg, rules = BOUNDS[name]
    report = check_exhaustively(cfg, MUTANTS[name])
    assert not report.ok and report.violating > 0
    assert {v.rule for v in report.violations} & rules, report.violations
    shortest = report.violations[0]
    assert shortest.trace[0].startswith("start") and len(shortest.trace) <= 7


def test_release_in_flight_shortest_trace_is_the_abort() -> None:
    report = check_exhaustively(CheckConfig(requests=1, chunks=1), MUTANTS["release-in-flight"])
    (violation,) = report.violations
    assert violation.trace == [
        "start rid=r prompt=3 tokens",
        "step life 0 +2 tokens",
        "finish life 0 aborted",
    ]


def test_worker_processes_explore_the_same_interleavings() -> None:
    cfg = CheckConfig(requests=2, chunks=1)
    assert check_exhaustively(cfg, jobs=2).interleavings == 171
    mutant = check_exhaustively(
        CheckConfig(requests=1, chunks=2), MUTANTS["ack-order-chain"], jobs=2
    )
    assert [v.rule for v in mutant.violations] == ["hash-chain"]


def test_cli_json_and_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["check", "--chunks", "1", "--reasons", "finished,aborted", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["interleavings"]
        == out["total"]
        == count_interleavings(CheckConfig(chunks=1, reasons=REASONS[:2]))
    )
    assert out["violations"] == [] and out["elapsed_s"] >= 0

    # The same command on a seeded bug exits 1 and prints the shortest trace.
    monkeypatch.setattr(
        "kvlife.testing.command.check_exhaustively",
        lambda cfg, jobs: check_exhaustively(cfg, MUTANTS["release-in-flight"], jobs=jobs),
    )
    assert main(["check", "--requests", "1", "--chunks", "1", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["violations"][0]["rule"] == "release-in-flight"
    assert main(["check", "--requests", "1", "--chunks", "1"]) == 1
    assert "finish life 0 aborted" in capsys.readouterr().out


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(CheckConfigError):
        CheckConfig(chunks=7)
    with pytest.raises(CheckConfigError):
        CheckConfig(reasons=())
    assert main(["check", "--requests", "0"]) == 2
