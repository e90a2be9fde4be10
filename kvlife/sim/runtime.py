"""A decode runtime simulated with real parts, that proves no KV page is lost or misfiled.

The run is described in the README ("The main job"). It is verifiable because a
page's KV values are a pure function of its hash-chain key (:func:`page_values`)
and token ids of the prompt and position (a greedy "model", :func:`next_token`);
prompts come from a fixed pool, so the keys, and the store, stay bounded.

The manager under test is pluggable (:class:`SimManager`): kvlife's
:class:`~kvlife.manager.OffloadManager` by default; a rid-keyed variant in the
tests shows that the check fails where the bookkeeping is wrong.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

from kvlife._lifecycle import FinishReason
from kvlife.engine.cpu import CpuCopyEngine
from kvlife.errors import ConfigError, KVLifeError, StoreError
from kvlife.hashing import sglang_page_hashes
from kvlife.layout import KVLayout, LayerFirstLayout, MLALayout, PageFirstLayout
from kvlife.manager import OffloadManager
from kvlife.pool import HostPagePool
from kvlife.store.base import QueuedStore

__all__ = ["SimConfig", "SimManager", "SimReport", "make_store_dir", "run_simulation"]


VOCAB = 32_000
POISON = -7.0
STALL_S = 2.0  # seconds with nothing decoding before a run is declared stalled
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LAYOUTS = ("layer-first", "page-first", "mla")
STORES = ("directory", "mooncake")
MAX_COPY_DELAY_S = 10.0  # a copy slower than this is no simulated copy: a run would never end
TOKEN_BYTES = 40  # a token id in a Python list: the pointer and the int


def make_store_dir(store_dir: str | None) -> str:
    """``store_dir``, made if missing, or a new temporary directory; refuse one no run can write."""
    if not store_dir:
        return tempfile.mkdtemp(prefix="kvlife-sim-")
    try:
        Path(store_dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the store directory: {exc}") from None
    if not os.access(store_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"the store directory {store_dir} is not writable")
    return store_dir


@dataclass
class SimConfig:
    """Everything a run depends on; the same config and seed give the same run."""

    requests: int = 2000
    concurrency: int = 32
    rid_pool: int = 8
    prompt_pool: int = 64
    page_size: int = 16
    stride: int | None = None
    layers: int = 2
    heads: int = 2
    head_dim: int = 32
    layout: str = "layer-first"
    dtype: str = "bfloat16"
    seed: int = 0
    store_dir: str | None = None
    copy_delay: float = 0.002
    copy_fail_rate: float = 0.0
    store_fail_rate: float = 0.0
    abort_rate: float = 0.05
    retract_rate: float = 0.05
    #: Chance that an admitted request is a conversation returning (often on a reused rid):
    #: its prompt extends a finished request's tokens, and its prefix is loaded, not recomputed.
    return_rate: float = 0.3
    #: Load prefixes (returning conversations, resumed requests) instead of recomputing
    #: them; off, the run is the store half only (and prompt pages are not stored).
    restores: bool = True
    #: Written pages stay on the host tier as a cache (kvlife's manager), so a returning
    #: prefix may load from host memory instead of the store.
    keep_on_host: bool = True
    prompt_len: tuple[int, int] = (4, 48)
    output_len: tuple[int, int] = (8, 96)
    host_pages: int = 1024
    #: This process's rank in a tensor-parallel group: its KV shard's values and
    #: its store namespace differ per rank (keys do not: all ranks share the chain).
    rank: int = 0
    #: The store tier: a directory (``store_dir``) or a Mooncake cluster.
    store: str = "directory"
    #: The Mooncake master's HOST:PORT and metadata URL (``store="mooncake"``).
    mooncake_master: str | None = None
    mooncake_metadata: str | None = None

    @property
    def page_numel(self) -> int:
        """Elements in one page of KV (every layer's K and V, or MLA's one latent)."""
        kv = 1 if self.layout == "mla" else 2
        return kv * self.layers * self.page_size * self.heads * self.head_dim

    @property
    def device_pages(self) -> int:
        """Device pool size: every active request at full length, and as much again for
        finished ones whose copies still drain."""
        max_tokens = self.prompt_len[1] + self.output_len[1] + 1
        return 2 * self.concurrency * -(-max_tokens // self.page_size)

    def memory_needed(self) -> int:
        """Bytes a run allocates up front: device and host pools, and the prompts."""
        pages = self.device_pages + self.host_pages + 1  # + the poison page
        tokens = self.prompt_pool * self.prompt_len[1]
        return pages * self.page_numel * DTYPES[self.dtype].itemsize + tokens * TOKEN_BYTES

    def check(self, processes: int = 1) -> None:
        """Refuse a configuration no run can use, with the field named (:class:`ConfigError`).

        Nothing is allocated, created or started: the memory ``processes`` runs
        need is computed, and refused if it exceeds this machine's.
        """
        positive = "concurrency rid_pool prompt_pool page_size layers heads head_dim host_pages"
        for name in positive.split():
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.requests < 0 or self.rank < 0:
            raise ConfigError("requests and rank must be >= 0")
        if self.stride is not None and self.stride < self.page_size:
            raise ConfigError(f"stride {self.stride} is shorter than a page of {self.page_size}")
        for name, allowed in (("layout", LAYOUTS), ("store", STORES), ("dtype", sorted(DTYPES))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.store == "mooncake" and not (self.mooncake_master and self.mooncake_metadata):
            raise ConfigError(
                "store mooncake needs the master's HOST:PORT and the metadata URL "
                "(--mooncake-master, --mooncake-metadata, or MOONCAKE_MASTER and "
                "MOONCAKE_TE_META_DATA_SERVER)"
            )
        if not 0 <= self.copy_delay <= MAX_COPY_DELAY_S:
            raise ConfigError(
                f"copy_delay must be 0 to {MAX_COPY_DELAY_S} seconds, got {self.copy_delay}"
            )
        for name in ("copy_fail_rate", "store_fail_rate", "abort_rate", "retract_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ConfigError(f"{name} must be 0 < low <= high, got {(low, high)}")
        try:
            have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            have = 2**63  # no limit where it cannot be read
        needed = processes * self.memory_needed()
        if needed > have:
            raise ConfigError(
                f"this configuration needs {needed / 2**30:.1f} GiB; "
                f"this machine has {have / 2**30:.1f} GiB"
            )


@dataclass
class SimReport:
    """What a run found. ``ok`` is false on any corruption, leak or violation."""

    requests: int = 0
    lifecycles_started: int = 0
    lifecycles_released: int = 0
    finished: int = 0
    aborted: int = 0
    retracted: int = 0
    chunks_offloaded: int = 0
    pages_stored: int = 0
    pages_verified: int = 0
    #: Puts that found the page stored with the same bytes (by any run, or this one).
    pages_found_stored: int = 0
    pages_written: int = 0  # puts that wrote the page
    #: Pages a store that may lose them (Mooncake: evicted, or gone with a killed
    #: master or pool) no longer had, or could not be read back, at the end.
    pages_missing: int = 0
    corrupted_pages: int = 0
    misfiled_pages: int = 0
    leaked_host_pages: int = 0
    leaked_device_pages: int = 0
    refused_events: int = 0
    invariant_violations: int = 0
    copy_failures: int = 0
    store_failures: int = 0
    host_pool_exhausted: int = 0
    #: Returning conversations, the prefix pages loaded back (each checked bit for bit before
    #: the request decodes), lookups that stopped at a page still being written, loads that
    #: failed (recomputed), and restored pages that held other bytes (a failure).
    returns: int = 0
    restores: int = 0
    pages_restored: int = 0
    lookups_pending: int = 0
    load_failures: int = 0
    corrupted_restores: int = 0
    offload_gbps: float = 0.0
    elapsed_s: float = 0.0
    violations: list[str] = field(default_factory=list)
    #: The figures that fail a run (:attr:`ok`) when not zero.
    FAILURES: ClassVar[tuple[str, ...]] = (
        "corrupted_pages",
        "misfiled_pages",
        "leaked_host_pages",
        "leaked_device_pages",
        "invariant_violations",
        "corrupted_restores",
    )

    @property
    def ok(self) -> bool:
        """No corruption, no misfiled page, no leak, no violated invariant."""
        return not any(getattr(self, name) for name in self.FAILURES)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``ok``; the first few violations only."""
        out = asdict(self)
        out["violations"] = self.violations[:20]
        out["ok"] = self.ok
        return out


