"""The kit catches every seeded bug, one per shape of the field's bug class, reproducibly.

tests/mutant_runtimes.py seeds each bug either into kvlife's manager or into a CPU port of
SGLang's decode offload manager (the correct port passes: tests/test_kit_sglang.py). For
each: the exhaustive checker (``kvlife check --runtime``) finds it and its shortest trace
is the story pinned here; the hypothesis kit finds it under derandomized CI settings,
reports one readable trace with it, and that trace replays to the same broken rule.
Run these alone with ``pytest -m mutants``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException
from mutant_runtimes import MUTANTS, SHAPED, reported

from kvlife.cli import main
from kvlife.errors import KVLifeError
from kvlife.testing import (
    CheckConfig,
    KitFailure,
    KitOptions,
    ManagerAdapter,
    check_exhaustively,
    format_trace,
    replay_trace,
    run_kit,
)
from kvlife.testing import replay as replays
from kvlife.testing.report import rule_of

pytestmark = pytest.mark.mutants


@pytest.fixture(autouse=True)
def _replays_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each failure's replay file goes to the test's own directory."""
    monkeypatch.setenv("KVLIFE_REPLAY_DIR", str(tmp_path / "replays"))


#: The CI settings: 100 derandomized runs of up to 40 rules, shrunk, one failure reported.
CI = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)

#: The SGLang port has no per-copy failure path; its lost-ack bug blocks, so a short deadline.
PORT = KitOptions(failures=False, stuck_after=0.25)
MANAGER = KitOptions(stuck_after=2.0)

START = "start rid=r prompt=3 tokens"
STEP0, STEP1 = "step life 0 +2 tokens", "step life 1 +2 tokens"
RETURN0 = "return life 0 (a new life, its tokens as the prompt, restored)"

