"""``kvlife simulate --world-size N``: one simulated decode runtime per rank, in N real processes.

Each rank is a process (``torch.multiprocessing``, spawn) in one gloo group on
127.0.0.1. It runs the same seeded :class:`~kvlife.sim.runtime.Simulation` with
``SimConfig(rank=r)``: its own shard of KV values, its own copy engine, host
pool and store namespace, and an :class:`~kvlife.manager.OffloadManager` whose
:class:`~kvlife.distributed.TorchAgreement` makes the ranks apply the same acks
in the same order.

Why the ranks submit the same sequence: the simulator draws requests, lengths,
aborts and retractions from its seed, so every rank makes the same decisions,
*provided* everything that feeds back from the asynchronous parts is agreed:

- acks: a chunk is applied on every rank in the same poll, in submission order,
  so releases, and with them device page reuse, are identical;
- copy failures: a copy that failed on any rank is applied as failed on all;
- host pool exhaustion: host pages come back when each rank's store finishes a
  write, at different times, so a rank-local "pool full" would make one rank
  skip a chunk another submits. The manager asks the agreement (``admit``)
  before it allocates, and the agreement answers from the MIN of free pages
  over ranks at the last poll, so a full pool on one rank stops all ranks alike;
- store failures are drawn from the store's seed in put order, which the
  agreement fixes.

A rank's figures: its :class:`~kvlife.sim.runtime.SimReport`, the number and a
digest of its stored keys, the number and a digest of its release sequence
(lives in start order, released in this order), and the agreement's counters.
``ranks_agreed`` is true when every rank reports identical stored keys and
identical release sequences.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import shutil
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

from kvlife.distributed import TorchAgreement
from kvlife.errors import ConfigError
from kvlife.manager import OffloadManager, OffloadRequest, ReleaseHandler
from kvlife.sim.runtime import (
    SimConfig,
    SimManager,
    Simulation,
    make_store_dir,
)

__all__ = [
    "RecordingManager",
    "check_ranks",
    "free_port",
    "init_rank",
    "run_distributed",
    "run_rank",
    "spawn_ranks",
]


MAX_AGREEMENT_TIMEOUT_S = 86_400.0


def check_ranks(
    cfg: SimConfig, world_size: int, timeout: float, copy_delays: Sequence[float] | None
) -> None:
    """Refuse a run of ``world_size`` ranks no rank can use (:class:`ConfigError`)."""
    if world_size < 1:
        raise ConfigError(f"world_size must be >= 1, got {world_size}")
    if not 0 < timeout <= MAX_AGREEMENT_TIMEOUT_S:
        raise ConfigError(
            f"the agreement timeout must be > 0 and <= {MAX_AGREEMENT_TIMEOUT_S} s, got {timeout}"
        )
    if copy_delays is not None and len(copy_delays) != world_size:
        raise ConfigError(f"{len(copy_delays)} copy delays for {world_size} ranks")
    for delay in copy_delays or [cfg.copy_delay]:
        replace(cfg, copy_delay=delay).check(processes=world_size)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the rendezvous store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_rank(rank: int, world_size: int, port: int, timeout: float) -> None:
    """Join the gloo group of ``world_size`` ranks whose rendezvous is 127.0.0.1:``port``."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )


def spawn_ranks(
    target: Callable[..., object],
    world_size: int,
    *args: Any,
    join_timeout: float = 600.0,
) -> list[int | None]:
    """Run ``target(rank, world_size, port, *args)`` in ``world_size`` spawned processes.

    Returns each rank's exit code; a rank still running after ``join_timeout``
    seconds is killed and reported as ``None``, so a hung rank never hangs the caller.
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(rank, world_size, port, *args))
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + join_timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    codes: list[int | None] = []
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
            codes.append(None)
        else:
            codes.append(proc.exitcode)
    return codes


class RecordingManager(OffloadManager):
    """An :class:`OffloadManager` that records the order in which its lives are released.

    Each life is numbered in start order (the same on every rank); the release
    sequence is the list of those numbers in release order.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Start number of each released life, in release order.
        self.releases: list[int] = []
        self._lives = 0

    def start(
        self,
        rid: object,
        prompt: Sequence[int],
        on_release: ReleaseHandler | None = None,
        *,
        prior_hash: str | None = None,
    ) -> OffloadRequest:
        """Start a life as the base class does, recording its release."""
        life = self._lives
        self._lives += 1
        releases = self.releases

        def recorded(lc: OffloadRequest, pages: Sequence[int]) -> object:
            releases.append(life)
            return on_release(lc, pages) if on_release is not None else None

        return super().start(rid, prompt, recorded, prior_hash=prior_hash)