ReleaseFn = Callable[[Any, Sequence[int]], object]


class SimManager(Protocol):
    """What the simulator needs of an offload manager (kvlife's fits as it is)."""

    def start(self, rid: object, prompt: Sequence[int], on_release: ReleaseFn) -> Any: ...
    def offload(self, lc: Any, tokens: Sequence[int], device_pages: Sequence[int]) -> object: ...
    def finish(self, lc: Any, reason: FinishReason = ...) -> None: ...
    def poll(self) -> None: ...
    def close(self, timeout: float | None = None) -> None: ...


ManagerFactory = Callable[..., SimManager]


def page_values(key: str, numel: int, dtype: torch.dtype, rank: int = 0) -> torch.Tensor:
    """The KV values of the page whose key is ``key`` on ``rank``'s shard: a pure function."""
    gen = torch.Generator().manual_seed(int(key[:15], 16) ^ (rank * 0x9E3779B97F4A7C15 % 2**60))
    return torch.randn(numel, generator=gen).to(dtype)


def next_token(prompt_id: int, position: int) -> int:
    """The greedy "model": the token at ``position`` of any request with this prompt."""
    return (prompt_id * 1_000_003 + position * 7_919 + 17) % VOCAB


@dataclass(slots=True, eq=False)
class _Request:
    """One request as the runtime sees it, across lives (a retraction starts a new life)."""

    rid: str
    prompt_id: int
    tokens: list[int]
    target: int
    pages: list[int] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # the chain over every whole page with KV
    written: int = 0  # pages whose values are on the device
    handle: Any = None
    loading: int = 0  # pages a load in flight writes (the request waits for them)


