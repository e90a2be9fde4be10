"""The Lifecycle API in one walk: submit, ack, finish, release; a reused rid; out-of-order acks.

Run: python examples/lifecycle_basics.py  (no GPU, no store; about a second)
"""

from __future__ import annotations

from kvlife import FinishReason, ForeignAck, InvalidChunk, Lifecycle

PAGE = 4  # tokens per page


def released(life: Lifecycle) -> None:
    """The release callback: here a runtime would hand the request's device pages back."""
    print(f"  release callback: {life!r} may free its device pages now")


def tokens(first: int, pages: int) -> list[int]:
    """Token ids for ``pages`` whole pages, starting at ``first``."""
    return list(range(first, first + pages * PAGE))


def show(label: str, life: Lifecycle) -> None:
    """Print the observable state of ``life``."""
    snap = life.snapshot()
    tail = snap.last_hash[:8] if snap.last_hash else None
    print(f"  {label}: {snap.state.name} inflight={snap.inflight} last_hash={tail}")


def main() -> None:
    """Walk the three scenarios; exit non-zero if kvlife misbehaves."""
    print("1. a reused rid: the late ack of the old life cannot touch the new one")
    old = Lifecycle("req-7", page_size=PAGE, on_release=released)
    old_ticket = old.submit(tokens(0, 2))  # copy of 2 pages in flight
    old.finish(FinishReason.ABORTED)  # aborted while its copy still reads device pages
    show("old", old)
    new = Lifecycle("req-7", page_size=PAGE, on_release=released)  # same rid, new life
    new_ticket = new.submit(tokens(100, 1))
    show("new", new)
    new_before = new.snapshot()
    old_ticket[0].ack(old_ticket)  # a ticket carries its Lifecycle first: old is released
    show("old", old)
    show("new", new)
    if new.snapshot() != new_before:
        raise SystemExit("the old life's ack changed the new life")
    try:
        new.ack(old_ticket)  # a misrouted ack is refused, and changes nothing
    except ForeignAck as exc:
        print(f"  refused: {type(exc).__name__}")
    show("new", new)
    if new.snapshot() != new_before:
        raise SystemExit("a refused ack changed the new life")
    new_ticket[0].ack(new_ticket)
    new.finish()  # nothing in flight: releases at once

    print("2. out-of-order acks: last_hash moves over the acked prefix only")
    life = Lifecycle("req-8", page_size=PAGE, on_release=released)
    first = life.submit(tokens(0, 1))
    second = life.submit(tokens(4, 1))
    life.ack(second)  # second completes first
    show("after ack of chunk 1", life)  # last_hash still None: chunk 0 is in flight
    life.ack(first)
    show("after ack of chunk 0", life)  # now the tail of chunk 1
    if life.last_hash != second[2][-1]:  # the chunk's keys
        raise SystemExit("last_hash should be the key of the last page of chunk 1")

    print("3. bad input is refused before anything changes")
    before = life.snapshot()
    try:
        life.submit(tokens(8, 1)[:3])  # not a whole page
    except InvalidChunk as exc:
        print(f"  refused: {type(exc).__name__}: {exc}")
    if life.snapshot() != before:
        raise SystemExit("a refused event changed the Lifecycle")
    life.finish()


if __name__ == "__main__":
    main()
