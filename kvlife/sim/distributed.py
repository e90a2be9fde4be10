"""``kvlife simulate --world-size N``: one simulated decode runtime per rank, in N real processes.

Each rank is a spawned process in one gloo group on 127.0.0.1 that runs the same
seeded :class:`~kvlife.sim.runtime.Simulation` with ``SimConfig(rank=r)`` and an
:class:`~kvlife.manager.OffloadManager` whose :class:`~kvlife.distributed.TorchAgreement`
makes the ranks apply the same acks in the same order and load the same prefixes. Why
that makes every rank submit the same sequence, and what a rank reports, is in
docs/distributed.md ("Host-pool exhaustion is an agreed decision", "Loads across
ranks", "Running N ranks").
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
import signal
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvlife.cli import child_of_a_command
from kvlife.distributed import TorchAgreement
from kvlife.errors import ConfigError
from kvlife.manager import OffloadManager
from kvlife.sim.runtime import SimConfig, SimManager, Simulation, make_store_dir

__all__ = [
    "check_store",
    "init_rank",
    "run_distributed",
    "run_rank",
    "spawn_ranks",
]


MAX_AGREEMENT_TIMEOUT_S = 86_400.0


def init_rank(rank: int, world_size: int, port: int, timeout: float) -> None:
    """Join the gloo group of ``world_size`` ranks whose rendezvous is 127.0.0.1:``port``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _end(procs: Sequence[Any]) -> None:
    """SIGKILL each process still running, by its PID, and reap it."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        if proc.pid is not None:
            proc.join()


def spawn_ranks(
    target: Callable[..., object], world_size: int, *args: Any, join_timeout: float = 600.0
) -> list[int | None]:
    """Run ``target(rank, world_size, port, *args)`` in ``world_size`` spawned processes.

    Returns each rank's exit code; a rank still running after ``join_timeout``
    seconds is killed and reported as ``None``, so a hung rank never hangs the caller.
    Whatever ends the wait early (a stop signal raised as an exception, Ctrl-C, an
    error) kills every rank by its PID before it propagates: no rank outlives the call.
    """
    ctx = mp.get_context("spawn")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # a port free a moment ago, for the rendezvous store
        port = int(sock.getsockname()[1])
    procs = [
        ctx.Process(target=target, args=(rank, world_size, port, *args))
        for rank in range(world_size)
    ]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + join_timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [proc for proc in procs if proc.is_alive()]
    finally:
        _end(procs)  # the hung ones; all of them if the wait was cut short
    return [None if proc in hung else proc.exitcode for proc in procs]


def _digest(items: Sequence[object]) -> str:
    return hashlib.sha256("\n".join(map(str, items)).encode()).hexdigest()[:16]


def run_rank(cfg: SimConfig, *, timeout: float = 60.0, group: Any = None) -> dict[str, Any]:
    """Simulate ``cfg`` as rank ``cfg.rank`` of an initialized process group; its figures."""
    agreements: list[TorchAgreement] = []

    def make_manager(engine: Any, host: Any, store: Any, **kwargs: Any) -> SimManager:
        agreements.append(TorchAgreement(group, timeout=timeout, host=host))
        return OffloadManager(engine, host, store, agreement=agreements[-1], **kwargs)

    sim = Simulation(cfg, make_manager)
    figures = sim.run().as_dict()
    (agreement,) = agreements
    figures.update(
        rank=cfg.rank,
        stored_keys=len(sim.stored_keys),
        stored_keys_digest=_digest(sim.stored_keys),
        releases=len(sim.releases),
        release_digest=_digest(sim.releases),
        agreement={
            "collectives": agreement.collectives,
            "chunks_agreed": agreement.chunks_agreed,
            "peer_failures": agreement.peer_failures,
            "collective_ms_mean": 1e3 * agreement.collective_s / max(1, agreement.collectives),
        },
    )
    return figures


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    configs: Sequence[SimConfig],
    timeout: float,
    out_dir: str,
    parent: int,
) -> None:
    """One spawned rank: join the group, simulate ``configs[rank]``, write ``rank<r>.json``."""
    child_of_a_command(parent)
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.json"
    try:
        init_rank(rank, world_size, port, timeout)
        figures = run_rank(configs[rank], timeout=timeout)
    except Exception as exc:  # reported in the JSON, never lost
        figures = {
            "rank": rank,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=8),
        }
    out.write_text(json.dumps(figures))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    if "error" in figures:
        os._exit(1)  # a peer may be gone: do not wait for the group's teardown


def check_store(cfg: SimConfig) -> None:
    """Open ``cfg``'s store tier once, here, as every rank will, and close it: a Mooncake
    cluster no rank could use (no master answering, no client installed) is refused with
    the one rank's own error (StoreUnavailable, MissingDependency) before any is spawned,
    not N times from N ranks. A directory tier is checked by ``make_store_dir``."""
    if cfg.store != "mooncake":
        return
    from kvlife.store.mooncake import MooncakeStore

    assert cfg.mooncake_master and cfg.mooncake_metadata  # SimConfig.check
    MooncakeStore(cfg.mooncake_master, cfg.mooncake_metadata, "sim/check").close()


def run_distributed(
    cfg: SimConfig,
    world_size: int,
    *,
    timeout: float = 60.0,
    copy_delays: Sequence[float] | None = None,
) -> dict[str, Any]:
    """Simulate ``world_size`` ranks in real processes; ``ok``, ``ranks_agreed``, ``per_rank``.

    ``copy_delays`` gives each rank its own copy delay (e.g. one slow rank).
    """
    # Refuse what no rank can use before anything is made or spawned.
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 < timeout <= MAX_AGREEMENT_TIMEOUT_S:
        raise ConfigError(
            f"the agreement timeout must be > 0 and <= {MAX_AGREEMENT_TIMEOUT_S} s, got {timeout}"
        )
    if copy_delays is not None and len(copy_delays) != world_size:
        raise ConfigError(f"{len(copy_delays)} copy delays for {world_size} ranks")
    delays = [cfg.copy_delay] * world_size if copy_delays is None else copy_delays
    configs = [replace(cfg, rank=rank, copy_delay=d) for rank, d in enumerate(delays)]
    for rank_cfg in configs:
        rank_cfg.check(processes=world_size)
    if cfg.store_dir:
        make_store_dir(cfg.store_dir)
    check_store(cfg)
    out_dir = tempfile.mkdtemp(prefix="kvlife-sim-ranks-")
    t0 = time.perf_counter()
    try:
        if cfg.store == "directory" and not cfg.store_dir:
            # The ranks' store (namespaces sim/rank<r>) lives in this process's temporary
            # directory, removed below whatever ends the run: a rank killed by PID never
            # leaves a directory of its own behind.
            store_dir = os.path.join(out_dir, "store")
            configs = [replace(c, store_dir=store_dir) for c in configs]
        codes = spawn_ranks(
            _rank_main,
            world_size,
            configs,
            timeout,
            out_dir,
            os.getpid(),
            join_timeout=max(600.0, 4 * timeout),
        )
        per_rank: list[dict[str, Any]] = []
        for rank, code in enumerate(codes):
            path = Path(out_dir) / f"rank{rank}.json"
            if path.exists():
                per_rank.append(json.loads(path.read_text()))
            else:
                why = "killed: no report in time" if code is None else f"exit code {code}"
                per_rank.append({"rank": rank, "ok": False, "error": f"no report ({why})"})
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    complete = all("error" not in r for r in per_rank)
    digests = {(r.get("stored_keys_digest"), r.get("release_digest")) for r in per_rank}
    agreed = complete and len(digests) == 1
    return {
        "world_size": world_size,
        "ok": complete and all(r["ok"] for r in per_rank),
        "ranks_agreed": agreed,
        "elapsed_s": time.perf_counter() - t0,
        "per_rank": per_rank,
    }
