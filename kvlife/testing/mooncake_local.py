"""A Mooncake cluster on loopback for tests, benchmarks and trying the store out.

:class:`LocalMooncake` starts a ``mooncake_master`` (with its HTTP metadata
server) and one ``mooncake_client`` memory pool on free ``127.0.0.1`` ports,
each a real process it knows by PID, and can kill either with SIGKILL and start
it again on the same ports. It is not how to run a production cluster (see
Mooncake's own documentation for that); it is the smallest real one.

Every process it starts, and the caller's own, must have
``MC_TCP_BIND_ADDRESS=127.0.0.1``, or the client advertises the machine's
external address: :meth:`LocalMooncake.start` sets it in this process too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvlife.errors import ConfigError, MissingDependency, StoreUnavailable
from kvlife.store.mooncake import load_client_class

__all__ = ["LocalMooncake", "free_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the time of the call."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _start_failed(name: str, why: str) -> StoreUnavailable:
    return StoreUnavailable(f"mooncake {name} {why}", code=-1, call=f"start_{name}")


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


class LocalMooncake:
    """One master and one memory pool on loopback ports, started and stopped by PID."""

    def __init__(self, pool_size: str = "512MB", log_dir: str | os.PathLike[str] | None = None):
        for binary in ("mooncake_master", "mooncake_client"):
            if shutil.which(binary) is None:
                raise MissingDependency(
                    f"{binary} is not on PATH: pip install 'kvlife[mooncake]' in this environment"
                )
        load_client_class()  # the library loads (libibverbs.so.1 is there)
        if not pool_size or not pool_size[0].isdigit():
            raise ConfigError(f"pool size must be like 512MB or 1GB, got {pool_size!r}")
        self.pool_size = pool_size
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.pool_port = free_port()
        self._own_logs = log_dir is None
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kvlife-mooncake-"))
        self.master_proc: subprocess.Popen[bytes] | None = None
        self.pool_proc: subprocess.Popen[bytes] | None = None
        self._env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    @property
    def master(self) -> str:
        """The master's HOST:PORT (``--mooncake-master``)."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        """The metadata server's URL (``--mooncake-metadata``)."""
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        try:
            return subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=self._env, start_new_session=True
            )
        finally:
            log.close()

    def start_master(self, timeout: float = 20.0) -> None:
        """Start the master (and its metadata server); return once both answer."""
        self.master_proc = self._spawn(
            "master",
            [
                "mooncake_master",
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
            ],
        )
        self._wait(self.master_proc, "master", timeout, [self.rpc_port, self.http_port])

    def start_pool(self, timeout: float = 20.0) -> None:
        """Start the memory pool; return once the master has its segment."""
        self.pool_proc = self._spawn(
            "pool",
            [
                "mooncake_client",
                "--host=127.0.0.1",
                f"--port={self.pool_port}",
                f"--global_segment_size={self.pool_size}",
                f"--master_server_address={self.master}",
                f"--metadata_server={self.metadata}",
                "--protocol=tcp",
            ],
        )
        deadline = time.monotonic() + timeout
        while not self._pool_mounted():  # the pool registers with the master shortly after
            if time.monotonic() > deadline or self.pool_proc.poll() is not None:
                why = f"did not register with the master; see {self.log_dir}/pool.log"
                raise _start_failed("pool", why)
            time.sleep(0.05)

    def _pool_mounted(self) -> bool:
        """Whether the master's metrics show pool capacity (the pool's segment) yet."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                text = response.read().decode(errors="replace")
        except OSError:
            return False
        for line in text.splitlines():
            if line.startswith(("master_total_capacity_bytes", "mooncake_master_total_capacity")):
                with contextlib.suppress(ValueError, IndexError):
                    return float(line.split()[-1]) > 0
        return True  # no such metric in this version: the pool process is up, assume mounted

    def _wait(
        self, proc: subprocess.Popen[bytes], name: str, timeout: float, ports: list[int]
    ) -> None:
        deadline = time.monotonic() + timeout
        while not all(_listening(p) for p in ports):
            if proc.poll() is not None:
                why = f"exited with {proc.returncode}; see {self.log_dir}/{name}.log"
                raise _start_failed(name, why)
            if time.monotonic() > deadline:
                self._kill(proc)
                raise _start_failed(name, f"not listening after {timeout} s")
            time.sleep(0.05)

    def start(self) -> LocalMooncake:
        """Start the master, then the pool; sets MC_TCP_BIND_ADDRESS=127.0.0.1 here."""
        os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
        self.start_master()
        try:
            self.start_pool()
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def kill_master(self) -> None:
        """SIGKILL the master (by PID); its data is gone with it."""
        self._kill(self.master_proc)

    def kill_pool(self) -> None:
        """SIGKILL the memory pool (by PID); the pages it held are gone with it."""
        self._kill(self.pool_proc)

    def stop(self) -> None:
        """Kill the pool and the master (by PID); idempotent."""
        self._kill(self.pool_proc)
        self._kill(self.master_proc)
        if self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalMooncake:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
