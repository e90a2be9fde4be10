"""Bad command-line input: one line on stderr and exit 2, never a traceback or a false verdict.

Each test runs the real ``kvlife`` command in a subprocess, as a user would.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kvlife(
    *args: str, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvlife", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
        cwd=cwd,
    )


def assert_refused(done: subprocess.CompletedProcess[str], command: str, says: str) -> None:
    """Exit 2, nothing on stdout, one line on stderr naming the command and the reason."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"kvlife {command}: ") and says in lines[0], lines[0]


def store_dirs(tmp_path: Path) -> list[Path]:
    """Store directories no run can create or write: under a file, under /proc, read-only."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    dirs = [a_file / "store", Path("/proc/kvlife-store")]
    if os.geteuid() != 0:  # root writes through the mode bits
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o555)
        dirs.append(read_only / "store")
    return dirs


def test_defect11_store_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    for store_dir in store_dirs(tmp_path):
        done = kvlife("simulate", "--json", "--requests", "5", "--store-dir", str(store_dir))
        assert_refused(done, "simulate", "store directory")


def test_defect11_unwritable_diagram_out_is_refused(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out in (a_file / "life.mmd", Path("/proc/kvlife-life.mmd")):
        assert_refused(kvlife("diagram", "--out", str(out)), "diagram", str(out))
        assert not out.exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--host-pages", "1000000000000"],
        ["--page-size", "1000000000"],
        ["--head-dim", "1000000000"],
        ["--concurrency", "1000000000"],
        ["--output-len", "1,1000000000000"],
    ],
)
def test_defect11_sizes_that_cannot_be_allocated_are_refused(flags: list[str]) -> None:
    assert_refused(kvlife("simulate", "--json", *flags), "simulate", "GiB")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--requests", "-1"], "requests"),
        (["--agreement-timeout", "nan"], "agreement timeout"),
        (["--agreement-timeout", "-1"], "agreement timeout"),
        (["--rank-copy-delays", "0,inf"], "copy_delay"),
        (["--host-pages", "1000000000000"], "GiB"),
        (["--store-dir", "/proc/kvlife-store"], "store directory"),
    ],
)
def test_defect12_bad_configuration_is_refused_before_any_rank_starts(
    flags: list[str], says: str
) -> None:
    done = kvlife("simulate", "--json", "--world-size", "2", *flags, timeout=30)
    assert_refused(done, "simulate", says)


@pytest.mark.parametrize("delay", ["inf", "nan", "1e9"])
def test_defect13_copy_delay_inf_is_refused(delay: str) -> None:
    done = kvlife("simulate", "--json", "--requests", "5", "--copy-delay", delay, timeout=30)
    assert_refused(done, "simulate", "copy_delay")


def test_defect14_a_used_store_dir_gives_no_false_failure(tmp_path: Path) -> None:
    """A second run (other seed, so other keys) in the same store verifies its own keys only."""
    reports = []
    for seed in ("1", "2"):
        done = kvlife(
            "simulate", "--json", "--requests", "30", "--seed", seed, "--store-dir", str(tmp_path)
        )
        assert done.returncode == 0, done.stdout + done.stderr
        reports.append(json.loads(done.stdout))
    first, second = reports
    assert first["ok"] and second["ok"]
    assert second["misfiled_pages"] == second["corrupted_pages"] == 0
    assert second["pages_verified"] == second["pages_stored"] > 0


#: Broken ``--runtime broken_runtime:factory`` modules: (source, what the refusal names).
BROKEN_RUNTIMES = {
    "factory-raises": ("def factory():\n    raise OSError('no GPU')\n", "OSError: no GPU"),
    "factory-returns-none": ("def factory():\n    return None\n", "returned None"),
    "factory-returns-an-int": ("def factory():\n    return 7\n", "returned 7"),
    "factory-needs-an-argument": ("def factory(n):\n    return n\n", "missing 1 required"),
    "import-raises": ("raise ValueError('bad config')\n", "ValueError: bad config"),
    "import-exits": ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
    "syntax-error": ("def factory(:\n", "SyntaxError"),
    "not-callable": ("factory = 3\n", "is not callable"),
    "half-an-adapter": (
        textwrap.dedent(
            """
            class Half:
                page_size = 2
                namespace = None
                def start(self, rid, prompt):
                    return rid
                step = 3  # not a method
            def factory():
                return Half()
            """
        ),
        "not a RuntimeAdapter: missing close, complete,",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_RUNTIMES))
def test_issue23_a_broken_runtime_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    """It was a traceback (exit 1), or a FAILED verdict naming AttributeError."""
    source, says = BROKEN_RUNTIMES[case]
    (tmp_path / "broken_runtime.py").write_text(source)
    done = kvlife("check", "--runtime", "broken_runtime:factory", cwd=tmp_path, timeout=60)
    assert_refused(done, "check", says)
    assert "broken_runtime" in done.stderr  # the refusal names the runtime


def test_issue23_a_relative_runtime_name_is_refused(tmp_path: Path) -> None:
    done = kvlife("check", "--runtime", ".broken_runtime:factory", cwd=tmp_path, timeout=60)
    assert_refused(done, "check", "relative")


@pytest.mark.parametrize(
    "source",
    [
        "import threading\nthreading.Event().wait()\n",  # the import never returns
        "import time\ndef factory():\n    time.sleep(3600)\n",  # the factory never returns
    ],
    ids=["import-blocks", "factory-blocks"],
)
def test_issue23_a_runtime_that_blocks_is_refused_at_the_deadline(
    tmp_path: Path, source: str
) -> None:
    """It hung for ever; now the import and the first factory call have --runtime-timeout."""
    (tmp_path / "blocking_runtime.py").write_text(source)
    t0 = time.monotonic()
    done = kvlife(
        "check", "--runtime", "blocking_runtime:factory", "--runtime-timeout", "1",
        cwd=tmp_path, timeout=60,
    )  # fmt: skip
    assert_refused(done, "check", "did not return within 1.0 s")
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf"])
def test_issue23_the_runtime_deadline_is_a_positive_finite_time(timeout: str) -> None:
    done = kvlife("check", "--runtime", "x:y", "--runtime-timeout", timeout, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "runtime-timeout" in done.stderr


def closed_port() -> int:
    """A loopback port nothing listens on (bound a moment ago, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: Mooncake's C++ client logs through glog on stderr, whatever kvlife says (its lines
#: start with a severity letter and a date, or glog's "Logging before" warning).
GLOG_LINE = re.compile(r"^([IWEF]\d{4} |WARNING: Logging before InitGoogleLogging)")


def test_issue23_simulate_with_no_mooncake_master_is_refused_before_any_rank(
    tmp_path: Path,
) -> None:
    """It spawned both ranks, each failed, and the command printed FAILED JSON with both
    tracebacks (exit 1); now the cluster is opened once, in the parent, and refused."""
    port = closed_port()
    done = kvlife(
        "simulate", "--json", "--requests", "5", "--world-size", "2", "--store", "mooncake",
        "--mooncake-master", f"127.0.0.1:{port}",
        "--mooncake-metadata", f"http://127.0.0.1:{port}/metadata",
        timeout=120,
    )  # fmt: skip
    try:
        import mooncake.store  # noqa: F401
    except ImportError:  # without the client the same one check refuses, naming it
        says = "mooncake"
    else:
        says = "is the master running?"
    kvlife_lines = "".join(
        line for line in done.stderr.splitlines(keepends=True) if not GLOG_LINE.match(line)
    )
    assert_refused(subprocess.CompletedProcess(done.args, done.returncode, done.stdout,
                                               kvlife_lines), "simulate", says)  # fmt: skip
