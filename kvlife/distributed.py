"""Agreement across the ranks of one tensor-parallel group, over ``torch.distributed``:
:class:`TorchAgreement` makes every rank apply the same acks in the same order. The words,
the host budget, loads and every failure case are in ``docs/distributed.md``.
"""

from __future__ import annotations

import heapq
import time
import zlib
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from kvlife._checks import finite_seconds
from kvlife._lifecycle import LoadTicket, Ticket, is_ticket
from kvlife.engine.base import Ack
from kvlife.errors import AgreementError, ConfigError, GroupBroken

if TYPE_CHECKING:
    from kvlife.pool import HostPagePool

__all__ = ["TorchAgreement", "chunk_fingerprint"]

_MOD = (1 << 61) - 1  # a Mersenne prime: the running fingerprint lives in [0, 2**61)
_MULT = 0x9E3779B97F4A7C15 % _MOD
_NONE = (1 << 62) - 1  # "no failure" / "no host pool" in a MIN word
_WORDS = 7
_LOAD_MARK = 1 << 24  # added to a load's page count in its fingerprint word


def chunk_fingerprint(fp: int, n_pages: int, last_key: str) -> int:
    """The running fingerprint after one more chunk: cheap, stable across processes."""
    word = zlib.crc32(last_key.encode()) | (n_pages << 32)
    return (fp + word + 1) * _MULT % _MOD


def _describe(ticket: Ticket | LoadTicket) -> str:
    owner, seq, keys = ticket[:3]
    key = keys[-1] if keys else ""
    what = "load" if type(ticket) is LoadTicket else "chunk"
    rid = getattr(owner, "rid", owner)  # a Lifecycle's rid, or a host's own record
    return f"{what} rid={rid!r:.60} seq={seq} pages={len(keys)} last key {key[:16]}"


def _index_key(ticket: Ticket | LoadTicket) -> tuple[object, ...]:
    """A submission's key: ``(owner, seq)`` for a chunk, ``(owner, seq, "load")`` for a
    load (an owner numbers its loads apart from its chunks, from 0 too)."""
    key = ticket[:2]
    return (*key, "load") if type(ticket) is LoadTicket else key


def _is_load_ticket(obj: object) -> bool:
    """Whether ``obj`` has a :class:`~kvlife.LoadTicket`'s shape: an owner (not ``None``),
    an int seq and a non-empty tuple of keys (as :func:`~kvlife._lifecycle.is_ticket`)."""
    return (
        type(obj) is LoadTicket
        and obj[0] is not None
        and type(obj[1]) is int
        and type(obj[2]) is tuple
        and len(obj[2]) > 0
    )