def _digest(items: Sequence[object]) -> str:
    return hashlib.sha256("\n".join(map(str, items)).encode()).hexdigest()[:16]


def run_rank(cfg: SimConfig, *, timeout: float = 60.0, group: Any = None) -> dict[str, Any]:
    """Run this rank's simulation in an initialized process group; its figures as a dict.

    ``cfg.rank`` should be this process's rank. The store directory is kept
    (pass ``cfg.store_dir``) so that its keys can be listed after the run.
    """
    own_dir = not cfg.store_dir
    store_dir = make_store_dir(cfg.store_dir)
    built: dict[str, Any] = {}

    def make_manager(engine: Any, host: Any, store: Any, **kwargs: Any) -> SimManager:
        agreement = TorchAgreement(group, timeout=timeout, host=host)
        manager = RecordingManager(engine, host, store, agreement=agreement, **kwargs)
        built.update(agreement=agreement, manager=manager)
        return manager

    try:
        sim = Simulation(replace(cfg, store_dir=store_dir), make_manager)
        report = sim.run()
        keys = sim.stored_keys
    finally:
        if own_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
    agreement: TorchAgreement = built["agreement"]
    releases: list[int] = built["manager"].releases
    figures = report.as_dict()
    figures.update(
        rank=cfg.rank,
        stored_keys=len(keys),
        stored_keys_digest=_digest(keys),
        releases=len(releases),
        release_digest=_digest(releases),
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
    cfg: SimConfig,
    timeout: float,
    out_dir: str,
    copy_delays: Sequence[float] | None,
) -> None:
    """One spawned rank: join the group, simulate, write ``rank<r>.json``."""
    torch.set_num_threads(1)
    out = Path(out_dir) / f"rank{rank}.json"
    code = 0
    try:
        init_rank(rank, world_size, port, timeout)
        delay = cfg.copy_delay if copy_delays is None else copy_delays[rank]
        figures = run_rank(replace(cfg, rank=rank, copy_delay=delay), timeout=timeout)
    except Exception as exc:  # reported in the JSON, never lost
        figures = {
            "rank": rank,
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(limit=8),
        }
        code = 1
    out.write_text(json.dumps(figures))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    if code:
        os._exit(code)  # a peer may be gone: do not wait for the group's teardown


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
    check_ranks(cfg, world_size, timeout, copy_delays)  # before anything is made or spawned
    own_dir = not cfg.store_dir
    store_dir = make_store_dir(cfg.store_dir)
    out_dir = tempfile.mkdtemp(prefix="kvlife-sim-ranks-")
    t0 = time.perf_counter()
    try:
        codes = spawn_ranks(
            _rank_main,
            world_size,
            replace(cfg, store_dir=store_dir),
            timeout,
            out_dir,
            None if copy_delays is None else list(copy_delays),
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
        if own_dir:
            shutil.rmtree(store_dir, ignore_errors=True)
    complete = all("error" not in r for r in per_rank)
    agreed = complete and all(
        (r["stored_keys_digest"], r["release_digest"])
        == (per_rank[0]["stored_keys_digest"], per_rank[0]["release_digest"])
        for r in per_rank
    )
    return {
        "world_size": world_size,
        "ok": complete and all(r["ok"] for r in per_rank),
        "ranks_agreed": agreed,
        "elapsed_s": time.perf_counter() - t0,
        "per_rank": per_rank,
    }