#: name -> (bounds, options, the shortest trace kvlife check prints, rules the kit may report)
EXPECTED: dict[str, tuple[CheckConfig, list[str], set[str]]] = {
    "sglang-rid-keyed-acks": (
        CheckConfig(2, 1, options=PORT),
        [START, STEP0, "finish life 0 finished", START, STEP1, "poll", "finish life 1 finished"],
        {"release-in-flight", "unreleased", "KeyError", "misfiled-page", "device-leak"},
    ),
    "late-ack-to-newest": (
        CheckConfig(2, 1, options=MANAGER),
        [START, STEP0, "finish life 0 finished", START, STEP1, "complete life 0 chunk 0 ok, poll"],
        {
            "PoolError: is owned by",
            "release-once",
            "release-in-flight",
            "misfiled-page",
            "ForeignAck",
        },
    ),
    "sglang-free-at-retract": (
        CheckConfig(1, 1, options=PORT),
        [START, STEP0, "finish life 0 retracted"],
        {"release-in-flight", "misfiled-page"},
    ),
    "release-in-flight": (
        CheckConfig(1, 1, options=MANAGER),
        [START, STEP0, "finish life 0 aborted"],
        {"release-in-flight", "misfiled-page"},
    ),
    "sglang-flush-counted-at-submit": (
        CheckConfig(1, 1, options=PORT),
        [START, STEP0, "finish life 0 finished"],
        {"release-in-flight", "misfiled-page"},
    ),
    "sglang-lost-flush-ack": (
        CheckConfig(1, 1, options=PORT),
        [START, STEP0, "finish life 0 finished", "poll"],
        {"stuck-copy"},
    ),
    "drop-failed-ack": (
        CheckConfig(1, 1, options=MANAGER),
        [START, STEP0, "finish life 0 finished", "complete life 0 chunk 0 FAIL, poll", "close"],
        {"unreleased", "host-leak"},
    ),
    "sglang-resume-reuses-record": (
        CheckConfig(2, 1, options=PORT),
        [
            START,
            STEP0,
            "finish life 0 retracted",
            "resume life 0",
            "finish life 1 finished",
            "poll",
            "close",
        ],
        {
            "unreleased",
            "device-leak",
            "release-in-flight",
            "AdapterError: copies complete in its progress check",
        },
    ),
    "sglang-shared-staging": (
        CheckConfig(1, 3, options=PORT),
        [START, STEP0, STEP0, STEP0, "finish life 0 finished", "poll"],
        {"misfiled-page"},
    ),
    "sglang-unchained-keys": (
        CheckConfig(1, 2, options=PORT),
        [START, STEP0, STEP0, "poll"],
        {"hash-chain", "InvalidPut", "misfiled-page"},
    ),
    "ack-order-chain": (
        CheckConfig(1, 2, options=MANAGER),
        [START, STEP0, STEP0, "complete life 0 chunk 1 ok, poll"],
        {"hash-chain", "misfiled-page"},  # two chains, one key: the other page's bytes
    ),
    "sglang-slot-counter": (
        CheckConfig(2, 3, options=PORT),
        [START, STEP0, "finish life 0 finished", "poll", START, STEP1, STEP1, STEP1, "poll"],
        {"hash-chain", "misfiled-page", "release-in-flight", "device-leak", "unreleased"},
    ),
    "host-double-free": (
        CheckConfig(1, 1, options=MANAGER),
        [START, STEP0, "finish life 0 finished", "complete life 0 chunk 0 ok, poll"],
        {"PoolError: is already free"},
    ),
    "state-keyed-by-rid": (
        CheckConfig(2, 1, options=MANAGER),
        [START, STEP0, "finish life 0 finished", START, STEP1, "complete life 1 chunk 0 ok, poll"],
        {
            "copy-owner",
            "ManagerError: are already offloaded",
            "hash-chain",
            "misfiled-page",
            "PoolError: is owned by",
        },
    ),
    # The load half: a conversation returns (a new life on the rid, its prefix loaded).
    "load-release-under-load": (
        CheckConfig(1, 0, options=MANAGER, returns=1),
        [START, "finish life 0 finished", RETURN0, "finish life 1 finished"],
        {"release-in-flight"},
    ),
    "load-late-ack-dropped": (
        CheckConfig(1, 0, options=MANAGER, returns=1),
        [
            START,
            "finish life 0 finished",
            RETURN0,
            "finish life 1 finished",
            "complete life 1 chunk 0 ok, poll",
            "close",
        ],
        {"unreleased", "host-leak", "stuck-copy"},
    ),
    "load-transfer-done-by-rid": (
        CheckConfig(1, 1, options=MANAGER, returns=1),
        [START, STEP0, "finish life 0 finished", RETURN0, "complete life 1 chunk 0 ok, poll"],
        {"release-in-flight", "DuplicateAck", "PoolError", "unreleased", "host-leak"},
    ),
    "load-pending-served": (
        CheckConfig(1, 1, options=MANAGER, returns=1),
        [START, STEP0, "finish life 0 finished", RETURN0],
        {"pending-load"},
    ),
    "load-unpinned": (  # no failures or resumes: the same shortest trace, a tenth of the walk
        CheckConfig(
            2, 1, options=KitOptions(failures=False, resumes=False, stuck_after=2.0), returns=1
        ),
        [
            START,
            "finish life 0 finished",
            RETURN0,
            "finish life 1 finished",
            START,
            "step life 2 +2 tokens",
            "complete life 2 chunk 0 ok, poll",
            "complete life 1 chunk 0 ok, poll",
        ],
        {"load-bytes", "misfiled-page"},
    ),
    "load-aliased": (
        CheckConfig(1, 0, options=MANAGER, returns=2),
        [
            START,
            "finish life 0 finished",
            RETURN0,
            "finish life 1 finished",
            "return life 1 (a new life, its tokens as the prompt, restored)",
            "complete life 2 chunk 0 ok, poll",
        ],
        {"copy-owner", "restore-bytes", "unreleased"},
    ),
    "load-failed-as-loaded": (
        CheckConfig(1, 1, options=MANAGER, returns=1, return_chunks=1),
        [
            START,
            "finish life 0 finished",
            RETURN0,
            "complete life 1 chunk 0 FAIL, poll",
            "step life 1 +2 tokens",
        ],
        {"failed-load"},
    ),
    "load-pin-held-to-close": (
        CheckConfig(1, 0, options=MANAGER, returns=1),
        [
            START,
            "finish life 0 finished",
            RETURN0,
            "finish life 1 finished",
            "complete life 1 chunk 0 ok, poll",
            "close",
        ],
        {"stuck-pin"},
    ),
}


