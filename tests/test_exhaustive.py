"""The exhaustive checker: it runs every interleaving, passes on kvlife, and can fail.

Interleaving counts are pinned from an independent count (a memoized
recursion over the same configuration written separately), so the walk can
neither skip nor repeat an interleaving unnoticed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from mutant_runtimes import MUTANTS, reported

from kvlife import FinishReason
from kvlife.cli import main
from kvlife.errors import ConfigError
from kvlife.testing import KitOptions, ManagerAdapter
from kvlife.testing.command import adapter_problem, load_runtime
from kvlife.testing.events import Poll
from kvlife.testing.exhaustive import (
    CheckConfig,
    check_exhaustively,
    count_interleavings,
    count_runs,
)

REASONS = tuple(FinishReason)


def _options(reasons: int, failures: bool, resumes: bool = False) -> KitOptions:
    """Options trying the first ``reasons`` finish reasons (finished, aborted, retracted)."""
    return KitOptions(
        failures=failures, aborts=reasons >= 2, retractions=reasons >= 3, resumes=resumes
    )


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
    cfg = CheckConfig(requests, chunks, options=_options(reasons, failures))
    assert count_interleavings(cfg) == count


def _brute_count(cfg: CheckConfig, progress: str) -> int:
    """An independent count: every interleaving as an explicit list, by plain recursion
    over (per life: started, steps, finish reason or None, completed chunks, polled)."""
    reasons = cfg.options.reasons
    outcomes = 2 if cfg.options.failures and progress == "poll" else 1

    def walk(lives: list[list[object]]) -> int:
        total = 0
        for i, (started, k, reason, done, polled) in enumerate(lives):
            if not started:
                before = lives[i - 1][2] if i else FinishReason.FINISHED
                if before is not None:
                    total += walk(_set(lives, i, [True, 0, None, frozenset(), True]))
                    if before is FinishReason.RETRACTED and cfg.options.resumes:
                        total += walk(_set(lives, i, [True, 0, None, frozenset(), True]))
                continue
            if reason is None:
                if k < cfg.chunks:  # type: ignore[operator]
                    total += walk(_set(lives, i, [True, k + 1, None, done, polled]))  # type: ignore[operator]
                for r in reasons:
                    total += walk(_set(lives, i, [True, k, r, done, False]))
            if progress == "poll":
                for j in range(k):  # type: ignore[call-overload]
                    if j not in done:  # type: ignore[operator]
                        total += outcomes * walk(
                            _set(lives, i, [True, k, reason, done | {j}, polled])
                        )  # type: ignore[operator]
        if progress == "drain":
            after = [
                [s, k, r, frozenset(range(k)), polled or r is not None] if s else [s, k, r, d, p]  # type: ignore[call-overload]
                for s, k, r, d, p in lives
            ]
            if after != lives:
                total += walk(after)
        return total or 1

    return walk([[False, 0, None, frozenset(), True] for _ in range(cfg.requests)])


def _set(lives: list[list[object]], i: int, life: list[object]) -> list[list[object]]:
    return [*lives[:i], life, *lives[i + 1 :]]


@pytest.mark.parametrize("progress", ["poll", "drain"])
@pytest.mark.parametrize(
    ("requests", "chunks", "failures", "resumes"),
    [(1, 2, True, True), (2, 1, True, True), (2, 1, False, True), (2, 2, False, True)],
)
def test_interleaving_counts_with_resumes_and_drains_match_an_independent_count(
    requests: int, chunks: int, failures: bool, resumes: bool, progress: str
) -> None:
    cfg = CheckConfig(requests, chunks, options=_options(3, failures, resumes))
    assert count_interleavings(cfg, progress) == _brute_count(cfg, progress)  # type: ignore[arg-type]


def test_kvlife_keeps_every_rule_in_every_interleaving() -> None:
    cfg = CheckConfig(requests=2, chunks=2, options=_options(3, False))
    report = check_exhaustively(cfg)  # one of each class of the 7659 (the full walk: 30 s)
    assert report.ok, report.violations
    assert report.interleavings == report.total == 663 and report.violating == 0
    assert report.full == 7659
    assert report.deferred == 0


def test_failed_copies_and_resumes_too() -> None:
    report = check_exhaustively(CheckConfig(requests=2, chunks=1))  # the default options
    assert report.ok and report.interleavings == report.total == count_runs(report.config)
    assert report.full == count_interleavings(CheckConfig(requests=2, chunks=1)) > 549


def test_a_one_page_host_pool_defers_chunks_and_breaks_no_rule() -> None:
    """Item 6: with one host page, chunks wait for the pool (deferred, not copy-owner); with
    config.host_pages_needed none is deferred."""
    cfg = CheckConfig(requests=2, chunks=2, options=_options(3, False))
    small = check_exhaustively(cfg, lambda: ManagerAdapter(host_pages=1))
    assert small.ok, small.violations
    assert small.deferred > 0 and small.interleavings < small.total  # deferred prefixes prune
    ample = check_exhaustively(cfg, lambda: ManagerAdapter(host_pages=cfg.host_pages_needed))
    assert ample.ok and ample.deferred == 0


#: The smallest bound at which each seeded bug can show, and the rule it breaks first.
BOUNDS = {
    "state-keyed-by-rid": (
        CheckConfig(requests=2, chunks=1),
        {"copy-owner", "ManagerError: are already offloaded"},
    ),
    "release-in-flight": (CheckConfig(requests=1, chunks=1), {"release-in-flight"}),
    "host-double-free": (CheckConfig(requests=1, chunks=1), {"PoolError: is already free"}),
    "ack-order-chain": (CheckConfig(requests=1, chunks=2), {"hash-chain"}),
    "late-ack-to-newest": (CheckConfig(requests=2, chunks=1), {"PoolError: is owned by"}),
}  # the per-shape seeded bugs are in test_mutants.py


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_checker_finds_each_mutant_with_a_short_trace(name: str) -> None:
    cfg, rules = BOUNDS[name]
    report = check_exhaustively(cfg, MUTANTS[name])
    assert not report.ok and report.violating > 0
    assert any(reported(rules, v.rule, v.message) for v in report.violations), report.violations
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
    assert check_exhaustively(cfg, jobs=2).interleavings == count_runs(cfg)
    mutant = check_exhaustively(
        CheckConfig(requests=1, chunks=2), MUTANTS["ack-order-chain"], jobs=2
    )
    assert [v.rule for v in mutant.violations] == ["hash-chain"]


def test_cli_json_and_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["check", "--requests", "2", "--chunks", "1", "--returns", "0"]
    argv += ["--reasons", "finished,aborted", "--no-failures"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = CheckConfig(chunks=1, options=_options(2, False, resumes=True))
    assert out["interleavings"] == out["total"] == count_runs(cfg)
    assert out["full"] == count_interleavings(cfg) and out["config"]["reduction"]
    assert out["violations"] == [] and out["elapsed_s"] >= 0 and out["deferred"] == 0

    # The same command on a seeded bug exits 1 and prints the shortest trace.
    runtime = ["--runtime", "mutant_runtimes:MUTANTS.release-in-flight"]
    assert main(["check", "--requests", "1", "--chunks", "1", *runtime, "--json"]) == 2
    capsys.readouterr()  # a dotted name with a dash is not an attribute: refused, exit 2
    monkeypatch.setattr(
        "kvlife.testing.command.load_factory", lambda spec, **_: MUTANTS["release-in-flight"]
    )
    assert main(["check", "--requests", "1", "--chunks", "1", "--runtime", "x:y", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["violations"][0]["rule"] == "release-in-flight"
    assert main(["check", "--requests", "1", "--chunks", "1", "--runtime", "x:y"]) == 1
    printed = capsys.readouterr().out
    assert "   3. finish life 0 aborted" in printed and "FAILED" in printed


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ConfigError):
        CheckConfig(chunks=7)
    with pytest.raises(ConfigError):
        CheckConfig(options=None)  # type: ignore[arg-type]
    assert main(["check", "--requests", "0"]) == 2
    assert main(["check", "--reasons", "aborted"]) == 2
    assert main(["check", "--runtime", "no_such_module_here:factory"]) == 2
    assert main(["check", "--runtime", "nocolon"]) == 2


def test_issue23_the_checked_adapter_is_the_first_one_the_check_drives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_runtime calls the factory once to check what it returns, and the check starts
    with that adapter: nothing is built twice, and a later call is the factory's own."""
    (tmp_path / "counted_runtime.py").write_text(
        "from kvlife.testing import ManagerAdapter\n"
        "MADE = []\n"
        "def factory():\n"
        "    MADE.append(ManagerAdapter(page_size=2))\n"
        "    return MADE[-1]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = load_runtime("counted_runtime:factory", timeout=30)
    import counted_runtime  # type: ignore[import-not-found]

    assert len(counted_runtime.MADE) == 1
    assert factory() is counted_runtime.MADE[0]
    assert factory() is counted_runtime.MADE[1] and len(counted_runtime.MADE) == 2
    report = check_exhaustively(CheckConfig(requests=1, chunks=1), factory)
    assert report.ok and report.interleavings == report.total


def test_issue23_adapter_problem_names_every_missing_member() -> None:
    assert adapter_problem(ManagerAdapter()) is None
    assert adapter_problem(MUTANTS["release-in-flight"]()) is None
    problem = adapter_problem(None)
    assert problem is not None and "page_size" in problem and "start" in problem

    class NotAMethod(ManagerAdapter):
        poll = 3  # type: ignore[assignment]

    assert adapter_problem(NotAMethod()) == "not a RuntimeAdapter: missing poll"


@pytest.mark.parametrize(
    ("requests", "chunks", "returns", "return_chunks", "count"),
    [(1, 0, 1, 0, 36), (1, 1, 1, 0, 396), (2, 1, 1, 0, 37152), (2, 1, 1, 1, 127584)],
)
def test_interleaving_counts_with_a_returning_conversation(
    requests: int, chunks: int, returns: int, return_chunks: int, count: int
) -> None:
    cfg = CheckConfig(requests, chunks, returns=returns, return_chunks=return_chunks)
    assert count_interleavings(cfg) == count


def test_kvlife_keeps_every_rule_with_loads_in_every_interleaving() -> None:
    """A returning conversation's load among every completion order, abort and
    retraction of a small configuration (issue 25): kvlife's manager keeps every rule."""
    cfg = CheckConfig(requests=1, chunks=1, returns=1, reduction=False)
    report = check_exhaustively(cfg)
    assert report.ok, report.violations
    assert report.interleavings == report.total == 396 and report.deferred == 0


def test_an_adapter_without_restore_is_checked_without_returns() -> None:
    from mutant_runtimes import sglang_runtime

    cfg = CheckConfig(requests=1, chunks=1, returns=1, options=_options(3, False))
    report = check_exhaustively(cfg, sglang_runtime)
    assert report.ok and report.config.returns == 0


def test_returns_are_bounded() -> None:
    for bad in ({"returns": 3}, {"returns": -1}, {"chunks": 1, "return_chunks": 2}):
        with pytest.raises(ConfigError):
            CheckConfig(**bad)  # type: ignore[arg-type]


def test_issue36_9_a_stop_signal_ends_every_check_worker(tmp_path: Path) -> None:
    """Scenario: ``kvlife check --jobs 2`` on a walk of 67 million interleavings gets SIGHUP
    once both forked workers run. The command terminates both by PID and exits with
    128 + SIGHUP; the old one died at once and left its workers behind."""
    import signal
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_simulate import stop_command

    def workers(children: list[int]) -> list[int]:
        forked = [  # a forked worker has its parent's command line
            pid for pid in children if b"check" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]
        return forked if len(forked) == 2 else []

    argv = ["check", "--requests", "2", "--chunks", "3", "--returns", "0", "--jobs", "2"]
    argv.append("--json")
    status, left, files = stop_command(argv, tmp_path, signal.SIGHUP, workers)
    assert (status, left, files) == (128 + signal.SIGHUP, [], [])


# ----------------------------------------------------------------------- partial-order reduction


@pytest.mark.parametrize(
    ("cfg", "full", "runs", "blocked"),
    [
        (CheckConfig(), 140508, 6798, 2970),  # issue 35's "default of today"
        (CheckConfig(requests=2, chunks=1, returns=1), 37152, 5294, 2018),
        (CheckConfig(requests=2, chunks=2, options=_options(3, False)), 7659, 663, 339),
    ],
)
def test_the_reduction_runs_far_fewer_interleavings(
    cfg: CheckConfig, full: int, runs: int, blocked: int
) -> None:
    """Counted, not run: the full walk against the reduced walk's runs (its leaves, and
    the prefixes it blocked, each run closed); >= 10x fewer complete interleavings."""
    assert count_interleavings(cfg) == full
    assert count_runs(cfg) == runs
    assert full >= 10 * (runs - blocked)
    assert count_runs(replace(cfg, reduction=False)) == full


def test_the_dependency_relation() -> None:
    """What commutes, read off the relation written beside the model (_dependent)."""
    from kvlife.testing.events import Complete, Finish, Return, Start, Step
    from kvlife.testing.exhaustive import _dependent

    cfg = CheckConfig(requests=2, chunks=2, returns=1, return_chunks=1)
    step1 = (1, Step(1, (200, 201)))

    def dep(a: tuple[int, object], b: tuple[int, object], bounded: bool = False) -> bool:
        return _dependent(cfg, a, b, bounded) and _dependent(cfg, b, a, bounded)  # type: ignore[arg-type]

    c00 = (0, Complete(0, 0))
    assert dep(c00, (0, Complete(0, 1)))  # one life's acks: its chain's order
    assert not dep(c00, (0, Finish(0, FinishReason.FINISHED)))
    assert not dep(c00, (0, Step(0, (100, 101))))
    assert dep(c00, (0, Step(0, (100, 101))), bounded=True)  # a full host pool defers
    assert dep(c00, (2, Start("r", (1, 2, 3))))  # a new life on the rid
    assert dep(c00, (1, Return(0)))
    assert not dep(c00, step1) and not dep(c00, (2, Complete(2, 0)))
    load = (1, Complete(1, 0))
    assert dep(load, (1, Step(1, (200, 201))))  # the load lets its life decode
    assert dep(load, (2, Complete(2, 0)))  # a later store copy, both ok: pins
    assert not dep(load, (2, Complete(2, 0, ok=False))) and not dep(load, c00)
    assert dep(step1, (2, Step(2, (300, 301))), bounded=True)
    assert not dep(step1, (2, Step(2, (300, 301))))
    assert dep((-1, Poll()), c00)


def test_the_reduced_walk_finds_the_full_walks_bug_and_the_flag_keeps_the_full_walk(
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = CheckConfig(requests=2, chunks=1)
    full = check_exhaustively(replace(cfg, reduction=False), MUTANTS["late-ack-to-newest"])
    reduced = check_exhaustively(cfg, MUTANTS["late-ack-to-newest"])
    assert full.interleavings > 2 * reduced.interleavings
    assert reduced.violations[0].trace == full.violations[0].trace
    argv = ["check", "--requests", "2", "--chunks", "1", "--returns", "0", "--no-failures"]
    assert main([*argv, "--json", "--no-reduction"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (
        out["interleavings"]
        == out["total"]
        == out["full"]
        == count_interleavings(CheckConfig(2, 1, options=KitOptions(failures=False)))
    )


# ------------------------------------------------------------------------------- replay files


def test_replay_files_round_trip_every_event_and_refuse_another_version(tmp_path: Path) -> None:
    from kvlife.testing import replay as replays
    from kvlife.testing.events import Close, Complete, Finish, Resume, Return, Start, Step

    events = [
        Start("r", (1, 2, 3)),
        Step(0, (100, 101)),
        Finish(0, FinishReason.RETRACTED),
        Resume(0),
        Return(1),
        Complete(2, 0, ok=False, poll=False),
        Poll(),
        Close(),
    ]
    record = replays.Replay(events, KitOptions(stuck_after=1.5), "unreleased", seed=7)
    path = replays.save(record, directory=tmp_path, shrunk=False)
    data = json.loads(path.read_text())
    assert data["format"] == "kvlife-replay" and data["version"] == replays.FORMAT_VERSION
    assert data["kvlife"] and data["seed"] == 7 and data["trace"][3] == "resume life 0"
    again = replays.load(path)
    assert again.events == events and again.options == record.options

    data["version"] = 0
    data["kvlife"] = "0.0.9"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"version 0 \(written by kvlife 0.0.9\) is an older"):
        replays.load(path)
    assert main(["check", "--replay", str(path)]) == 2
    path.write_text("{}")
    with pytest.raises(ConfigError, match="not a kvlife replay file"):
        replays.load(path)


HOSTILE_REPLAYS: list[tuple[str, Any]] = [
    ("kind not a str", lambda d: d.update(kind=[])),
    ("a life index as a str", lambda d: d["events"][1].update(life="zero")),
    ("a negative life index", lambda d: d["events"][1].update(life=-1)),
    ("a life index of 10**30", lambda d: d["events"][1].update(life=10**30)),
    ("a fractional life index", lambda d: d["events"][1].update(life=0.5)),
    ("a bool for an index", lambda d: d["events"][1].update(life=True)),
    ("a prompt as a str", lambda d: d["events"][0].update(prompt="123")),
    ("an infinite token", lambda d: d["events"][0].update(prompt=[1, float("inf")])),
    ("ok as an int", lambda d: d["events"][2].update(ok=1)),
    ("runtime as an int", lambda d: d.update(runtime=5)),
    ("config without requests", lambda d: d.update(config={"chunks": 1})),
    ("config as a list", lambda d: d.update(config=[1])),
    ("events as a dict", lambda d: d.update(events={"kind": "poll"})),
    ("options as a list", lambda d: d.update(options=[])),
]


@pytest.mark.parametrize(("why", "spoil"), HOSTILE_REPLAYS, ids=[h[0] for h in HOSTILE_REPLAYS])
def test_a_spoiled_replay_file_is_refused_in_one_line_never_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], why: str, spoil: Any
) -> None:
    """A replay file edited by hand or damaged is refused as malformed (exit 2, one line),
    never run: before, these raised tracebacks (exit 1, like a bug reproduced) or ran and
    reported an error of their own as "STILL FAILS"."""
    from kvlife.testing import replay as replays
    from kvlife.testing.events import Complete, Start, Step

    events = [Start("r", (1, 2, 3)), Step(0, (100, 101)), Complete(0, 0)]
    record = replays.Replay(events, KitOptions(), "unreleased", config=CheckConfig().as_dict())
    path = replays.save(record, directory=tmp_path, shrunk=False)
    data = json.loads(path.read_text())
    spoil(data)
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["check", "--replay", str(path)]) == 2, why
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err


