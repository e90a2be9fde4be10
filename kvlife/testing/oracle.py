"""The kit's trusted model: :class:`Oracle` runs events on a runtime's adapter, knows each
life's tokens (hence its keys), which copies completed and which lives finished, and after
every event raises :class:`InvariantViolation` naming the first rule broken
(docs/testing-kit.md, "What the kit checks").
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvlife._lifecycle import FinishReason
from kvlife.errors import KVLifeError
from kvlife.testing.adapter import RuntimeAdapter, extend_page_keys
from kvlife.testing.events import Close, Complete, Finish, KitEvent, Resume, Return, Start, Step
from kvlife.testing.options import KitOptions, Progress, progress_of

__all__ = ["InvariantViolation", "Life", "Oracle"]


class InvariantViolation(KVLifeError, AssertionError):
    """The runtime broke one of the lifecycle rules; ``rule`` names it."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"[{rule}] {message}")
        self.rule = rule


@dataclass(eq=False, slots=True)
class Life:
    """The oracle's model of one request life."""

    index: int
    rid: str
    handle: object
    tokens: list[int]
    keys: list[str] = field(default_factory=list)
    reason: FinishReason | None = None
    released: bool = False
    resumed: bool = False
    #: Copies this life submitted, in submit order.
    copies: list[object] = field(default_factory=list)
    #: A returning conversation's life: its prompt pages and how many its loads cover.
    returned: bool = False
    prompt_pages: int = 0
    loaded_pages: int = 0
    #: Its restored pages were checked (before its first decode step).
    restore_checked: bool = False
    #: Prompt pages a failed load covered: to be recomputed (or loaded again) before the
    #: life decodes on them (the failed-load rule, checked after its next step). Armed at
    #: the first poll after the failed copy completed (the runtime learns of it there).
    failed_pages: int = 0
    failed_unpolled: int = 0

    @property
    def running(self) -> bool:
        """Started and not finished."""
        return self.reason is None

    def __repr__(self) -> str:
        return f"life {self.index} (rid {self.rid})"


class _Stuck(BaseException):
    """Raised by the deadline's alarm inside a runtime call that blocks too long."""


@contextlib.contextmanager
def _deadline(seconds: float | None) -> Iterator[None]:
    """Interrupt the block with :class:`_Stuck` after ``seconds`` (main thread, POSIX only;
    elsewhere no deadline). An outer alarm (pytest-timeout's) is put back afterwards."""
    if (
        seconds is None
        or not hasattr(signal, "setitimer")
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    done = False

    def on_alarm(signum: int, frame: object) -> None:
        if not done:
            raise _Stuck  # again every 50 ms, in case a callback swallowed it

    t0 = time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_delay, _ = signal.setitimer(signal.ITIMER_REAL, seconds, 0.05)
    try:
        yield
    finally:
        done = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            left = old_delay - (time.monotonic() - t0)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3))