def same_refusal(rules: set[str], message: str, replayed: BaseException) -> bool:
    """Whether the replay raised the refusal the first run did, where one error class covers
    several: each phrase of ``rules`` for that class that ``message`` holds, it holds too."""
    prefix = f"{rule_of(replayed)}: "
    phrases = [r.removeprefix(prefix) for r in rules if r.startswith(prefix)]
    return all(p in str(replayed) for p in phrases if p in message)


def test_every_shape_is_seeded() -> None:
    shapes = {shape for shape, _ in SHAPED.values()}
    assert shapes >= set("ABCDEFGIJKLMNOPQ") and len(SHAPED) >= 15
    assert set(EXPECTED) == set(SHAPED) and set(MUTANTS) <= set(SHAPED)


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_checker_finds_each_seeded_bug_with_its_shortest_trace(name: str, tmp_path: Path) -> None:
    """The reduced walk (the default) finds every rule the full walk finds, each with the
    same or a shorter trace; the full walk's shortest trace is the story pinned above."""
    cfg, shortest, rules = EXPECTED[name]
    report = check_exhaustively(cfg, SHAPED[name][1])
    assert not report.ok and report.violating > 0
    found = report.violations[0]
    full = report
    if report.total < report.full:  # a drain-progress runtime's walk is not reduced
        full = check_exhaustively(replace(cfg, reduction=False), SHAPED[name][1])
        assert report.interleavings < full.interleavings
        reduced = {v.rule: len(v.trace) for v in report.violations}
        for v in full.violations:
            assert reduced.get(v.rule, 1 << 30) <= len(v.trace), (name, v.rule, report)
    assert len(found.trace) <= len(shortest)
    assert full.violations[0].trace == shortest, f"{name}: kvlife check printed\n{full}"
    assert format_trace(shortest) in str(full.violations[0])
    # The trace is a reproduction: replayed on a fresh runtime it breaks the same rule.
    with pytest.raises(KVLifeError) as err:  # the rule it breaks, or the refusal it raises
        replay_trace(SHAPED[name][1], found.events, cfg.options)
    assert rule_of(err.value) == found.rule
    assert same_refusal(rules, found.message, err.value)
    # And as a replay file (shrunk), written, read back and re-run: it still fails.
    record = replays.Replay(found.events, cfg.options, found.rule, config=cfg.as_dict())
    path = replays.save(record, SHAPED[name][1], directory=tmp_path)
    again = replays.load(path)
    assert len(again.events) <= len(found.events) and again.rule == found.rule
    rerun = replays.rerun(again, SHAPED[name][1])
    assert rerun is not None and rerun[0] == found.rule, (name, rerun)


#: Bugs that need a rarer interleaving (a resume while the retracted life's flush is in
#: flight; a load still reading when its pages are reused) get more examples.
EXAMPLES = {
    "sglang-resume-reuses-record": 300,
    "load-transfer-done-by-rid": 400,
    "load-unpinned": 200,
    "load-failed-as-loaded": 200,
}


def _kit_failure(name: str) -> KitFailure:
    options = PORT if name.startswith("sglang") else MANAGER
    if name == "sglang-lost-flush-ack":  # every shrink step that hangs waits out the deadline
        options = KitOptions(failures=False, stuck_after=0.1)
    chosen = settings(CI, max_examples=EXAMPLES.get(name, CI.max_examples))
    try:
        run_kit(SHAPED[name][1], chosen, options=options)
    except HypothesisException as exc:  # a health check or flakiness is not a catch
        pytest.fail(f"the kit broke instead of catching {name}: {exc!r}")
    except KitFailure as exc:
        return exc
    pytest.fail(f"the kit passed on the seeded bug {name}")