@pytest.mark.parametrize(
    "text", ["[" * 200_000 + "]" * 200_000, '{"format": ' + "9" * 5000 + "}"], ids=["deep", "long"]
)
def test_a_replay_file_json_cannot_hold_is_refused(tmp_path: Path, text: str) -> None:
    """Nesting past Python's recursion limit, or an integer past its digit limit: before,
    RecursionError and ValueError escaped the reader."""
    from kvlife.testing import replay as replays

    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(replays.ReplayFileError, match="cannot read it"):
        replays.load(path)


def test_a_vllm_manager_replay_without_vllm_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manager's file names its kind: without vLLM, --replay says what it needs (exit 2)
    instead of misreading its events as the kit's; an unknown kind is refused by name."""
    import importlib.util

    from kvlife.testing import replay as replays

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: tests/integration/test_vllm_kit.py re-runs these")
    path = tmp_path / "manager.json"
    data = {"format": "kvlife-replay", "version": replays.FORMAT_VERSION}
    path.write_text(json.dumps({**data, "kind": "vllm-manager", "events": [], "options": {}}))
    assert replays.kind_of(path) == "vllm-manager"
    with pytest.raises(replays.ReplayKindError, match=r"a vllm-manager replay .* not a kit one"):
        replays.load(path)
    assert main(["check", "--replay", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vllm-manager replay needs vLLM installed" in err[0], err
    path.write_text(json.dumps({**data, "kind": "nope", "events": [], "options": {}}))
    assert main(["check", "--replay", str(path)]) == 2
    assert "a replay of kind 'nope', which this kvlife does not know" in capsys.readouterr().err


def test_a_replay_file_is_shrunk_toward_the_fewest_events(tmp_path: Path) -> None:
    from kvlife.testing import replay as replays
    from kvlife.testing.events import Finish, Poll, Start, Step

    padded = [
        Start("r", (1, 2, 3)),
        Poll(),
        Step(0, (100, 101)),
        Poll(),
        Finish(0, FinishReason.ABORTED),
    ]
    options = KitOptions(stuck_after=2.0)
    shrunk = replays.shrink(MUTANTS["release-in-flight"], padded, options, "release-in-flight")
    assert [str(e) for e in shrunk] == [
        "start rid=r prompt=3 tokens",
        "step life 0 +2 tokens",
        "finish life 0 aborted",
    ]


# ------------------------------------------------------------------ coverage, default, bounds


def test_coverage_says_what_the_walk_reached_and_never_did(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvlife.testing.coverage import ROWS, RULES

    report = check_exhaustively(CheckConfig(requests=1, chunks=2, returns=1, return_chunks=1))
    cov = report.coverage.as_dict()
    assert set(cov["rules"]["reached"]) == set(RULES)  # every rule had something to judge
    reached, never = cov["rows"]["reached"], cov["rows"]["never"]
    assert set(reached) | set(never) == set(ROWS) and not set(reached) & set(never)
    assert "FINISHED --release[drained]--> RELEASED" in reached
    assert "OFFLOADING --ack[more_stores]--> OFFLOADING" in reached  # two chunks in flight
    # A returning life decodes only after its load: a store beside a load never happens.
    assert "LOADING --submit--> OFFLOADING" in never
    assert cov["refusals"]["never"] and not cov["refusals"]["reached"]  # kvlife refuses none
    argv = ["check", "--requests", "1", "--chunks", "1", "--returns", "0", "--no-failures"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "RELEASED" in str(out["coverage"]["rows"]["reached"])
    assert "load-bytes" in out["coverage"]["rules"]["never"]  # no load without a return
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "coverage, oracle rules:" in printed and "never: " in printed


def test_the_default_is_two_lives_with_stores_a_returning_load_and_failures() -> None:
    from kvlife.testing.command import DEFAULT

    cfg = DEFAULT
    assert cfg.lives == 2 and cfg.returns == 1 and cfg.chunks >= 1 and cfg.return_chunks >= 1
    assert cfg.options.failures and FinishReason.RETRACTED in cfg.options.reasons
    assert cfg.reduction
    assert count_interleavings(cfg) == 263700 and count_runs(cfg) == 10408


def test_jobs_are_bounded_by_the_cores(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.testing.command import _cores

    for bad in ("0", "-1", "x", str(_cores() + 1)):
        assert main(["check", "--requests", "1", "--chunks", "1", "--jobs", bad]) == 2
        assert "--jobs" in capsys.readouterr().err