class Oracle:
    """The trusted model: drives an adapter and checks every rule after every event. Under
    ``"drain"`` progress every copy in flight when a poll starts completes in it; a copy
    submitted during a finish belongs to the finishing life."""

    def __init__(self, adapter: RuntimeAdapter, options: KitOptions | None = None) -> None:
        self.adapter = adapter
        self.options = options or KitOptions()
        self.progress: Progress = progress_of(adapter)
        self.lives: list[Life] = []
        self.trace: list[KitEvent] = []
        self._by_handle: dict[int, list[Life]] = {}
        self._owner: dict[int, Life] = {}  # id(copy) -> life (the copy is kept in life.copies)
        self._completed: set[int] = set()
        self._allowed: set[str] = set()
        self._verified: set[str] = set()
        self._releases_seen = 0
        self._flushing: Life | None = None
        # The load half (adapters with copy_is_load / copy_keys): keys some store copy wrote
        # whole, and each load copy's keys until its bytes were checked.
        self._is_load = getattr(adapter, "copy_is_load", None)
        self._copy_keys = getattr(adapter, "copy_keys", None)
        self._written: set[str] = set()
        self._loads: dict[int, tuple[Life, tuple[str, ...]]] = {}
        #: A call did not return within the deadline: the adapter is left as it is.
        self.stuck = False
        #: Rules that had something to judge, and how often (coverage).
        self.reached: Counter[str] = Counter()

    def running(self) -> list[Life]:
        """Lives started and not finished."""
        return [life for life in self.lives if life.running]

    def growing(self, max_tokens: int) -> list[Life]:
        """Running lives with fewer than ``max_tokens`` tokens and no load in flight (a
        request waits for its prefix before it decodes)."""
        loading = {id(life) for life, _ in self._loads.values()}
        return [
            life
            for life in self.running()
            if len(life.tokens) < max_tokens and id(life) not in loading
        ]

    def idle(self, rids: Iterable[str]) -> list[str]:
        """Those of ``rids`` no running life uses."""
        busy = {life.rid for life in self.running()}
        return [rid for rid in rids if rid not in busy]

    def returnable(self, max_tokens: int) -> list[Life]:
        """Lives whose conversation may return now: its rid idle, its tokens under
        ``max_tokens``."""
        idle = set(self.idle(life.rid for life in self.lives))
        return [lf for lf in self.lives if lf.rid in idle and len(lf.tokens) < max_tokens]

    def resumable(self) -> list[Life]:
        """Retracted lives not yet resumed whose rid no running life uses."""
        idle = set(self.idle(life.rid for life in self.lives))
        return [
            life
            for life in self.lives
            if life.reason is FinishReason.RETRACTED and not life.resumed and life.rid in idle
        ]

    def owner(self, copy: object) -> Life:
        """The life that submitted ``copy`` (a copy :meth:`check` has seen)."""
        return self._owner[id(copy)]

    def unreleased(self) -> int:
        """Lives not released yet (they hold device pages)."""
        return sum(not life.released for life in self.lives)

    def in_flight(self, life: Life | None = None) -> list[object]:
        """Copies the kit has not completed (only ``life``'s if given), in submit order."""
        lives = self.lives if life is None else [life]
        return [c for lf in lives for c in lf.copies if id(c) not in self._completed]

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.reached["stuck-copy"] += 1
        try:
            with _deadline(self.options.stuck_after):
                return fn(*args)
        except _Stuck:
            self.stuck = True
            raise InvariantViolation(
                "stuck-copy",
                f"{what} did not return within {self.options.stuck_after} s: it waits for a "
                f"copy whose ack never comes (copies in flight: {self.in_flight()})",
            ) from None

    def apply(self, event: KitEvent) -> None:
        """Run ``event`` on the adapter, update the model, check every rule."""
        if isinstance(event, Close):
            self.close()
            return
        self.trace.append(event)
        if isinstance(event, Start):
            self._start(event.rid, event.prompt)
        elif isinstance(event, Resume):
            life = self.lives[event.life]
            life.resumed = True
            self._start(life.rid, tuple(life.tokens), life)
        elif isinstance(event, Return):
            old = self.lives[event.life]
            self._start(old.rid, (*old.tokens, *(0,) * self.adapter.page_size))
            new = self.lives[-1]
            new.returned, new.prompt_pages = True, len(new.keys)
            restore = getattr(self.adapter, "restore", None)
            if restore is not None:
                self._call(str(event), restore, self.lives[-1].handle)
        elif isinstance(event, Step):
            life = self.lives[event.life]
            if life.returned and not life.restore_checked:
                self.check()  # registers the copies submitted so far
                self._check_restored(life)
            life.tokens.extend(event.tokens)
            self._extend_keys(life)
            self._call(str(event), self.adapter.step, life.handle, event.tokens)
            if life.failed_pages:
                self.check()  # registers a load the step submitted again
                self._check_failed_load(life)
        elif isinstance(event, Finish):
            life = self.lives[event.life]
            self.check()  # copies submitted before the finish are not a flush
            life.reason = event.reason
            self._flushing = life
            try:
                self._call(str(event), self.adapter.finish, life.handle, event.reason)
                self._check_copies()  # a finish-time flush belongs to the finishing life
            finally:
                self._flushing = None
        elif isinstance(event, Complete):
            life = self.lives[event.life]
            self.check()  # registers the copies submitted so far
            if event.chunk >= len(life.copies):
                raise InvariantViolation(
                    "copy-owner",
                    f"{life} submitted {len(life.copies)} chunks; chunk {event.chunk} "
                    "was due and never submitted",
                )
            copy = life.copies[event.chunk]
            self._completed.add(id(copy))
            self._call(str(event), self.adapter.complete, copy, event.ok)
            self._copied(copy, event.ok)
            if event.poll:
                self._poll()
        else:
            self._poll()
        self.check()

    def _poll(self) -> None:
        queued: list[object] = []
        if self.progress == "drain":
            self.check()  # registers the copies queued before the poll
            queued = self.in_flight()
        self._call("poll", self.adapter.poll)
        self._completed.update(id(c) for c in queued)  # a draining poll waited for each
        for copy in queued:
            self._copied(copy, True)
        for life in self.lives:  # the runtime has applied its failed loads' acks now
            if life.failed_unpolled:
                life.failed_pages = max(life.failed_pages, life.failed_unpolled)
                life.failed_unpolled = 0

    def _copied(self, copy: object, ok: bool) -> None:
        """A copy the kit completed: a store's keys are written; a load's bytes are checked
        (the load-bytes rule), unless the copy failed or its life is gone."""
        if self._copy_keys is None:
            return
        load = self._loads.pop(id(copy), None)
        if load is None:
            if ok and id(copy) in self._owner:
                self._written.update(self._copy_keys(copy))
            return
        life, keys = load
        if life.released:
            return
        self.reached["load-bytes"] += ok
        if not ok:  # its pages hold whatever the copy left: recomputed before a decode
            life.failed_unpolled = max(life.failed_unpolled, len(keys))
            return
        for i, key in enumerate(keys):
            if not self._page_holds(life, i, key):
                raise InvariantViolation(
                    "load-bytes",
                    f"{life}'s page {i} after its load holds other bytes than the page stored "
                    f"under {key[:12]}.. (a host page evicted or rewritten under the load?)",
                )

    def complete(self, copy: object, ok: bool, poll: bool) -> None:
        """Complete one copy the adapter lists as in flight (the stateful machine's event)."""
        self.check()
        life = self.owner(copy)
        self.apply(Complete(life.index, life.copies.index(copy), ok, poll))

    def _start(self, rid: str, prompt: tuple[int, ...], resumed: Life | None = None) -> None:
        # An adapter written before resume was explicit has none: the new life just starts.
        if resumed is None or getattr(self.adapter, "resume", None) is None:
            handle = self._call(f"start rid={rid}", self.adapter.start, rid, prompt)
        else:
            what = f"resume life {resumed.index}"
            handle = self._call(what, self.adapter.resume, resumed.handle, prompt)
        reused = any(life.handle is handle for life in self._by_handle.get(id(handle), []))
        if reused and (resumed is None or handle is not resumed.handle):
            raise InvariantViolation(
                "copy-owner", "start returned the handle of an older life (resume did not ask)"
            )
        life = Life(len(self.lives), rid, handle, list(prompt))
        self.lives.append(life)
        self._by_handle.setdefault(id(handle), []).append(life)
        self._extend_keys(life)

    def _extend_keys(self, life: Life) -> None:
        new = extend_page_keys(
            life.keys, life.tokens, self.adapter.page_size, self.adapter.namespace
        )
        self._allowed.update(new)

    def close(self) -> None:
        """Finish every running life, complete every copy, poll, close; then the final rules."""
        for life in self.running():
            self.apply(Finish(life.index, FinishReason.FINISHED))
        self.trace.append(Close())
        self.check()
        if self.progress == "poll":
            for copy in self.in_flight():
                self._completed.add(id(copy))
                self._call(f"complete {copy!r}", self.adapter.complete, copy, True)
                self._copied(copy, True)
        self._poll()
        self.check()
        # A copy the kit completed may take a moment to leave a threaded engine's list.
        deadline = time.monotonic() + (self.options.stuck_after or 0.0)
        listed = self.adapter.copies_in_flight
        while any(id(c) in self._completed for c in listed()) and time.monotonic() < deadline:
            time.sleep(0.002)
            self._poll()
            self.check()
        self._liveness()
        self._call("close", self.adapter.close)
        self.check()
        left = self.adapter.copies_in_flight()
        if left:
            raise InvariantViolation(
                "stuck-copy",
                f"copies still in flight after close (their ack never came within "
                f"{self.options.stuck_after} s): {list(left)}",
            )
        never = [life for life in self.lives if not life.released]
        if never:
            raise InvariantViolation("unreleased", f"never released (device pages leaked): {never}")
        used = self.adapter.host_pages_allocated()
        self.reached["host-leak"] += 1
        self.reached["device-leak"] += (
            getattr(self.adapter, "device_pages_allocated", None) is not None
        )
        if used:
            raise InvariantViolation("host-leak", f"{used} host pages still allocated after close")
        held = getattr(self.adapter, "device_pages_allocated", None)
        if held is not None and held():
            raise InvariantViolation(
                "device-leak", f"{held()} device pages still held after every life was released"
            )

    def unsettled(self) -> list[tuple[str, str]]:
        """What is stuck now, as (rule, what): lives not released, pins held, keys pending,
        host pages neither free nor held by the host tier (the optional adapter members
        ``pinned_pages``, ``pending_keys`` and ``host_pages_held_by_tier`` say; without them
        those are not checked before close)."""
        found: list[tuple[str, str]] = []
        self.reached["unreleased"] += 1
        never = [life for life in self.lives if not life.released]
        if never:
            found.append(("unreleased", f"lives never released: {never}"))
        pinned = getattr(self.adapter, "pinned_pages", None)
        pending = getattr(self.adapter, "pending_keys", None)
        by_tier = getattr(self.adapter, "host_pages_held_by_tier", None)
        for rule, member in (("stuck-pin", pinned), ("stuck-pending", pending)):
            self.reached[rule] += member is not None
        if pinned is not None and pinned():
            found.append(("stuck-pin", f"{pinned()} host pages still pinned for a load"))
        keys = list(pending()) if pending is not None else []
        if keys:
            shown = ", ".join(f"{k[:12]}.." for k in keys[:4])
            found.append(("stuck-pending", f"{len(keys)} keys still pending: {shown}"))
        if by_tier is not None:
            loose = self.adapter.host_pages_allocated() - by_tier()
            if loose:
                found.append(("host-leak", f"{loose} host pages neither free nor in the tier"))
        return found

    def _liveness(self) -> None:
        """The liveness phase: no new input, up to ``options.liveness_polls`` polls, then
        everything settled (docs/testing-kit.md, "The liveness phase")."""
        polls = self.options.liveness_polls
        for _ in range(polls):
            if not self.unsettled():
                return
            self._poll()
            self.check()
        found = self.unsettled()
        if found:
            rule = found[0][0]
            what = "; ".join(text for _, text in found)
            raise InvariantViolation(
                rule,
                f"liveness: after the last input and {polls} polls with no new work, {what}",
            )

    def run(self, events: Iterable[KitEvent]) -> None:
        """Apply ``events`` up to the first :class:`Close`; abandon the adapter unless that
        close passed (on a failure, or when the events end without one)."""
        closed = False
        try:
            for event in events:
                self.apply(event)
                if isinstance(event, Close):
                    closed = True
                    break
        finally:
            if not closed:
                self.abandon()

    def abandon(self) -> None:
        """Close the adapter after a failure, bounded by the deadline; errors are dropped.
        An adapter that was stuck is not called again."""
        if self.stuck:
            return
        with contextlib.suppress(Exception, _Stuck), _deadline(self.options.stuck_after):
            self.adapter.close()

    def check(self) -> None:
        """Compare what the adapter reports now with the model; raise on the first broken rule."""
        self._check_copies()
        self._check_releases()
        self._check_store()

    def _lives_of(self, handle: object, what: str) -> list[Life]:
        lives = [life for life in self._by_handle.get(id(handle), []) if life.handle is handle]
        if not lives:
            raise InvariantViolation("copy-owner", f"{what} names an unknown request {handle!r}")
        return lives

    def _check_copies(self) -> None:
        for copy in self.adapter.copies_in_flight():
            key = id(copy)
            if key in self._owner:
                continue  # known; a completed one still listed is waited for at close
            lives = self._lives_of(self.adapter.copy_request(copy), f"copy {copy!r}")
            life = next((lf for lf in lives if lf.running), None)
            if life is None and self._flushing in lives and not self._flushing.released:
                life = self._flushing
            if life is None:
                raise InvariantViolation(
                    "copy-owner", f"{copy!r} submitted for {lives[-1]}, which already finished"
                )
            self._owner[key] = life
            self.reached["copy-owner"] += 1
            life.copies.append(copy)
            if self._is_load is not None and self._is_load(copy):
                self._check_load(copy, life)

    def _check_restored(self, life: Life) -> None:
        """Before a returning life decodes: every prompt page no load covered holds its KV
        (the restore-bytes rule; loaded pages were checked when their copy completed)."""
        life.restore_checked = True
        self.reached["restore-bytes"] += 1
        for i in range(life.loaded_pages, life.prompt_pages):
            if not self._page_holds(life, i, life.keys[i]):
                raise InvariantViolation(
                    "restore-bytes",
                    f"{life} decodes while its prompt page {i} holds neither a load's bytes nor "
                    f"its computed KV ({life.loaded_pages} of {life.prompt_pages} pages loaded)",
                )

    def _check_failed_load(self, life: Life) -> None:
        """After a step of a life whose load failed: the pages that load covered hold their
        computed KV (recomputed), unless a new load of them is still in flight (the runtime
        loads them again and waits; that load's bytes are checked when it completes)."""
        self.reached["failed-load"] += 1
        reloading = max((len(keys) for lf, keys in self._loads.values() if lf is life), default=0)
        for i in range(reloading, life.failed_pages):
            if not self._page_holds(life, i, life.keys[i]):
                raise InvariantViolation(
                    "failed-load",
                    f"{life} decoded on its prompt page {i}, which a failed load covered and "
                    "nothing recomputed or loaded again (a failed load reported as loaded?)",
                )
        life.failed_pages = 0

    def _page_holds(self, life: Life, index: int, key: str) -> bool:
        """Whether the life's ``index``-th device page holds the bytes of ``key`` (true when
        the adapter cannot show its device pages: nothing to compare)."""
        device_page = getattr(self.adapter, "device_page", None)
        return device_page is None or device_page(life.handle, index) == self.adapter.page_bytes(
            key
        )

    def _check_load(self, copy: object, life: Life) -> None:
        """A new load: every key it reads was written whole by a store copy, or is stored
        (the pending-load rule: a key whose store is still in flight is never loaded)."""
        keys = tuple(self._copy_keys(copy)) if self._copy_keys is not None else ()
        stored = set(self.adapter.stored_keys())
        for key in keys:
            if key not in self._written and key not in stored:
                raise InvariantViolation(
                    "pending-load",
                    f"{life} loads key {key[:12]}.., which no completed copy wrote and the "
                    "store does not hold (its store still in flight?)",
                )
        self.reached["pending-load"] += 1
        self._loads[id(copy)] = (life, keys)
        life.loaded_pages = max(life.loaded_pages, len(keys))

    def _check_releases(self) -> None:
        releases = self.adapter.releases()
        while self._releases_seen < len(releases):
            release = releases[self._releases_seen]
            self._releases_seen += 1
            self.reached.update(("release-once", "release-in-flight"))
            lives = self._lives_of(release.request, "a release")
            waiting = [lf for lf in lives if not lf.released]
            if not waiting:
                raise InvariantViolation("release-once", f"{lives[-1]} released twice")
            ended = [lf for lf in waiting if not lf.running]
            if not ended:
                raise InvariantViolation(
                    "release-once",
                    f"{waiting[0]} released before it finished (an ack moved a life it does "
                    "not belong to?)",
                )
            # Lives sharing one request object: the release is of one that may be released.
            life = next((lf for lf in ended if not self.in_flight(lf)), ended[0])
            pending = self.in_flight(life)
            if release.copies_in_flight or pending:
                raise InvariantViolation(
                    "release-in-flight",
                    f"{life} released (device pages {list(release.device_pages)}) with "
                    f"{max(release.copies_in_flight, len(pending))} copies in flight: {pending}",
                )
            life.released = True

    def _check_store(self) -> None:
        for key in list(self.adapter.stored_keys()):
            if key in self._verified:
                continue
            if key not in self._allowed:
                raise InvariantViolation(
                    "hash-chain",
                    f"page stored under key {key[:12]}.., which no life's tokens hash to in "
                    "page order",
                )
            self.reached.update(("hash-chain", "misfiled-page"))
            if self.adapter.stored_page(key) != self.adapter.page_bytes(key):
                raise InvariantViolation(
                    "misfiled-page",
                    f"page stored under key {key[:12]}.. holds another page's bytes",
                )
            self._verified.add(key)
