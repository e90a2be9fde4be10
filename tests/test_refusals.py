"""The one refusal policy (kvlife/refusals.py): counted, logged once per kind, raised only
when strict; recovered failures (``note``) and refusals the caller raises (``counted``)
share its counts."""

from __future__ import annotations

import logging

import pytest

from kvlife.errors import ManagerError
from kvlife.refusals import Refusals


def test_a_refusal_is_counted_and_logged_once_per_kind(caplog: pytest.LogCaptureFixture) -> None:
    refusals = Refusals()
    with caplog.at_level(logging.WARNING, logger="kvlife"):
        for _ in range(3):
            refusals.refuse("load", ManagerError("no"))
        refusals.refuse("offload", ManagerError("no"))
    assert refusals.snapshot() == {"load": 3, "offload": 1} and refusals.total == 4
    assert [r.getMessage().split(" refused")[0] for r in caplog.records] == [
        "kvlife: load",
        "kvlife: offload",
    ]


def test_strict_raises_the_refusal_and_still_counts_it() -> None:
    refusals = Refusals(strict=True)
    with pytest.raises(ManagerError, match="bad"):
        refusals.refuse("load", ManagerError("bad"))
    assert refusals.count("load") == 1


def test_a_noted_failure_never_raises_even_when_strict(caplog: pytest.LogCaptureFixture) -> None:
    """A failure the host recovers from (a copy made again, a job reported failed) is a
    count and one log line, strict or not: strict mode raises refusals of bad input only."""
    refusals = Refusals(strict=True)
    with caplog.at_level(logging.WARNING, logger="kvlife"):
        refusals.note("copy_failures", "CopyFault('x')")
        refusals.note("copy_failures", "CopyFault('y')")
    assert refusals.count("copy_failures") == 2 and refusals.total == 2
    assert len(caplog.records) == 1 and "copy_failures" in caplog.records[0].getMessage()


def test_counted_hands_the_error_back_under_its_type() -> None:
    refusals = Refusals(strict=True)
    error = ManagerError("caller's")
    assert refusals.counted(error) is error  # not raised here: the caller raises it
    assert refusals.snapshot() == {"ManagerError": 1}