@pytest.mark.parametrize("name", sorted(SHAPED))
def test_kit_catches_each_seeded_bug_with_one_replayable_trace(name: str) -> None:
    failure = _kit_failure(name)
    _cfg, shortest, rules = EXPECTED[name]
    assert reported(rules, failure.rule, failure.detail), f"{name}: {failure}"
    message = str(failure)
    assert format_trace(failure.trace) in message and "shortest failing run" in message
    assert len(failure.trace) <= len(shortest) + 8, message  # shrunk to a short story
    options = PORT if name.startswith("sglang") else MANAGER
    with pytest.raises(KVLifeError) as err:  # the rule it breaks, or the refusal it raises
        replay_trace(SHAPED[name][1], failure.events, options)
    assert rule_of(err.value) == failure.rule
    assert same_refusal(rules, failure.detail, err.value)


def test_derandomized_runs_report_the_same_failure() -> None:
    first = _kit_failure("sglang-free-at-retract")
    second = _kit_failure("sglang-free-at-retract")
    assert (first.rule, first.trace) == (second.rule, second.trace)


def test_kit_passes_on_kvlife_under_ci_settings() -> None:
    run_kit(ManagerAdapter, CI)


@pytest.mark.parametrize(
    "name",
    ["sglang-free-at-retract", "sglang-unchained-keys", "sglang-lost-flush-ack"],
)
def test_kvlife_check_runtime_catches_port_bugs(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, shortest, _rules = EXPECTED[name]
    argv = ["check", "--runtime", f"mutant_runtimes:{name.replace('-', '_')}"]
    argv += ["--requests", str(cfg.requests), "--chunks", str(cfg.chunks), "--no-failures"]
    assert main([*argv, "--stuck-after", "0.5"]) == 1
    assert format_trace(shortest) in capsys.readouterr().out


def test_kvlife_check_runtime_catches_a_failed_load_reported_as_loaded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Caught by kvlife check, written as a replay file that --replay re-runs: it still
    fails on the mutant, and passes on kvlife's manager (--runtime overrides the file's)."""
    _cfg, shortest, _rules = EXPECTED["load-failed-as-loaded"]
    argv = ["check", "--runtime", "mutant_runtimes:load_failed_as_loaded", "--requests", "1"]
    argv += ["--chunks", "1", "--returns", "1", "--return-chunks", "1", "--jobs", "1"]
    assert main([*argv, "--replay-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "[failed-load]" in out and format_trace(shortest) in out
    (path,) = tmp_path.glob("*.json")
    assert f"replay file: {path}" in out
    assert main(["check", "--replay", str(path)]) == 1
    out = capsys.readouterr().out
    assert "STILL FAILS (the same rule)" in out and "step life 1 +2 tokens" in out
    ours = ["--runtime", "kvlife.testing:ManagerAdapter"]
    assert main(["check", "--replay", str(path), *ours]) == 0
    assert "PASSES now" in capsys.readouterr().out


DOCUMENTED = [
    "sglang-rid-keyed-acks",
    "sglang-free-at-retract",
    "sglang-flush-counted-at-submit",
    "sglang-lost-flush-ack",
    "drop-failed-ack",
    "sglang-resume-reuses-record",
    "sglang-shared-staging",
    "sglang-unchained-keys",
    "sglang-slot-counter",
]


@pytest.mark.parametrize("name", DOCUMENTED)
def test_docs_show_each_shapes_shortest_trace(name: str) -> None:
    """docs/testing-kit.md prints, per shape, the trace the checker finds (pinned above)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "testing-kit.md").read_text("utf-8")
    _cfg, shortest, _rules = EXPECTED[name]
    assert format_trace(shortest) + "\n```" in page, name
