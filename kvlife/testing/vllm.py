"""A kit for any vLLM 0.32 offloading manager (``vllm.v1.kv_offload.base.OffloadingManager``).

:func:`run_manager_kit` plays vLLM's offloading connector against the manager a factory
builds (``factory(chunks) -> OffloadingManager``, a tier of ``chunks`` blocks): requests arrive
(often on a request id a finished request's late completions still use), are scheduled
(``lookup`` up to the first miss, then ``prepare_load`` of the hits), compute their prompt
blocks (``prepare_store`` each step; ``None`` is retried), finish, abort, are preempted and
rescheduled, and every job completes late, in any order, in parts, or as a failed store;
``touch``, ``take_events`` and ``reset_cache`` come in between. A model of what the tier
holds checks the manager after every call; a failure is one readable trace with its seed,
replayed by :func:`replay_manager`, and a replay file (:mod:`kvlife.testing.replay`, kind
``"vllm-manager"``) that ``kvlife check --replay FILE`` re-runs (:func:`replay_command`).
Guide: docs/testing-kit.md, "Any vLLM offloading manager" and "Replay files".

This module imports vLLM; ``kvlife.testing`` does not import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, KeysView, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, cast

from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisException
from hypothesis.stateful import (
    RuleBasedStateMachine,
    rule,
    run_state_machine_as_test,
)

# vLLM is an optional dependency: mypy runs without it, hence the ignores.
from vllm.v1.kv_offload.base import (  # type: ignore[import-not-found]
    LookupResult,
    OffloadingManager,
    ReqContext,
    ScheduleEndContext,
)

from kvlife.errors import ConfigError
from kvlife.testing import replay as replays
from kvlife.testing.oracle import InvariantViolation, _deadline, _Stuck
from kvlife.testing.report import format_trace, rule_of
from kvlife.testing.stateful import KIT_SETTINGS
from kvlife.testing.strategies import sampled

__all__ = [
    "ManagerKitFailure",
    "ManagerKitOptions",
    "ManagerOracle",
    "check_command",
    "load_manager_factory",
    "load_manager_replay",
    "offload_key",
    "replay_command",
    "replay_manager",
    "run_manager_kit",
    "shrink_manager_run",
]

#: ``factory(chunks)``: a fresh manager whose tier holds ``chunks`` blocks.
ManagerFactory = Callable[[int], Any]

#: Request ids the kit draws from: few, so a new request often reuses a finished one's id.
RIDS = ("r0", "r1", "r2")
#: Block tokens of the prompts: a prompt ``"aba"`` has the keys ``a``, ``ab``, ``aba``.
VOCAB = "ab"


def offload_key(name: str) -> bytes:
    """The ``OffloadKey`` of block-prefix ``name`` (16 hash bytes + group 0, as vLLM packs)."""
    return hashlib.sha256(name.encode()).digest()[:16] + (0).to_bytes(4, "big")


#: Steps the kit ends, after the last job completed, while the manager has pending work.
_DRAIN_STEPS = 4


@dataclass(frozen=True)
class ManagerKitOptions:
    """What the kit does to the manager; the defaults are the adversarial ones."""

    #: Blocks in the tier (the factory's argument); prompts total far more.
    chunks: int = 3
    #: Store jobs may fail: ``complete_store(keys, ctx, success=False)``.
    failures: bool = True
    #: A job may complete in two calls (a subset of its keys, then the rest), and a store with
    #: a superset (its keys plus keys of its offer that are ready): the API settles per key.
    split_completions: bool = True
    #: vLLM 0.32's connector guards: a request is scheduled (lookup, load) only once its own
    #: transfers are done, so it never has a load beside another job. ``False`` also tries
    #: a second load, or a load beside a store, of one request.
    connector_guards: bool = True
    #: Requests may be aborted (``on_request_finished`` with no final store, even mid-load).
    aborts: bool = True
    #: Running requests may be preempted (their device blocks go; rescheduled later).
    preemptions: bool = True
    #: ``reset_cache()`` may come; jobs begun before it never complete (as in vLLM).
    resets: bool = True
    #: ``take_events`` checked: ``True`` always, ``False`` never, ``None`` once it yields one.
    events: bool | None = None
    #: After every call, ``lookup`` every key seen with a probe request.
    probe: bool = True

    #: Seconds one manager call (and the factory's call) may block before it is reported
    #: ``stuck-call``; ``None`` waits forever (``kvlife check --stuck-after``).
    stuck_after: float | None = 10.0

    def __post_init__(self) -> None:
        if not 1 <= self.chunks <= 64:
            raise ConfigError(f"chunks must be in 1..64, got {self.chunks}")
        if self.stuck_after is not None and not 0 < self.stuck_after < 3600:
            raise ConfigError(f"stuck_after must be in (0, 3600) s, got {self.stuck_after}")

    def as_dict(self) -> dict[str, Any]:
        """Plain dict, for JSON (a replay file's ``options``)."""
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- events


@dataclass(frozen=True)
class Arrive:
    """A new request (its own ``ReqContext``) with ``rid`` and a prompt of blocks."""

    rid: str
    prompt: str

    def __str__(self) -> str:
        return f"arrive rid={self.rid} prompt={self.prompt}"


@dataclass(frozen=True)
class Schedule:
    """Request ``req`` is scheduled: ``cached`` blocks on the device, the rest looked up."""

    req: int
    cached: int = 0

    def __str__(self) -> str:
        return f"schedule req {self.req}" + (f" ({self.cached} cached)" if self.cached else "")


@dataclass(frozen=True)
class Compute:
    """Request ``req`` computes ``blocks`` more prompt blocks; the step stores what is new."""

    req: int
    blocks: int

    def __str__(self) -> str:
        return f"compute req {self.req} +{self.blocks}"


@dataclass(frozen=True)
class Finish:
    """Request ``req`` finishes (its last blocks stored first) or is aborted."""

    req: int
    aborted: bool = False

    def __str__(self) -> str:
        return f"{'abort' if self.aborted else 'finish'} req {self.req}"


@dataclass(frozen=True)
class Preempt:
    """Running request ``req`` loses its device blocks; its jobs still complete."""

    req: int

    def __str__(self) -> str:
        return f"preempt req {self.req}"


How = Literal["all", "fail", "part", "superset"]


@dataclass(frozen=True)
class Complete:
    """Job ``job`` completes: ``all`` its keys, ``part`` of them, a ``superset``, or ``fail``."""

    job: int
    how: How = "all"

    def __str__(self) -> str:
        return f"complete job {self.job}" + ("" if self.how == "all" else f" ({self.how})")


@dataclass(frozen=True)
class Touch:
    """``touch`` the blocks request ``req`` has computed."""

    req: int

    def __str__(self) -> str:
        return f"touch req {self.req}"


@dataclass(frozen=True)
class StepEnd:
    """A scheduler step ends: ``on_schedule_end``, ``get_stats``, ``take_events``."""

    def __str__(self) -> str:
        return "step end"


@dataclass(frozen=True)
class Reset:
    """``reset_cache()``; the jobs in flight never complete."""

    def __str__(self) -> str:
        return "reset_cache"


@dataclass(frozen=True)
class End:
    """Everything finishes and completes; then nothing may be pending or pinned."""

    def __str__(self) -> str:
        return "end"


ManagerEvent = (
    Arrive | Schedule | Compute | Finish | Preempt | Complete | Touch | StepEnd | Reset | End
)
#: The events of a ``"vllm-manager"`` replay file, by the ``kind`` their JSON objects carry.
MANAGER_EVENTS: dict[str, type[ManagerEvent]] = replays.event_table(
    Arrive, Schedule, Compute, Finish, Preempt, Complete, Touch, StepEnd, Reset, End
)


# ----------------------------------------------------------------------------- the model


@dataclass(eq=False)
class _Request:
    index: int
    rid: str
    prompt: str
    ctx: Any
    state: str = "waiting"  # waiting, loading, running, finished
    computed: int = 0  # prompt blocks on the device
    stored: int = 0  # blocks offered to prepare_store so far (vLLM's next_stored_chunk_idx)
    load_end: int = 0
    jobs: set[int] = field(default_factory=set)

    def __str__(self) -> str:
        return f"req {self.index} ({self.rid})"


@dataclass(eq=False)
class _Job:
    index: int
    req: _Request
    load: bool
    keys: list[bytes]  # not yet completed
    offer: list[bytes]


@dataclass(eq=False)
class _Entry:
    slot: int | None
    job: int | None  # the store in flight; None: ready
    pins: int = 0


def key_set(keys: Iterable[bytes]) -> KeysView[bytes]:
    """The keys of one job as vLLM's connector hands them to a manager, set-like (``in``,
    ``-``, ``&``), but iterated in the kit's order: a Python ``set`` of bytes iterates in an
    order ``PYTHONHASHSEED`` picks, so a seed, a derandomized search or a replayed trace
    would drive a manager differently in each process."""
    return dict.fromkeys(keys).keys()


def _slots(spec: Any, n: int) -> list[int] | None:
    """The chunk of each block a spec names (``block_ids``), or None if it names none."""
    ids = getattr(spec, "block_ids", None)
    if ids is None:
        return None
    slots = [int(i) for i in ids]
    return slots if len(slots) == n else None


class ManagerOracle:
    """Runs :data:`ManagerEvent` s on a manager and checks it after every call; ``lines`` is
    the run so far, each event with what the manager answered."""

    def __init__(self, factory: ManagerFactory, options: ManagerKitOptions | None = None) -> None:
        self.options = options or ManagerKitOptions()
        self.capacity = self.options.chunks
        self.manager = self._call(f"factory({self.capacity})", factory, self.capacity)
        if not isinstance(self.manager, OffloadingManager):
            raise ConfigError(
                f"the factory returned {type(self.manager).__name__}, not an OffloadingManager"
            )
        self.events: list[ManagerEvent] = []
        self.lines: list[str] = []
        self.requests: list[_Request] = []
        self.jobs: dict[int, _Job] = {}  # in flight, in prepare order
        self._next_job = 0
        self.entries: dict[bytes, _Entry] = {}
        self.gone: dict[bytes, str] = {}  # why a key is no longer held
        self.names: dict[bytes, str] = {}
        # take_events bookkeeping: what became ready / was evicted and is not yet announced.
        self._to_store: dict[bytes, deque[int | None]] = {}
        self._to_remove: dict[bytes, int] = {}
        self._cleared: set[bytes] = set()  # announced, then cleared by a reset
        self.announced: dict[bytes, int | None] = {}
        self._saw_events = False
        self._preempted: list[str] = []
        self._note: list[str] = []
        self._probe = ReqContext(req_id="kit-probe")
        self._call("on_new_request", self.manager.on_new_request, self._probe)

    # -- helpers

    def key(self, name: str) -> bytes:
        k = offload_key(name)
        self.names[k] = name
        return k

    def name(self, key: bytes) -> str:
        return self.names.get(key, key.hex()[:12])

    def _names(self, keys: Sequence[bytes]) -> str:
        return "[" + ", ".join(self.name(k) for k in keys) + "]"

    def _fail(self, rule: str, message: str) -> NoReturn:
        raise InvariantViolation(rule, message)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A manager call; an exception from a call the connector may make is a finding, and
        so is a call still blocked after ``options.stuck_after`` seconds (``stuck-call``)."""
        try:
            with _deadline(self.options.stuck_after):
                return fn(*args, **kwargs)
        except _Stuck:
            raise InvariantViolation(
                "stuck-call",
                f"{what} did not return within {self.options.stuck_after} s (--stuck-after): "
                "it waits for a lock, a server or a job that never completes",
            ) from None
        except InvariantViolation:
            raise
        except Exception as exc:
            rule = type(exc).__name__
            raise InvariantViolation(rule, f"{what} raised {rule}: {exc}") from exc

    def live(self) -> list[_Request]:
        return [r for r in self.requests if r.state != "finished"]

    def in_state(self, *states: str) -> list[_Request]:
        return [r for r in self.requests if r.state in states]

    def schedulable(self) -> list[_Request]:
        if self.options.connector_guards:
            return [r for r in self.in_state("waiting") if not r.jobs]
        return self.in_state("waiting", "loading")

    def keys_of(self, req: _Request) -> list[bytes]:
        return [self.key(req.prompt[: i + 1]) for i in range(len(req.prompt))]

    def unmakeable(self, event: ManagerEvent) -> str | None:
        """Why the connector, as the kit drives it under these options, would not make
        ``event`` now (None: it would). A shrunk run must be one the kit could have drawn:
        left-out events must not leave, say, a finished request computing."""
        o = self.options
        if isinstance(event, Arrive):
            if event.rid in {r.rid for r in self.live()}:
                return f"rid {event.rid} is in use"
            return None if event.prompt and set(event.prompt) <= set(VOCAB) else "a bad prompt"
        if isinstance(event, Complete):
            job = self.jobs.get(event.job)
            if job is None:
                return f"no job {event.job} in flight"
            hows = {"all", *(("part", "superset") if o.split_completions else ())}
            hows |= {"fail"} if o.failures else set()
            ok = event.how in hows and (not job.load or event.how in ("all", "part"))
            return None if ok else f"job {event.job} cannot complete as {event.how}"
        if isinstance(event, Reset):
            return None if o.resets and self.entries else "no reset here"
        if not isinstance(event, Schedule | Compute | Finish | Preempt | Touch):
            return None  # step end, end
        if not 0 <= event.req < len(self.requests):
            return f"no req {event.req}"
        req = self.requests[event.req]
        if isinstance(event, Schedule):
            ok = req in self.schedulable()
        elif isinstance(event, Compute):
            ok = req.state == "running" and req.stored < len(req.prompt)
        elif isinstance(event, Finish) and event.aborted:
            ok = o.aborts and req.state != "finished"
        elif isinstance(event, Finish | Preempt):
            ok = req.state == "running" and (isinstance(event, Finish) or o.preemptions)
        else:
            ok = req.state != "finished"
        return None if ok else f"{req} is {req.state}"

    # -- running events

    def run(self, events: Sequence[ManagerEvent]) -> None:
        for event in events:
            self.apply(event)

    def apply(self, event: ManagerEvent) -> None:
        """Run one event on the manager, then check it (and probe every key)."""
        self.events.append(event)
        self._note = []
        try:
            self._dispatch(event)
            if self.options.probe and not isinstance(event, End):
                self._probe_all()
        finally:
            note = "; ".join(self._note)
            self.lines.append(f"{event}" + (f": {note}" if note else ""))

    def _dispatch(self, event: ManagerEvent) -> None:
        if isinstance(event, Arrive):
            self._arrive(event)
        elif isinstance(event, Schedule):
            self._schedule(self.requests[event.req], event.cached)
        elif isinstance(event, Compute):
            req = self.requests[event.req]
            req.computed = min(len(req.prompt), req.computed + event.blocks)
            self._store(req)
        elif isinstance(event, Finish):
            self._finish(self.requests[event.req], event.aborted)
        elif isinstance(event, Preempt):
            req = self.requests[event.req]
            req.state, req.computed = "waiting", 0
            self._preempted.append(req.rid)
        elif isinstance(event, Complete):
            job = self.jobs.get(event.job)
            if job is None:  # a trace replayed on another manager, which never made this job
                self._note.append("no such job here: skipped")
                return
            self._complete(job, event.how)
        elif isinstance(event, Touch):
            req = self.requests[event.req]
            keys = self.keys_of(req)[: max(1, req.computed)]
            self._call("touch", self.manager.touch, keys, req.ctx)
        elif isinstance(event, StepEnd):
            self._step_end()
        elif isinstance(event, Reset):
            self._reset()
        else:
            self._end()

    def _arrive(self, event: Arrive) -> None:
        busy = {r.rid for r in self.live()}
        if event.rid in busy:
            raise ConfigError(f"rid {event.rid} is still in use by a running request")
        ctx = ReqContext(req_id=event.rid)
        req = _Request(len(self.requests), event.rid, event.prompt, ctx)
        for i, key in enumerate(self.keys_of(req)):
            ctx.set_offload_key_position(key, (i + 1) * 16)
        self.requests.append(req)
        self._call("on_new_request", self.manager.on_new_request, ctx)
        self._note.append(f"req {req.index}")

    def _schedule(self, req: _Request, cached: int) -> None:
        keys = self.keys_of(req)
        start = min(cached, len(keys))
        hits: list[bytes] = []
        deferred: list[str] = []
        for key in keys[start:]:
            result = self._call("lookup", self.manager.lookup, key, req.ctx)
            self._check_lookup(key, result, f"lookup({self.name(key)}) for {req}")
            if result is LookupResult.MISS:
                break
            if result is LookupResult.HIT:
                hits.append(key)
            else:
                deferred.append(f"{self.name(key)} {result.name}")
        if deferred:  # the connector asks again later
            self._note.append("deferred: " + ", ".join(deferred))
            return
        if not hits:
            req.state, req.computed = "running", start
            self._note.append("nothing to load")
            return
        spec = self._call("prepare_load", self.manager.prepare_load, hits, req.ctx)
        slots = _slots(spec, len(hits))
        for i, key in enumerate(hits):
            entry = self.entries[key]  # a HIT of a key not held failed above
            if slots is not None and entry.slot is not None and slots[i] != entry.slot:
                self._fail(
                    "load-slot",
                    f"prepare_load for {req} reads {self.name(key)} from chunk {slots[i]}, "
                    f"but its store wrote chunk {entry.slot}",
                )
            entry.pins += 1
        job = self._new_job(req, True, hits, hits)
        req.state, req.load_end = "loading", start + len(hits)
        self._note.append(f"load job {job.index} {self._names(hits)}")

    def _new_job(self, req: _Request, load: bool, keys: list[bytes], offer: list[bytes]) -> _Job:
        job = _Job(self._next_job, req, load, list(keys), list(offer))
        self._next_job += 1
        self.jobs[job.index] = job
        req.jobs.add(job.index)
        return job

    def _store(self, req: _Request, offer: list[bytes] | None = None) -> None:
        """``prepare_store`` of the request's computed blocks not yet offered (or ``offer``)."""
        flush = offer is not None
        if offer is None:
            offer = self.keys_of(req)[req.stored : req.computed]
        if not offer:
            return
        out = self._call("prepare_store", self.manager.prepare_store, list(offer), req.ctx)
        what = f"prepare_store{self._names(offer)} for {req}"
        if out is None:
            self._note.append("prepare_store: None (retried next step)")
            return
        to_store = list(out.keys_to_store)
        evicted = list(out.evicted_keys)
        if len(set(to_store)) != len(to_store) or not set(to_store) <= set(offer):
            self._fail("store-output", f"{what} returned keys_to_store {self._names(to_store)}")
        self._evict(evicted, offer, what)
        for key in to_store:
            if key in self.entries:
                state = "pending" if self.entries[key].job is not None else "ready"
                self._fail(
                    "store-output",
                    f"{what} stores {self.name(key)} again, which is already held ({state})",
                )
        slots = _slots(out.store_spec, len(to_store))
        used = {e.slot for e in self.entries.values()}
        for i, key in enumerate(to_store):
            slot = slots[i] if slots is not None else None
            if slot is not None:
                if not 0 <= slot < self.capacity:
                    self._fail(
                        "capacity",
                        f"{what} puts {self.name(key)} in chunk {slot} of a "
                        f"{self.capacity}-chunk tier",
                    )
                if slot in used:
                    owner = [self.name(k) for k, e in self.entries.items() if e.slot == slot]
                    self._fail(
                        "slot-shared",
                        f"{what} puts {self.name(key)} in chunk {slot}, which "
                        f"{owner[0] if owner else 'another key of this store'} holds",
                    )
                used.add(slot)
            self.entries[key] = _Entry(slot, self._next_job)
            self.gone.pop(key, None)
        if len(self.entries) > self.capacity:
            self._fail(
                "capacity",
                f"{what} leaves {len(self.entries)} blocks held in a {self.capacity}-chunk tier: "
                f"{self._names(list(self.entries))}",
            )
        if not flush:
            req.stored = req.computed
        note = f"store job {self._next_job} {self._names(to_store)}" if to_store else "nothing new"
        if evicted:
            note += f", evicted {self._names(evicted)}"
        self._note.append(note)
        if to_store:
            self._new_job(req, False, to_store, list(offer))

    def _evict(self, evicted: list[bytes], offer: list[bytes], what: str) -> None:
        if len(set(evicted)) != len(evicted):
            self._fail("unknown-evicted", f"{what} evicted {self._names(evicted)}: a key twice")
        for key in evicted:
            entry = self.entries.get(key)
            name = self.name(key)
            if entry is None:
                self._fail(
                    "unknown-evicted",
                    f"{what} evicted {name}, which is not held "
                    f"({self.gone.get(key, 'never stored')})",
                )
            elif key in offer:
                self._fail(
                    "offered-evicted", f"{what} evicted {name}, a key the same prepare_store offers"
                )
            elif entry.job is not None:
                self._fail(
                    "pending-evicted",
                    f"{what} evicted {name} while its store (job {entry.job}) is in flight",
                )
            elif entry.pins:
                readers = [f"job {j.index}" for j in self.jobs.values() if j.load and key in j.keys]
                self._fail(
                    "pinned-evicted",
                    f"{what} evicted {name}, which load {', '.join(readers)} still reads",
                )
            del self.entries[key]
            self.gone[key] = f"evicted by {what}"
            self._to_remove[key] = self._to_remove.get(key, 0) + 1

    def _finish(self, req: _Request, aborted: bool) -> None:
        if not aborted and req.state == "running":
            self._store(req)  # the step after a finish stores the last blocks first
        req.state = "finished"
        self._call("on_request_finished", self.manager.on_request_finished, req.ctx)

    def _complete(self, job: _Job, how: How) -> None:
        req = job.req
        keys = job.keys
        if how == "part" and len(keys) > 1:
            keys = keys[: len(keys) // 2]
        if job.load:
            self._call("complete_load", self.manager.complete_load, key_set(keys), req.ctx)
            for key in keys:
                self.entries[key].pins -= 1
        else:
            named = keys
            if how == "superset":  # also offered keys already ready: a no-op for them
                held = [k for k in job.offer if k in self.entries and self.entries[k].job is None]
                named = [*keys, *held]
            given = key_set(named)
            ok = how != "fail"
            self._call("complete_store", self.manager.complete_store, given, req.ctx, success=ok)
            for key in keys:
                if ok:
                    entry = self.entries[key]
                    entry.job = None
                    self._to_store.setdefault(key, deque()).append(entry.slot)
                else:
                    del self.entries[key]
                    self.gone[key] = f"its store (job {job.index}) failed"
        job.keys = [k for k in job.keys if k not in set(keys)]
        if job.keys:
            self._note.append(f"{len(job.keys)} left")
            return
        del self.jobs[job.index]
        req.jobs.discard(job.index)
        if job.load and req.state == "loading" and not any(self.jobs[j].load for j in req.jobs):
            req.state = "running"
            req.computed = max(req.computed, req.load_end)
            req.stored = max(req.stored, req.load_end)  # loaded blocks are not stored again

    def _step_end(self) -> None:
        context = ScheduleEndContext(new_req_ids=(), preempted_req_ids=tuple(self._preempted))
        self._preempted = []
        self._call("on_schedule_end", self.manager.on_schedule_end, context)
        self._call("get_stats", self.manager.get_stats)
        self._take_events()

    def _take_events(self) -> None:
        taken = list(self._call("take_events", self.manager.take_events))
        self._saw_events = self._saw_events or bool(taken)
        check = self.options.events or (self.options.events is None and self._saw_events)
        ready = {k: e.slot for k, e in self.entries.items() if e.job is None}
        if not check:
            self.announced = ready
            self._to_store.clear()
            self._to_remove.clear()
            return
        shown: list[str] = []
        holder = {slot: k for k, slot in self.announced.items() if slot is not None}
        for event in taken:
            removed = bool(event.removed)
            keys = list(event.keys)
            shown.append(("removed " if removed else "stored ") + self._names(keys))
            for key in keys:
                name = self.name(key)
                if removed and key in self._cleared:  # a reset's removal, announced late
                    self._cleared.discard(key)
                    continue
                if removed:
                    if not self._to_remove.get(key) or key not in self.announced:
                        self._fail(
                            "events",
                            f"take_events: a removed event for {name}, which was not evicted "
                            "since its stored event",
                        )
                    self._to_remove[key] -= 1
                    slot = self.announced.pop(key)
                    holder.pop(slot, None) if slot is not None else None
                    continue
                self._cleared.discard(key)  # a reset's removal comes before a new store
                queue = self._to_store.get(key)
                if not queue or key in self.announced:
                    self._fail(
                        "events",
                        f"take_events: a stored event for {name}, which did not become "
                        "ready since it was last announced",
                    )
                slot = queue.popleft()
                if slot is not None and slot in holder:
                    self._fail(
                        "events",
                        f"take_events: the stored event for {name} (chunk {slot}) comes before the "
                        f"removed event of {self.name(holder[slot])}, which held chunk {slot}",
                    )
                self.announced[key] = slot
                if slot is not None:
                    holder[slot] = key
        if taken:
            self._note.append("events: " + ", ".join(shown))
        missing = sorted(self.name(k) for k in set(ready) - set(self.announced))
        extra = sorted(self.name(k) for k in set(self.announced) - set(ready))
        if missing or extra:
            self._fail(
                "events",
                "after take_events, the events announce "
                + (f"no stored event for {missing} (ready) " if missing else "")
                + (f"{extra} as held, which are not ready" if extra else ""),
            )

    def _reset(self) -> None:
        self._take_events()  # the connector took the last step's events already
        self._call("reset_cache", self.manager.reset_cache)
        for key in self.entries:
            self.gone[key] = "cleared by reset_cache"
        self.entries.clear()
        # A manager may announce the keys a reset cleared as removed (vLLM's does not).
        self._cleared |= set(self.announced)
        self.announced.clear()
        self._to_store.clear()
        self._to_remove.clear()
        dropped = sorted(self.jobs)
        self.jobs.clear()
        for req in self.requests:
            req.jobs.clear()
            if req.state == "loading":
                req.state, req.computed = "running", req.load_end
            req.stored = 0  # vLLM re-offloads active requests from their first block
        if dropped:
            self._note.append(f"jobs {dropped} never complete")

    def _end(self) -> None:
        for req in self.live():
            req.state = "finished"
            self._call("on_request_finished", self.manager.on_request_finished, req.ctx)
        for job in list(self.jobs.values()):
            self._complete(job, "all")
        self._take_events()
        # vLLM keeps ending steps while the manager has pending work (a reset's jobs still
        # being flushed by the workers, say): a bounded number of them, then the check.
        for _ in range(_DRAIN_STEPS):
            if not self._call("has_pending_work", self.manager.has_pending_work):
                break
            self._step_end()
        for key in list(self.entries):
            result = self._call("lookup", self.manager.lookup, key, self._probe)
            if result is not LookupResult.HIT:
                self._fail(
                    "stuck",
                    f"after every job completed, lookup({self.name(key)}) is "
                    f"{result.name}, not HIT",
                )
        held = list(self.entries)
        flush = ReqContext(req_id="kit-flush")
        self._call("on_new_request", self.manager.on_new_request, flush)
        fresh = [self.key(f"#{i}") for i in range(self.capacity)]
        out = self._call("prepare_store", self.manager.prepare_store, fresh, flush)
        n = self.capacity
        what = f"after every job completed, prepare_store of {n} new keys into the {n}-chunk tier"
        if out is None:
            self._fail(
                "stuck",
                f"{what} was refused: something in {self._names(held)} is still pinned or pending",
            )
        kept = [k for k in held if k not in set(out.evicted_keys)]
        if list(out.keys_to_store) != fresh:
            self._fail(
                "stuck",
                f"{what} stored only {self._names(list(out.keys_to_store))}: "
                f"something in {self._names(kept)} is still pinned or pending",
            )
        if kept:
            self._fail("capacity", f"{what} stored them all and kept {self._names(kept)}")
        self._evict(list(out.evicted_keys), fresh, "prepare_store")
        for key in fresh:
            self.entries[key] = _Entry(None, None)
            self._to_store.setdefault(key, deque()).append(None)
        self._call("complete_store", self.manager.complete_store, key_set(fresh), flush)
        self._call("on_request_finished", self.manager.on_request_finished, flush)
        self._call("on_request_finished", self.manager.on_request_finished, self._probe)
        self._take_events()
        self._call("shutdown", self.manager.shutdown)

    # -- checks

    def _probe_all(self) -> None:
        for key in list(self.names):
            result = self._call("lookup", self.manager.lookup, key, self._probe)
            self._check_lookup(key, result, f"lookup({self.name(key)})")

    def _check_lookup(self, key: bytes, result: Any, what: str) -> None:
        entry = self.entries.get(key)
        if result is LookupResult.RETRY:
            return
        if entry is None:
            if result is not LookupResult.MISS:
                why = self.gone.get(key, "never stored")
                self._fail(
                    "phantom-hit", f"{what} is {result.name}, but the key is not held ({why})"
                )
        elif result is LookupResult.MISS:
            self._fail(
                "lost-entry", f"{what} is MISS, but the key is held and no eviction reported it"
            )
        elif entry.job is not None and result is LookupResult.HIT:
            self._fail(
                "pending-hit", f"{what} is HIT while its store (job {entry.job}) is still in flight"
            )
        elif entry.job is None and result is LookupResult.HIT_PENDING:
            self._fail("stuck-pending", f"{what} is HIT_PENDING after its store completed")


# ----------------------------------------------------------------------------- drivers


class ManagerKitFailure(InvariantViolation):
    """The manager broke a rule (or raised): the rule, the run, how to replay it, the seed."""

    def __init__(
        self,
        rule: str,
        message: str,
        events: Sequence[ManagerEvent],
        lines: Sequence[str],
        *,
        seed: int | None,
        replay_path: str | None = None,
    ) -> None:
        self.events = list(events)
        self.trace = list(lines)
        self.seed = seed
        self.detail = message
        #: The replay file written for it (``kvlife check --replay``), if one was.
        self.replay_path = replay_path
        seeded = f", seed {seed}" if seed is not None else ""
        how = "replay: kvlife.testing.vllm.replay_manager(factory, failure.events)"
        how += (
            f"; rerun: run_manager_kit(factory, ..., seed={seed})"
            if seed is not None
            else ("; derandomized: the same settings rerun the same search")
        )
        if replay_path is not None:
            how += f"\nreplay file: {replay_path} (kvlife check --replay {replay_path})"
        super().__init__(
            rule,
            f"{message}\nshortest failing run found ({len(self.trace)} events{seeded}):\n"
            f"{format_trace(self.trace)}\n{how}",
        )


def replay_manager(
    factory: ManagerFactory,
    events: Sequence[ManagerEvent],
    options: ManagerKitOptions | None = None,
) -> ManagerOracle:
    """Run ``events`` (a failure's ``events``) on a fresh manager under the oracle."""
    oracle = ManagerOracle(factory, options)
    oracle.run(events)
    return oracle


def _detail(exc: BaseException, rule: str) -> str:
    """An exception's message without its ``[rule]`` prefix."""
    text = str(exc)
    return text[len(rule) + 3 :] if text.startswith(f"[{rule}] ") else f"{rule}: {text}"


def _run_events(
    factory: ManagerFactory,
    events: Sequence[ManagerEvent],
    options: ManagerKitOptions,
    *,
    makeable: bool = False,
) -> tuple[tuple[str, str] | None, list[str]]:
    """``events`` on a fresh manager under the oracle: ((rule, message) of what it broke,
    or None) and the run's lines. ``makeable``: an event the kit could not have drawn
    there ends the run as passing (a shrink candidate that is no run at all)."""
    oracle: ManagerOracle | None = None
    try:
        oracle = ManagerOracle(factory, options)
        for event in events:
            if makeable and oracle.unmakeable(event) is not None:
                return None, oracle.lines
            oracle.apply(event)
    except Exception as exc:
        rule = rule_of(exc)
        return (rule, _detail(exc, rule)), oracle.lines if oracle else []
    return None, oracle.lines


def shrink_manager_run(
    factory: ManagerFactory,
    events: Sequence[ManagerEvent],
    options: ManagerKitOptions,
    rule: str,
) -> list[ManagerEvent]:
    """``events`` with as many events left out as still break ``rule`` on a fresh manager,
    each left a run the kit could have drawn (:meth:`ManagerOracle.unmakeable`): the
    replay files' shrinker (:func:`kvlife.testing.replay.shrink_run`); a final ``end`` stays."""

    def fails(candidate: list[ManagerEvent]) -> bool:
        found, _ = _run_events(factory, candidate, options, makeable=True)
        return found is not None and found[0] == rule

    return replays.shrink_run(events, fails, last=End)


def _save_replay(
    failure: ManagerKitFailure,
    options: ManagerKitOptions,
    *,
    runtime: str | None,
    source: str,
    found_events: int,
    directory: str | os.PathLike[str] | None,
) -> str | None:
    """``failure`` (its events shrunk) as a ``"vllm-manager"`` replay file; its path (None
    if it could not be written)."""
    record: replays.Replay[ManagerEvent, ManagerKitOptions] = replays.Replay(
        failure.events,
        options,
        failure.rule,
        failure.detail,
        runtime=runtime,
        seed=failure.seed,
        source=source,
        kind="vllm-manager",
        extra={"found_events": found_events},
    )
    try:
        return str(replays.save(record, directory=directory, shrunk=False))
    except OSError:
        return None


def load_manager_replay(
    path: str | os.PathLike[str],
) -> replays.Replay[ManagerEvent, ManagerKitOptions]:
    """The ``"vllm-manager"`` replay a file holds; another version or kind is refused
    (:class:`~kvlife.testing.replay.ReplayVersionError`,
    :class:`~kvlife.testing.replay.ReplayKindError`)."""
    return replays.load_kind(path, "vllm-manager", MANAGER_EVENTS, ManagerKitOptions)


#: The machine's actions, weighted by repetition. Hypothesis draws the first and the last
#: items more often, and shrinks towards the first: the two commonest actions go there.
_MENU = (
    ("compute",) * 4
    + ("arrive",) * 3
    + ("finish",) * 2
    + ("step_end",) * 2
    + ("reset",)
    + ("schedule",) * 3
    + ("preempt",)
    + ("touch",)
    + ("abort",)
    + ("complete",) * 6
)


class _ManagerMachine(RuleBasedStateMachine):
    """The connector's calls, drawn; each action is one or two :data:`ManagerEvent` s."""

    def __init__(self, factory: ManagerFactory, options: ManagerKitOptions) -> None:
        super().__init__()
        self.options = options
        self.oracle = ManagerOracle(factory, options)
        self._clean = True

    def _run(self, event: ManagerEvent) -> None:
        self._clean = False
        self.oracle.apply(event)
        self._clean = True

    def _able(self, what: str) -> bool:
        o, opts = self.oracle, self.options
        running = o.in_state("running")
        return {
            "step_end": True,
            "arrive": len(o.live()) < len(RIDS),
            "compute": bool(self._busy()),
            "finish": bool(running),
            "schedule": bool(o.schedulable()),
            "complete": bool(o.jobs),
            "preempt": bool(running) and opts.preemptions,
            "abort": bool(o.live()) and opts.aborts,
            "touch": bool(o.live()),
            "reset": bool(o.entries) and opts.resets,
        }[what]

    def _busy(self) -> list[_Request]:
        return [r for r in self.oracle.in_state("running") if r.stored < len(r.prompt)]

    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        """One action of the connector, drawn from a fixed weighted menu (hypothesis' own rule
        choice, swarm testing, starves actions that need state); one the state does not allow
        becomes the first that it does of complete, compute, schedule, arrive, step end. A
        fixed menu keeps most steps' meaning when shrinking deletes others."""
        what = data.draw(sampled(_MENU), label="action")
        if not self._able(what):  # the first of these the state allows: step end always
            what = next(
                w
                for w in ("complete", "compute", "schedule", "arrive", "step_end")
                if self._able(w)
            )
        o = self.oracle
        if what == "step_end":
            self._run(StepEnd())
        elif what == "arrive":
            busy = {r.rid for r in o.live()}
            rid = data.draw(sampled([r for r in RIDS if r not in busy]), label="rid")
            prompt = data.draw(st.text(VOCAB, min_size=1, max_size=5), label="prompt")
            self._run(Arrive(rid, prompt))
        elif what == "schedule":
            req = data.draw(sampled(o.schedulable()), label="req")
            cached = data.draw(sampled([0, 0, 0, 1, 2]), label="cached")
            self._run(Schedule(req.index, cached))
        elif what == "compute":
            req = data.draw(sampled(self._busy()), label="req")
            self._run(Compute(req.index, data.draw(sampled([1, 2, 2, 0]), label="blocks")))
        elif what in ("finish", "preempt"):
            req = data.draw(sampled(o.in_state("running")), label="req")
            self._run(Finish(req.index) if what == "finish" else Preempt(req.index))
        elif what == "abort":
            req = data.draw(sampled(o.live()), label="req")
            self._run(Finish(req.index, aborted=True))
        elif what == "complete":
            self._complete(data)
        elif what == "touch":
            self._run(Touch(data.draw(sampled(o.live()), label="req").index))
        else:
            self._run(Reset())

    def _complete(self, data: st.DataObject) -> None:
        """A job completes: the oldest, the newest, a finished request's late one, or any."""
        jobs = list(self.oracle.jobs.values())
        late = [j for j in jobs if j.req.state == "finished"]
        pick = [sampled(jobs[:1]), sampled(jobs[-1:]), sampled(jobs)]
        if late:
            pick.append(sampled(late))
        job = data.draw(st.one_of(pick), label="job")
        hows: list[How] = ["all", "all"]
        if self.options.split_completions:
            hows += ["part"] if job.load else ["part", "superset"]
        if self.options.failures and not job.load:
            hows.append("fail")
        self._run(Complete(job.index, data.draw(sampled(hows), label="how")))

    def teardown(self) -> None:
        if self._clean:
            self.oracle.apply(End())


def run_manager_kit(
    factory: ManagerFactory,
    settings: Settings | None = None,
    *,
    options: ManagerKitOptions | None = None,
    seed: int | None = None,
    runtime: str | None = None,
    replay_dir: str | os.PathLike[str] | None = None,
    source: str = "kit",
) -> None:
    """Drive the managers ``factory(options.chunks)`` builds, one per run, as vLLM's connector
    would; raise one :class:`ManagerKitFailure` (rule, shrunk trace, seed) on a violation.
    ``settings`` default to :data:`kvlife.testing.KIT_SETTINGS` (100 runs of up to 40 events).
    The run Hypothesis shrank is shrunk further, event by event
    (:func:`shrink_manager_run`), and written as a replay file (in ``replay_dir``, default
    :func:`kvlife.testing.replay.default_dir`; ``runtime`` names the factory as
    ``module:factory`` where its own name does not import back), its path in
    ``failure.replay_path`` and the message."""
    chosen = settings or KIT_SETTINGS
    chosen = type(chosen)(chosen, report_multiple_bugs=False)
    kit_options = options or ManagerKitOptions()
    ManagerOracle(factory, kit_options)  # a bad factory is refused here, not as a finding
    if seed is None and not chosen.derandomize:
        seed = random.getrandbits(32)
    made: list[ManagerOracle] = []  # the last run's oracle: the shrunk run, replayed last

    def machine() -> _ManagerMachine:
        run = _ManagerMachine(factory, kit_options)
        made[:] = [run.oracle]
        return run

    try:
        driven = machine if seed is None else hypothesis_seed(seed)(machine)
        run_state_machine_as_test(driven, settings=chosen)  # type: ignore[arg-type]
    except HypothesisException:
        raise
    except Exception as exc:
        oracle = made[0] if made else None
        rule = rule_of(exc)
        detail = _detail(exc, rule)
        events = oracle.events if oracle else []
        lines = oracle.lines if oracle else []
        found = len(events)
        shrunk = shrink_manager_run(factory, events, kit_options, rule)
        if len(shrunk) < len(events):
            again, shrunk_lines = _run_events(factory, shrunk, kit_options)
            if again is not None and again[0] == rule:
                events, lines, detail = shrunk, shrunk_lines, again[1]
        failure = ManagerKitFailure(rule, detail, events, lines, seed=seed)
        path = _save_replay(
            failure,
            kit_options,
            runtime=runtime or replays.factory_spec(factory),
            source=source,
            found_events=found,
            directory=replay_dir,
        )
        if path is not None:
            failure = ManagerKitFailure(rule, detail, events, lines, seed=seed, replay_path=path)
        raise failure from exc


def check_command(
    spec: str,
    *,
    failures: bool = True,
    json_out: bool = False,
    timeout: float | None = None,
    stuck_after: float | None = 10.0,
    replay_dir: str | os.PathLike[str] | None = None,
) -> int:
    """``kvlife check --vllm-manager MODULE:FACTORY``: the kit (:data:`KIT_SETTINGS`) on the
    managers ``FACTORY(chunks)`` builds. Exit status 0, or 1 with the failure (written as a
    replay file in ``replay_dir``: ``--replay-dir``); a factory that cannot be loaded,
    raises or returns no ``OffloadingManager`` is a :class:`ConfigError` (``kvlife``
    prints its one line, exit status 2). The import and the factory's first call each get
    ``timeout`` seconds (``--runtime-timeout``), as ``--runtime`` does; every later
    factory and manager call ``stuck_after`` seconds (``--stuck-after``), past which the
    run fails with ``stuck-call``."""
    options = ManagerKitOptions(failures=failures, stuck_after=stuck_after)
    factory = _checked_factory(spec, timeout, options)
    start = time.monotonic()
    failure: ManagerKitFailure | None = None
    try:
        run_manager_kit(
            factory, options=options, runtime=spec, replay_dir=replay_dir, source="check"
        )
    except ManagerKitFailure as exc:
        failure = exc
    elapsed = round(time.monotonic() - start, 2)
    runs = KIT_SETTINGS.max_examples
    if json_out:
        found = failure is not None
        print(
            json.dumps(
                {
                    "manager": spec,
                    "ok": not found,
                    "rule": failure.rule if failure else None,
                    "message": failure.detail if failure else None,
                    "trace": failure.trace if failure else [],
                    "seed": failure.seed if failure else None,
                    "replay": failure.replay_path if failure else None,
                    "runs": runs,
                    "elapsed_s": elapsed,
                    "options": dataclasses.asdict(options),
                }
            )
        )
    else:
        print(
            f"kvlife check: vLLM manager {spec}, {runs} runs of up to "
            f"{KIT_SETTINGS.stateful_step_count} actions, a {options.chunks}-chunk tier"
        )
        print(f"violation {failure}" if failure else f"OK: every run kept every rule ({elapsed} s)")
    return 1 if failure else 0


def _checked_factory(
    spec: str, timeout: float | None, options: ManagerKitOptions
) -> ManagerFactory:
    """The factory ``spec`` names, its import and first call each under ``timeout`` seconds
    (default: ``--runtime``'s); one that cannot be loaded, raises, blocks or builds no
    ``OffloadingManager`` is refused with a one-line :class:`ConfigError`."""
    from kvlife.testing.loading import RUNTIME_TIMEOUT_S, _within

    limit = RUNTIME_TIMEOUT_S if timeout is None else timeout
    factory = load_manager_factory(spec, timeout=limit)
    first = dataclasses.replace(options, stuck_after=None)  # bounded by the thread
    try:
        _within(limit, lambda: ManagerOracle(factory, first), f"the factory({options.chunks})")
    except ConfigError as exc:
        if exc.__cause__ is not None:
            cause = exc.__cause__
            if isinstance(cause, ConfigError):
                raise ConfigError(f"--vllm-manager {spec}: {cause}") from None
            raise ConfigError(
                f"--vllm-manager {spec}: the factory({options.chunks}) raised "
                f"{type(cause).__name__}: {cause}"
            ) from None
        raise ConfigError(f"--vllm-manager {spec}: {exc}") from None
    return factory


def replay_command(
    path: str,
    *,
    spec: str | None = None,
    json_out: bool = False,
    timeout: float | None = None,
) -> int:
    """``kvlife check --replay FILE`` of a ``"vllm-manager"`` replay: its events, exactly,
    on a fresh manager from the factory it names (``spec``: ``--vllm-manager``, to try a
    fix), under its options. Exit status 1 if it still fails, 0 if it passes now; a file of
    another version or kind, or a factory that cannot be loaded, is refused (exit 2)."""
    replay = load_manager_replay(path)
    chosen = spec or replay.runtime
    if not chosen:
        raise replays.ReplayFileError(path, "names no manager; give --vllm-manager")
    factory = _checked_factory(chosen, timeout, replay.options)
    found, lines = _run_events(factory, replay.events, replay.options)
    on = f"vLLM manager {chosen}"
    return replays.print_rerun(path, replay, on, found, json_out=json_out, trace=lines)


def load_manager_factory(spec: str, *, timeout: float | None = None) -> ManagerFactory:
    """``"module:factory"`` -> the factory, refused with :class:`ConfigError` (one line);
    the import under ``timeout`` seconds (default: ``--runtime``'s)."""
    from kvlife.testing.loading import RUNTIME_TIMEOUT_S, load_factory

    try:
        limit = RUNTIME_TIMEOUT_S if timeout is None else timeout
        return cast(ManagerFactory, load_factory(spec, timeout=limit))
    except ConfigError as exc:  # the loader words its refusals for --runtime
        raise ConfigError(str(exc).replace("--runtime", "--vllm-manager", 1)) from None
