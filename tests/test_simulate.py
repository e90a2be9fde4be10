"""`kvlife simulate`: the end-to-end proof, and proof that the proof can fail."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest

from kvlife.engine.base import Ack
from kvlife.manager import OffloadManager, OffloadRequest
from kvlife.sim import SimConfig, run_simulation
from kvlife.sim.runtime import LAYOUTS, Simulation

sys.path.insert(0, str(Path(__file__).parent))
from rid_keyed_manager import RidKeyedManager

SMALL = {"requests": 150, "concurrency": 16, "rid_pool": 4}

JSON_FIELDS = {
    "requests",
    "lifecycles_released",
    "chunks_offloaded",
    "pages_stored",
    "pages_verified",
    "corrupted_pages",
    "leaked_host_pages",
    "leaked_device_pages",
    "refused_events",
    "invariant_violations",
    "offload_gbps",
    "elapsed_s",
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvlife_run_verifies_every_page(layout: str) -> None:
    # Aborts and retractions at 0.2 each: at the default 0.05 a run (whose steps follow the
    # copy thread's pace) had none in CI; at 0.2, 24 runs here had 11 and 8 or more.
    cfg = SimConfig(**SMALL, layout=layout, seed=3, abort_rate=0.2, retract_rate=0.2)
    report = run_simulation(cfg)
    assert report.ok, report.violations
    assert report.pages_stored > 0 and report.pages_verified == report.pages_stored
    assert report.lifecycles_released == report.lifecycles_started > report.requests
    assert report.retracted > 0 and report.aborted > 0 and report.chunks_offloaded > 0


def test_kvlife_run_with_faults_loses_nothing() -> None:
    """Copy and store failures drop pages from the store, never misfile or leak them.

    8 host pages run out at once whatever the copy thread's pace (24 ran out in most runs
    and in none in 2 of 10: the test failed in CI)."""
    cfg = SimConfig(**SMALL, seed=5, copy_fail_rate=0.2, store_fail_rate=0.2, host_pages=8)
    report = run_simulation(cfg)
    assert report.ok, report.violations
    assert report.copy_failures > 0 and report.store_failures > 0
    assert report.host_pool_exhausted > 0
    assert report.corrupted_pages == report.misfiled_pages == 0


def test_scenario_rid_keyed_bookkeeping_is_caught() -> None:
    """Scenario: the same runtime, same seed, with rid-keyed bookkeeping instead of kvlife.

    Reused rids and late acks land on the wrong request: the simulator must see
    pages stored under keys they do not belong to, and lives never released;
    kvlife's manager on the same run must be clean.
    """
    cfg = SimConfig(**SMALL, seed=11)
    good = run_simulation(cfg)
    bad = run_simulation(cfg, make_manager=RidKeyedManager)
    assert good.ok, good.violations
    assert not bad.ok
    assert bad.corrupted_pages + bad.misfiled_pages > 0
    assert bad.leaked_device_pages > 0 or bad.invariant_violations > 0


def test_nothing_outlives_its_request() -> None:
    """Every record, its Lifecycle and every ack are garbage once the request is done
    (weak references)."""
    lifecycles: list[weakref.ref[object]] = []

    class Recording(OffloadManager):
        def start(self, *args: Any, **kwargs: Any) -> OffloadRequest:
            req = super().start(*args, **kwargs)
            lifecycles.append(weakref.ref(req))
            lifecycles.append(weakref.ref(req._lifecycle))  # the manager's, reached for the test
            return req

    def factory(engine: Any, host: Any, store: Any, **kw: Any) -> Recording:
        return Recording(engine, host, store, **kw)

    report = run_simulation(SimConfig(**SMALL, seed=2), make_manager=factory)
    assert report.ok and len(lifecycles) == 2 * report.lifecycles_started
    gc.collect()
    alive = [ref() for ref in lifecycles if ref() is not None]
    assert alive == []
    assert not any(type(obj) is Ack for obj in gc.get_objects())


def test_command_json_and_exit_status(tmp_path: Path) -> None:
    args = ["--requests", "60", "--concurrency", "8", "--json", "--store-dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "kvlife", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.keys() >= JSON_FIELDS
    assert report["ok"] is True and report["requests"] == 60
    assert report["pages_verified"] == report["pages_stored"] > 0
    assert any((tmp_path / "sim").rglob("*.page"))  # the store directory was used


def test_command_refuses_bad_flags() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvlife", "simulate", "--abort-rate", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "rate" in done.stderr


@pytest.mark.parametrize(
    "flags",
    [
        ["--concurrency", "0"],
        ["--page-size", "0"],
        ["--stride", "3"],
        ["--requests", "-1"],
        ["--copy-delay", "-1"],
        ["--host-pages", "0"],
    ],
)
def test_command_refuses_bad_configurations_before_running(flags: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvlife", "simulate", "--json", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert "kvlife simulate:" in done.stderr and "Traceback" not in done.stderr


def test_defect13_copies_failing_for_a_real_reason_are_never_ok() -> None:
    """Copies that fail for a reason of their own (not the fault rate) make the run FAILED."""
    sim = Simulation(SimConfig(requests=20, concurrency=4, seed=1))
    sim.engine.copy_delay = math.inf  # past every check: each copy's wait overflows
    report = sim.run()
    assert report.copy_failures > 0 and not report.ok
    assert any("copies failed" in v and "OverflowError" in v for v in report.violations)


def test_issue23_an_unreachable_mooncake_is_refused_before_any_rank_is_spawned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run_distributed opens the store tier once, as a rank would, before it spawns one."""
    import socket

    from kvlife.errors import KVLifeError
    from kvlife.sim import distributed

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])  # closed again: no master answers there

    def spawn_ranks(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank was spawned for a store no rank can open")

    monkeypatch.setattr(distributed, "spawn_ranks", spawn_ranks)
    cfg = SimConfig(
        requests=5,
        store="mooncake",
        mooncake_master=f"127.0.0.1:{port}",
        mooncake_metadata=f"http://127.0.0.1:{port}/metadata",
    )
    with pytest.raises(KVLifeError, match=r"(?i)mooncake"):
        distributed.run_distributed(cfg, 2)


def test_returning_conversations_are_restored_and_checked_bit_for_bit() -> None:
    """Conversations return (a new request, often on a reused rid, whose prompt extends a
    finished one's tokens): their prefix is loaded from the host tier or the store and every
    restored page is compared with its key's values before the request decodes."""
    for keep in (True, False):
        report = run_simulation(SimConfig(**SMALL, seed=4, return_rate=0.5, keep_on_host=keep))
        assert report.ok, report.violations
        assert report.returns > 0 and report.restores > 0 and report.pages_restored > 0
        assert report.corrupted_restores == 0 and report.leaked_device_pages == 0


class _LoadsIntoTheNextPage(OffloadManager):
    """Seeded bug: a load writes each page one device page too far (the page table read
    from the wrong offset), so the restored prefix holds other KV."""

    def load(self, req: OffloadRequest, device_pages: Any, pages: int | None = None) -> Any:
        return super().load(req, list(device_pages)[1:], pages)


def test_a_load_that_writes_the_wrong_pages_fails_the_run() -> None:
    cfg = SimConfig(**SMALL, seed=4, return_rate=0.5)
    report = run_simulation(cfg, make_manager=_LoadsIntoTheNextPage)
    assert not report.ok and report.corrupted_restores > 0


def children_of(pid: int) -> list[int]:
    """PIDs of the live processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and waiting to be reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_for(what: str, check: Any, timeout: float = 60.0) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"no {what} after {timeout} s")


def stop_command(
    argv: list[str], tmp_path: Path, signum: int, workers: Any
) -> tuple[int, list[int], list[str]]:
    """Run ``kvlife *argv`` with its temporary directories under ``tmp_path/tmp``, wait
    until ``workers(children)`` names its worker processes, send ``signum`` to the command
    by PID; its exit status, the workers' PIDs still running, and what is left in
    ``tmp_path/tmp``. Workers left running are SIGKILLed by PID afterwards."""
    import os

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvlife", *argv],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    started: list[int] = []
    try:
        started = wait_for("worker processes", lambda: workers(children_of(proc.pid)))
        os.kill(proc.pid, signum)
        proc.wait(timeout=30)
        with contextlib.suppress(AssertionError):  # a moment for the kernel's SIGKILLs
            wait_for("workers ended", lambda: not any(map(alive, started)), timeout=5)
        left = [pid for pid in started if alive(pid)]
        return proc.returncode, left, sorted(p.name for p in tmp.iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:
            if alive(pid):
                os.kill(pid, 9)


def ranks(children: list[int]) -> list[int]:
    """The spawned ranks among ``children``: both, once both run."""
    spawned = [
        pid
        for pid in children
        if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    ]
    return spawned if len(spawned) == 2 else []


def test_issue36_9_a_stop_signal_ends_every_rank_and_removes_the_temporary_directories(
    tmp_path: Path,
) -> None:
    """Scenario: ``kvlife simulate --world-size 2`` with a long run gets SIGTERM (or SIGHUP)
    once its two ranks run. The command must end both ranks by PID and remove every
    temporary directory (the ranks' reports, their store) before it exits with 128 + the
    signal's number. The old command died at once: both ranks kept running at full CPU
    to the end of their run, and their directories stayed. (SIGHUP, SIGQUIT and SIGINT
    take the same path: ``tests/test_exhaustive.py`` stops ``kvlife check`` with SIGHUP.)"""
    import signal

    signum = signal.SIGTERM
    argv = ["simulate", "--world-size", "2", "--requests", "100000", "--json"]
    status, left, files = stop_command(argv, tmp_path, signum, ranks)
    assert (status, left, files) == (128 + signum, [], [])


def test_issue36_9_a_stopped_single_process_run_removes_its_store(tmp_path: Path) -> None:
    """One process: SIGTERM once its temporary store exists; it is removed, exit 143."""
    import signal

    argv = ["simulate", "--requests", "100000", "--json"]

    def store_made(children: list[int]) -> list[int]:
        return [1] if any((tmp_path / "tmp").glob("kvlife-sim-*/sim")) else []

    status, _, files = stop_command(argv, tmp_path, signal.SIGTERM, store_made)
    assert (status, files) == (128 + signal.SIGTERM, [])


@pytest.mark.slow
def test_issue36_9_ranks_die_with_a_command_killed_outright(tmp_path: Path) -> None:
    """SIGKILL, which no handler sees: the kernel ends the ranks with their parent
    (PR_SET_PDEATHSIG), so none runs on alone (a rank not yet past its imports when the
    command dies ends once it is: about 4 s here, hence slow)."""
    import signal

    argv = ["simulate", "--world-size", "2", "--requests", "100000", "--json"]
    status, left, _ = stop_command(argv, tmp_path, signal.SIGKILL, ranks)
    assert (status, left) == (-signal.SIGKILL, [])