class Simulation:
    """One run: build the parts, decode every request, verify, report."""

    def __init__(
        self,
        cfg: SimConfig,
        make_manager: ManagerFactory = OffloadManager,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        cfg.check()
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        #: Whether stored pages may vanish without a fault of kvlife's (a cache tier).
        self._may_lose = cfg.store == "mooncake"
        self._own_dir = cfg.store == "directory" and not cfg.store_dir
        # The store tier: rank r's pages under the namespace sim/rank<r>.
        namespace = f"sim/rank{cfg.rank}"
        # kvlife's stores plus fault injection (none at store_fail_rate 0).
        from kvlife.testing.faults import FaultyDirectoryStore, FaultyMooncakeStore

        faults: dict[str, Any] = {"fail_rate": cfg.store_fail_rate, "seed": cfg.seed}
        if cfg.store == "mooncake":
            assert cfg.mooncake_master and cfg.mooncake_metadata  # SimConfig.check
            self.store_dir = ""
            self.store: QueuedStore = FaultyMooncakeStore(
                cfg.mooncake_master, cfg.mooncake_metadata, namespace, **faults
            )
        else:
            self.store_dir = make_store_dir(cfg.store_dir)
            self.store = FaultyDirectoryStore(self.store_dir, namespace, **faults)
        #: Keys stored before this run (a reused store directory): not this run's to verify.
        self.keys_before = set(self.store.keys())
        #: Keys this run added to the store, found by :meth:`run`.
        self.stored_keys: list[str] = []
        dtype, shape = DTYPES[cfg.dtype], (cfg.layers, cfg.device_pages, cfg.page_size)
        if cfg.layout == "mla":
            self.layout: KVLayout = MLALayout.zeros(*shape, cfg.heads * cfg.head_dim, dtype)
        else:
            paged = LayerFirstLayout if cfg.layout == "layer-first" else PageFirstLayout
            self.layout = paged.zeros(*shape, cfg.heads, cfg.head_dim, dtype)
        #: Free device pages, LIFO: a freed page is reused at once, as real allocators do.
        self.free: list[int] = list(range(cfg.device_pages - 1, -1, -1))
        self.poison = torch.full((self.layout.page_numel,), POISON).to(self.layout.dtype)
        self.host = HostPagePool(cfg.host_pages, self.layout.page_numel, self.layout.dtype)
        self.engine = CpuCopyEngine(
            self.layout,
            self.host,
            copy_delay=cfg.copy_delay,
            delay_jitter=cfg.copy_delay,
            seed=cfg.seed,
            fail_rate=cfg.copy_fail_rate,
        )
        tier = {}  # only kvlife's own manager has a host tier to keep pages on
        if isinstance(make_manager, type) and issubclass(make_manager, OffloadManager):
            tier = {"keep_on_host": cfg.keep_on_host}
        self.manager = make_manager(
            self.engine, self.host, self.store, page_size=cfg.page_size, stride=cfg.stride, **tier
        )
        self.progress = progress
        self.report = SimReport(requests=cfg.requests)
        self.expected_keys: set[str] = set()
        self.prompts = [  # the tokens before position 0 of the greedy model
            [next_token(i, -1 - j) for j in range(self.rng.randint(*cfg.prompt_len))]
            for i in range(cfg.prompt_pool)
        ]
        self.waiting: deque[_Request] = deque()  # retracted, to resume
        #: Finished conversations that may return: (prompt id, their tokens).
        self.history: deque[tuple[int, list[int]]] = deque(maxlen=256)
        # A manager with a load half (kvlife's; across ranks too: its loads are agreed).
        self._load = getattr(self.manager, "load", None) if cfg.restores else None
        self._lookup = getattr(self.manager, "lookup", None)
        self.active: list[_Request] = []
        self.unreleased: set[int] = set()  # lives started and not yet released
        #: Every release's life, numbered in start order: the same on every rank of a group.
        self.releases: list[int] = []
        self.admitted = 0
        self.done = 0

    def run(self) -> SimReport:
        """Decode every request to its end, close, verify; the report."""
        t0 = time.perf_counter()
        try:
            stalled_since: float | None = None
            while self.done < self.cfg.requests:
                self._admit()
                self._step()
                self.manager.poll()
                if self.active:
                    stalled_since = None
                elif stalled_since is None:
                    stalled_since = time.perf_counter()
                elif time.perf_counter() - stalled_since > STALL_S:
                    # Nothing decodes and no release frees a page: pages leaked.
                    self._violation(
                        f"stalled: no request could start for {STALL_S} s "
                        f"({len(self.free)} device pages free)"
                    )
                    break
                else:
                    time.sleep(0.0005)  # waiting on copies and writes only
            self.manager.close(timeout=60)
            self.report.elapsed_s = time.perf_counter() - t0
            self._account()
            self._verify()
        finally:
            self.engine.close()
            self.store.close()
            stats = self.store.stats()
            self.report.pages_found_stored = stats.pages_deduplicated
            self.report.pages_written = stats.pages_written
            if self._own_dir:
                shutil.rmtree(self.store_dir, ignore_errors=True)
        return self.report

    def _admit(self) -> None:
        cfg = self.cfg
        while len(self.active) < cfg.concurrency:
            if self.waiting:
                req = self.waiting.popleft()
            elif self.admitted < cfg.requests:
                rid = f"rid-{self.rng.randrange(cfg.rid_pool)}"
                if self.history and self._load and self.rng.random() < cfg.return_rate:
                    prompt_id, before = self.history[self.rng.randrange(len(self.history))]
                    tokens = list(before)  # the conversation so far: its prefix is stored
                    self.report.returns += 1
                else:
                    prompt_id = self.rng.randrange(cfg.prompt_pool)
                    tokens = list(self.prompts[prompt_id])
                target = len(tokens) + self.rng.randint(*cfg.output_len)
                req = _Request(rid, prompt_id, tokens, target)
                self.admitted += 1
            else:
                return
            if not self._start_life(req):
                self.waiting.appendleft(req)
                return
            self.active.append(req)

    def _start_life(self, req: _Request) -> bool:
        """Prefill ``req`` (again, after a retraction) into fresh device pages."""
        needed = -(-(len(req.tokens) + 1) // self.cfg.page_size)
        if len(self.free) < needed:
            return False
        req.pages = [self.free.pop() for _ in range(needed)]
        req.written = 0
        self.report.lifecycles_started += 1
        life = self.report.lifecycles_started  # lives are numbered in start order
        self.unreleased.add(life)
        req.handle = self.manager.start(
            req.rid, req.tokens, lambda handle, pages: self._released(req, life, handle, pages)
        )
        req.loading = self._restore(req) if self._load is not None else 0
        computed = req.written
        self._write_pages(req, len(req.tokens))  # prefill computed the rest of the prompt's KV
        if req.written > computed and self._load is not None:  # the prefill side stored them
            rows = torch.stack(
                [self.layout.read_page(p) for p in req.pages[computed : req.written]]
            )
            self.store.put(("prefill", life), req.keys[computed : req.written], rows)
        return True

    def _restore(self, req: _Request) -> int:
        """Load what the tiers hold of the prompt's prefix (its pages stay poison until the
        load's copy writes them); the pages loading, which prefill does not compute."""
        assert self._lookup is not None and self._load is not None
        found = self._lookup(req.tokens)
        if found.pending:
            self.report.lookups_pending += 1
        if not found.ready:
            return 0
        for page in req.pages[: found.ready]:
            self.layout.write_page(page, self.poison)
        ticket = self._load(req.handle, req.pages)
        if ticket is None:
            return 0
        n = len(ticket.keys)
        req.keys = list(ticket.keys)  # the chain of those pages (equal to what prefill makes)
        req.written = n
        self.report.restores += 1
        return n

    def _restored(self, req: _Request) -> None:
        """The load ended: check every restored page bit for bit (or recompute after a
        failed load), before the request decodes."""
        n, req.loading = req.loading, 0
        if req.handle.load_failures:
            self.report.load_failures += 1
            req.written = 0
            self._write_pages(req, len(req.tokens))  # recompute what the load did not bring
            return
        for i in range(n):
            if not torch.equal(self.layout.read_page(req.pages[i]), self._values(req.keys[i])):
                self.report.corrupted_restores += 1
                self._violation(f"rid {req.rid}: restored page {i} holds other KV")
        self.report.pages_restored += n

    def _write_pages(self, req: _Request, kv_len: int) -> None:
        """Put the values of every page that is whole within ``kv_len`` tokens on the device."""
        page_size = self.cfg.page_size
        while (req.written + 1) * page_size <= kv_len:
            p = req.written
            if p == len(req.keys):
                prior = req.keys[-1] if req.keys else None
                tokens = req.tokens[p * page_size : (p + 1) * page_size]
                req.keys.append(sglang_page_hashes(tokens, page_size, prior)[0])
            self.layout.write_page(req.pages[p], self._values(req.keys[p]))
            self.expected_keys.add(req.keys[p])
            req.written += 1

    def _step(self) -> None:
        cfg = self.cfg
        per_step = 1.0 / cfg.output_len[1]  # abort and retract rates are per request
        still: list[_Request] = []
        for req in self.active:
            if req.loading:
                if req.handle.loading:  # waits for its prefix; may be aborted meanwhile
                    if not self._cut_short(req, self.rng.random(), per_step):
                        still.append(req)
                    continue
                self._restored(req)
            req.tokens.append(next_token(req.prompt_id, len(req.tokens)))
            if len(req.tokens) > len(req.pages) * cfg.page_size:
                if not self.free:  # device full: retract, as a real scheduler would
                    self._end(req, FinishReason.RETRACTED)
                    continue
                req.pages.append(self.free.pop())
            self._write_pages(req, len(req.tokens) - 1)  # the newest token has no KV yet
            try:
                self.manager.offload(req.handle, req.tokens, req.pages)
            except KVLifeError as exc:  # kvlife's manager never gets here on a sound runtime
                self._violation(f"rid {req.rid}: offload refused: {exc}")
            roll = self.rng.random()
            if len(req.tokens) >= req.target:
                self._end(req, FinishReason.FINISHED)
            elif not self._cut_short(req, roll, per_step):
                still.append(req)
        self.active = still

    def _cut_short(self, req: _Request, roll: float, per_step: float) -> bool:
        """Abort or retract ``req`` on this step's ``roll`` (rates are per request); whether
        it ended."""
        cfg = self.cfg
        if roll < cfg.abort_rate * per_step:
            self._end(req, FinishReason.ABORTED)
        elif roll < (cfg.abort_rate + cfg.retract_rate) * per_step:
            self._end(req, FinishReason.RETRACTED)
        else:
            return False
        return True

    def _end(self, req: _Request, reason: FinishReason) -> None:
        counted = reason.value  # "finished", "aborted" or "retracted": a report field
        setattr(self.report, counted, getattr(self.report, counted) + 1)
        self.manager.finish(req.handle, reason)
        req.loading = 0  # a retracted request resumes by recomputing (or loading again)
        if reason is FinishReason.RETRACTED:
            self.waiting.append(req)  # resumes later with a new life
        else:
            if reason is FinishReason.FINISHED:
                self.history.append((req.prompt_id, list(req.tokens)))
            self.done += 1
            if self.progress is not None:
                self.progress(1)

    def _released(self, req: _Request, life: int, handle: Any, device_pages: Sequence[int]) -> None:
        """The release callback: check, then hand the pages back (poisoned, reused at once)."""
        self.releases.append(life)
        if life not in self.unreleased:
            self._violation(f"rid {req.rid} life {life}: released twice")
            return
        inflight = getattr(handle, "inflight", 0)
        if inflight:
            self._violation(f"rid {req.rid} life {life}: released with {inflight} in flight")
        self.unreleased.remove(life)
        self.report.lifecycles_released += 1
        for page in device_pages:
            self.layout.write_page(page, self.poison)  # a late reader sees poison
            self.free.append(page)

    def _values(self, key: str) -> torch.Tensor:
        return page_values(key, self.layout.page_numel, self.layout.dtype, self.cfg.rank)

    def _violation(self, what: str) -> None:
        self.report.invariant_violations += 1
        self.report.violations.append(what)

    def _account(self) -> None:
        rep = self.report
        tier = getattr(self.manager, "tier", None)  # pages kept on the host tier are held
        held_on_host = 0 if tier is None else tier.counts.entries + tier.counts.orphans
        rep.leaked_host_pages = self.host.num_used - held_on_host
        held = sum(len(r.pages) for r in self.active)  # only after a stall
        rep.leaked_device_pages = self.layout.num_pages - len(self.free) - held
        if self.unreleased:
            self._violation(f"{len(self.unreleased)} lives never released")
        metrics = getattr(self.manager, "metrics", None)
        if metrics is not None:
            m = metrics()
            rep.chunks_offloaded = m.chunks_acked
            rep.refused_events = sum(m.refused_events.values())
            for name in ("copy_failures", "store_failures", "host_pool_exhausted"):
                setattr(rep, name, getattr(m, name))
            if rep.elapsed_s > 0:
                rep.offload_gbps = m.bytes_offloaded / rep.elapsed_s / 1e9
        if self.engine.copy_errors:  # not the injected faults: a copy that could not be made
            self._violation(
                f"{self.engine.copy_errors} copies failed: {self.engine.last_copy_error!r}"
            )

    def _verify(self) -> None:
        """Count each page this run stored: verified, corrupted (or missing), or misfiled."""
        rep = self.report
        self.stored_keys = sorted(set(self.store.keys()) - self.keys_before)
        for start in range(0, len(self.stored_keys), 256):  # one round trip per 256 pages
            batch = self.stored_keys[start : start + 256]
            try:
                found = self.store.get_batch(batch)
            except StoreError:
                if not self._may_lose:
                    raise
                rep.pages_missing += len(batch)  # the cluster cannot answer now
                continue
            for key, data in zip(batch, found, strict=True):
                rep.pages_stored += 1
                if key not in self.expected_keys:
                    rep.misfiled_pages += 1
                elif data is None and self._may_lose:
                    rep.pages_missing += 1
                elif data is None or not torch.equal(
                    torch.frombuffer(bytearray(data), dtype=torch.uint8),
                    self._values(key).view(torch.uint8),
                ):
                    rep.corrupted_pages += 1
                else:
                    rep.pages_verified += 1


def run_simulation(
    cfg: SimConfig,
    make_manager: ManagerFactory = OffloadManager,
    progress: Callable[[int], None] | None = None,
) -> SimReport:
    """Run one simulation of ``cfg``; see :class:`SimReport`."""
    return Simulation(cfg, make_manager, progress).run()
