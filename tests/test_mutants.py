"""The kit catches every seeded bug class, reproducibly, and passes on kvlife's own manager.

Each mutant in tests/mutant_runtimes.py is kvlife's manager with one bug of
DESIGN.md put back. The kit runs under fixed settings (derandomized, no
database, no shrinking: finding is what is asserted), twice, and must fail the
same way both times. Run these alone with ``pytest -m mutants``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from mutant_runtimes import MUTANTS

from kvlife.testing import InvariantViolation, ManagerAdapter, RuntimeAdapter, run_kit

pytestmark = pytest.mark.mutants

#: The CI settings: 100 derandomized runs of up to 40 rules, stop at the first failure.
CI = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)


def _failure(factory: Callable[[], RuntimeAdapter]) -> BaseException:
    """Run the kit; the exception it fails with (the test fails if it passes)."""
    try:
        run_kit(factory, CI)
    except HypothesisException as exc:  # a health check or flakiness is not a catch
        pytest.fail(f"the kit broke instead of catching the bug: {exc!r}")
    except Exception as exc:
        return exc
    pytest.fail("the kit passed on a seeded bug")


def _signature(exc: BaseException) -> tuple[str, str]:
    rule = exc.rule if isinstance(exc, InvariantViolation) else ""
    return type(exc).__name__, rule


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_kit_catches_mutant_reproducibly(name: str) -> None:
    first = _failure(MUTANTS[name])
    second = _failure(MUTANTS[name])
    assert _signature(first) == _signature(second), (first, second)


def test_kit_passes_on_kvlife_under_ci_settings() -> None:
    run_kit(ManagerAdapter, CI)


def test_every_bug_class_is_seeded() -> None:
    assert sorted(MUTANTS) == [
        "ack-order-chain",
        "host-double-free",
        "late-ack-to-newest",
        "release-in-flight",
        "state-keyed-by-rid",
    ]