class TorchAgreement:
    """Agreement over a ``torch.distributed`` group: one MIN all-reduce of 7 int64 per poll,
    so an ack is applied once its copy is complete on every rank, a copy failed on any rank
    fails on all, and ranks that submitted different chunks, or a peer that crashed or went
    silent, raise :class:`~kvlife.errors.GroupBroken`.

    ``group``: any process group (default: the world; one without gloo gets a
    gloo group of the same ranks). ``timeout``: seconds a collective may wait for
    a peer before :class:`~kvlife.errors.GroupBroken`. ``host``: the host page pool
    the manager allocates from, for :meth:`admit`'s agreed budget (without it,
    ``admit`` always says yes). Every rank constructs it at the same point (with
    ``host`` the constructor runs one collective) and polls the same number of times.
    """

    def __init__(
        self, group: Any = None, *, timeout: float = 60.0, host: HostPagePool | None = None
    ) -> None:
        self.timeout = finite_seconds("timeout", timeout)
        if self.timeout == 0:
            raise ConfigError("timeout must be a positive number of seconds, got 0")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "torch.distributed is not initialized: call init_process_group first "
                "(one process needs no agreement: pass agreement=None)"
            )
        self._wait = timedelta(seconds=self.timeout)
        group = group if group is not None else dist.group.WORLD
        if "gloo" not in str(dist.get_backend(group)):  # NCCL: a gloo group of the same ranks
            ranks = dist.get_process_group_ranks(group)
            group = dist.new_group(
                ranks=ranks, backend="gloo", timeout=self._wait, use_local_synchronization=True
            )
        self.group = group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self._buf = torch.zeros(_WORDS, dtype=torch.int64)
        self._words = self._buf.numpy()
        # Submissions, by absolute submission index.
        self._count = 0  # submitted
        self._applied = 0  # returned by agree, on every rank alike
        self._done = 0  # local completed prefix
        self._index: dict[tuple[object, ...], int] = {}  # pending submission -> its index
        self._acks: dict[int, Ack] = {}  # completed locally, not yet applied
        self._failed: list[int] = []  # heap of indices in _acks whose copy failed
        self._dups: dict[int, list[Ack]] = {}  # duplicate acks, returned after the original
        self._strays: list[Ack] = []  # acks of no pending chunk: the Lifecycle refuses them
        # Divergence check.
        self._fp = 0
        self._checked = 0  # submissions whose fingerprints all ranks agreed on
        # (fp after, ticket) since _checked
        self._history: list[tuple[int, Ticket | LoadTicket]] = []
        # Host budget.
        self._host = host
        self._budget = 0
        self._broken: GroupBroken | None = None
        #: Collectives run (one per :meth:`agree` call, one more with ``host``).
        self.collectives = 0
        #: Chunks returned as agreed.
        self.chunks_agreed = 0
        #: Acks returned as failed because another rank's copy failed.
        self.peer_failures = 0
        #: Seconds spent in the collective (sum).
        self.collective_s = 0.0
        if host is not None:
            self._words[:] = [_NONE] * (_WORDS - 1) + [host.num_free]
            self._all_reduce("construction")
            self._budget = int(self._words[6])

    @property
    def pending(self) -> int:
        """Submissions not yet returned by :meth:`agree` (the same on every rank)."""
        return self._count - self._applied

    def submitted(self, ticket: Ticket | LoadTicket) -> None:
        """Record one submission (a chunk or a load): its index, and the running fingerprint."""
        self._check_usable()
        load = _is_load_ticket(ticket)
        if not (load or is_ticket(ticket)):
            raise AgreementError(f"expected a Ticket or a LoadTicket, got {ticket!r:.80}")
        keys = ticket[2]
        key = _index_key(ticket)
        if key in self._index:
            raise AgreementError(f"{_describe(ticket)} was already submitted")
        try:  # before anything changes; a load's page count is marked apart from a chunk's
            fp = chunk_fingerprint(self._fp, len(keys) + (_LOAD_MARK if load else 0), keys[-1])
        except (AttributeError, TypeError):
            raise AgreementError(f"{_describe(ticket)} has a key that is not a str") from None
        self._index[key] = self._count
        self._count += 1
        self._fp = fp
        self._history.append((fp, ticket))

    def admit(self, n_pages: int) -> bool:
        """Whether to take ``n_pages`` host pages now: the same answer on every rank."""
        if self._host is None:
            return True
        if n_pages > self._budget:
            return False
        self._budget -= n_pages
        return True

    def least(self, value: int) -> int:
        """The smallest of every rank's ``value``: one MIN all-reduce of the same seven words
        as :meth:`agree` (two of them mark this call, so ranks that call different
        collectives at one point raise :class:`~kvlife.errors.GroupBroken`, not a wrong
        answer). Every rank calls it at the same point."""
        self._check_usable()
        if type(value) is not int or not 0 <= value < _NONE:
            raise AgreementError(f"least() takes an int in [0, 2**62 - 1), got {value!r:.40}")
        self._words[:] = [value, -1, 1] + [_NONE] * (_WORDS - 3)
        self._all_reduce("least")
        agreed, mark, counter, *_ = self._words.tolist()
        if mark != -1 or counter != 1:
            self._mismatched("least")
        return int(agreed)

    def agree(self, acks: list[Ack]) -> list[Ack]:
        """Take this rank's newly completed acks; run the collective; return the agreed ones.

        The returned acks are those complete on every rank, in submission order
        (a failure anywhere is a failure here), then any duplicate or unknown
        acks, for the Lifecycle to refuse.
        """
        self._check_usable()
        for ack in acks:
            if not isinstance(ack, Ack):
                raise AgreementError(f"expected an Ack, got {type(ack).__name__}")
        index, store = self._index, self._acks
        for ack in acks:
            i = index.get(_index_key(ack.ticket))
            if i is None:
                self._strays.append(ack)
            elif i in store:
                self._dups.setdefault(i, []).append(ack)
            else:
                store[i] = ack
                if ack.error is not None:
                    heapq.heappush(self._failed, i)
        done = self._done
        while done in store:
            done += 1
        self._done = done

        words = self._words
        count, fp = self._count, self._fp
        first_failed = self._failed[0] if self._failed else _NONE
        free_here = self._host.num_free if self._host is not None else _NONE
        words[:] = [done, count, -count, fp, -fp, first_failed, free_here]  # docs/distributed.md
        self._all_reduce("poll")
        agreed_done, fewest, most, low, high, first_failure, free = words.tolist()
        if fewest < 0:  # a peer ran least() at this point: its -1 is the smallest count
            self._mismatched("poll")
        if fewest != -most or low != -high:
            self._diverged(fewest, -most)
        self._checked = count
        self._history.clear()
        self._budget = free

        agreed = min(agreed_done, first_failure + 1)
        out: list[Ack] = []
        for i in range(self._applied, agreed):
            ack = store.pop(i)
            if ack.error is not None:
                heapq.heappop(self._failed)  # failures leave in index order too
            elif i == first_failure:
                ack = replace(
                    ack,
                    error=AgreementError(
                        f"chunk {_describe(ack.ticket)} (submission {i}) failed on another rank"
                    ),
                )
                self.peer_failures += 1
            del index[_index_key(ack.ticket)]
            out.append(ack)
            extra = self._dups.pop(i, None)
            if extra:
                out.extend(extra)
        if agreed > self._applied:
            self.chunks_agreed += agreed - self._applied
            self._applied = agreed
        if self._strays:
            out.extend(self._strays)
            self._strays = []
        return out

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken  # the same error again: nothing may be applied after it

    def _all_reduce(self, what: str) -> None:
        """One MIN all-reduce of the words; any failure becomes a (sticky) GroupBroken."""
        t0 = time.perf_counter()
        try:
            work = dist.all_reduce(self._buf, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            finished = work.wait(timeout=self._wait)
        except RuntimeError as exc:
            self._fail(exc, what, time.perf_counter() - t0)
        if finished is False:
            self._fail(None, what, time.perf_counter() - t0)
        self.collectives += 1
        self.collective_s += time.perf_counter() - t0

    def _fail(self, exc: BaseException | None, what: str, elapsed: float) -> NoReturn:
        timed_out = exc is None or "timed out" in str(exc).lower() or elapsed >= self.timeout
        why = "no peer answer in time" if timed_out else "a peer's connection broke"
        self._break(
            f"rank {self.rank} of {self.world_size}: the agreement's {what} collective failed "
            f"after {elapsed:.1f} s (timeout {self.timeout:g} s; {why}): a peer rank crashed, "
            f"hung or stopped polling. Nothing was applied. Cause: {exc}",
            cause=exc,
        )

    def _break(self, message: str, *, cause: BaseException | None = None, **where: Any) -> NoReturn:
        """Raise GroupBroken, and the same error at every later call: broken for good."""
        self._broken = GroupBroken(message, **where)
        raise self._broken from cause

    def _mismatched(self, what: str) -> NoReturn:
        self._break(
            f"rank {self.rank} of {self.world_size} ran the agreement's {what} collective "
            "while a peer ran another (a poll against a lookup's or load's): the ranks' "
            "calls diverged"
        )

    def _diverged(self, fewest: int, most: int) -> NoReturn:
        """Gather every rank's fingerprints since the last agreed poll; raise at the first diff."""
        mine = [(fp, _describe(ticket)) for fp, ticket in self._history]
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, (self._checked, mine), group=self.group)
        except RuntimeError as exc:
            self._fail(exc, "divergence diagnosis", 0.0)
        base = min(int(entry[0]) for entry in gathered)
        histories: list[list[tuple[int, str]]] = [
            [(0, "")] * (int(b) - base) + list(h) for b, h in gathered
        ]
        longest = max(len(h) for h in histories)
        first = next(
            (
                j
                for j in range(longest)
                if len({h[j][0] if j < len(h) else None for h in histories}) > 1
            ),
            longest,
        )
        chunks = [h[first][1] if first < len(h) else None for h in histories]
        index = base + first
        lines = "; ".join(f"rank {r}: {c or 'no chunk'}" for r, c in enumerate(chunks))
        self._break(
            f"ranks submitted different chunk sequences ({fewest} to {most} submissions); "
            f"the first differing chunk is submission {index}: {lines}",
            index=index,
            chunks=chunks,
        )
