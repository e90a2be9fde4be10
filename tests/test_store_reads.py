"""Reads of the directory store never raise, block or flood on what sits at a page path.

Issue 23 items 1 and 2: one safe page read (``LocalDirectoryStore._read``) that
every reader uses (``get``, ``contains``, ``get_into``, a put checking its key):
it opens without following symlinks and without blocking, refuses anything but a
regular file, reads the header first and then at most the payload it declares,
bounded by the page size the store expects. Every ``OSError`` is a counted miss.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import subprocess
import sys
import textwrap
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvlife.errors import InvalidPut
from kvlife.store import LocalDirectoryStore, MemoryStore
from kvlife.store.base import QueuedStore, frame_page, parse_header


def key(i: int) -> str:
    return f"{i:064x}"


def page(tag: int, numel: int = 64) -> torch.Tensor:
    return (torch.arange(numel, dtype=torch.float32) + tag).reshape(1, numel)


def raw(p: torch.Tensor) -> bytes:
    return p.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LocalDirectoryStore]:
    with LocalDirectoryStore(tmp_path / "root", "ns") as s:
        yield s


def stored(s: QueuedStore, k: str, p: torch.Tensor) -> None:
    s.put("t", [k], p)
    (result,) = s.drain()
    assert result.ok, result.error


def misses(s: LocalDirectoryStore, k: str) -> None:
    """Every reader answers a miss for ``k`` and raises nothing."""
    assert s.get(k) is None
    assert not s.contains(k)
    out = bytearray(256)
    assert not s.get_into(k, memoryview(out))
    assert s.get_batch([k]) == [None]


def misses_reading_little(s: LocalDirectoryStore, k: str) -> None:
    """A get of ``k`` is a miss that allocates under 4 MiB; then every reader misses."""
    tracemalloc.start()
    try:
        assert s.get(k) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes allocated to read a 256-byte page"
    misses(s, k)
    assert s.stats().pages_corrupt == 5


def within(seconds: float, call: object) -> object:
    """The value of ``call()`` run on a thread; fails if it has not returned in time."""
    box: list[object] = []
    thread = threading.Thread(target=lambda: box.append(call()), daemon=True)  # type: ignore[operator]
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the read blocked for more than {seconds} s"
    return box[0]


# ----------------------------------------------------------------------------- item 1


def test_defect23_1_a_shard_that_is_a_file_is_a_counted_miss(store: LocalDirectoryStore) -> None:
    """ENOTDIR: the page's shard directory is a file."""
    k = key(1)
    store.directory.joinpath(k[:2]).write_bytes(b"not a directory")
    misses(store, k)
    assert store.stats().read_errors == 4


def test_defect23_1_a_symlink_loop_is_a_counted_miss(store: LocalDirectoryStore) -> None:
    """ELOOP: the page file is a symlink to itself."""
    k = key(1)
    path = store.path(k)
    path.parent.mkdir()
    os.symlink(path.name, path)
    misses(store, k)
    assert store.stats().read_errors == 4


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO, errno.EMFILE])
def test_defect23_1_any_os_error_of_a_read_is_a_counted_miss(
    store: LocalDirectoryStore, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """EACCES, EIO, EMFILE opening the page (injected into both ways a file is opened:
    this suite runs as root, where EACCES never happens)."""
    k = key(1)
    stored(store, k, page(1))

    def failing(real: Callable[..., object]) -> Callable[..., object]:
        def call(file: object, *args: object, **kw: object) -> object:
            if str(file).endswith(".page"):
                raise OSError(code, os.strerror(code), str(file))
            return real(file, *args, **kw)

        return call

    monkeypatch.setattr(os, "open", failing(os.open))
    monkeypatch.setattr(io, "open", failing(io.open))
    misses(store, k)
    monkeypatch.undo()
    assert store.stats().read_errors == 4 and store.stats().pages_corrupt == 0
    assert store.get(k) == raw(page(1))  # the page itself was never touched


# ----------------------------------------------------------------------------- item 2


def test_defect23_2_a_fifo_at_a_page_path_never_blocks(store: LocalDirectoryStore) -> None:
    k = key(1)
    path = store.path(k)
    path.parent.mkdir()
    os.mkfifo(path)
    try:
        within(5, lambda: misses(store, k))
    finally:  # on the old code a reader is stuck in open(): give it a writer and EOF
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert store.stats().pages_corrupt == 4


def test_defect23_2_a_symlink_to_a_real_page_is_not_followed(store: LocalDirectoryStore) -> None:
    """A whole page of the key, but reached through a symlink: not this store's page."""
    k = key(1)
    stored(store, k, page(1))
    path = store.path(k)
    elsewhere = path.with_name("elsewhere")
    os.rename(path, elsewhere)
    os.symlink(elsewhere.name, path)
    misses(store, k)


def test_defect23_2_a_page_path_that_is_a_directory_is_a_miss(store: LocalDirectoryStore) -> None:
    k = key(1)
    store.path(k).mkdir(parents=True)
    misses(store, k)


DEV_ZERO = textwrap.dedent(
    """
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    from kvlife.store import LocalDirectoryStore
    store = LocalDirectoryStore(sys.argv[1], "ns")
    key = "ab" * 32
    path = store.path(key)
    path.parent.mkdir()
    os.symlink("/dev/zero", path)
    assert store.get(key) is None and not store.contains(key)
    print("MISS", store.stats().pages_corrupt + store.stats().read_errors)
    """
)


def test_defect23_2_a_symlink_to_dev_zero_returns_at_once(tmp_path: Path) -> None:
    """Run in a child with 3 GiB of address space: the old read never returned."""
    proc = subprocess.run(
        [sys.executable, "-c", DEV_ZERO, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["MISS", "2"]


def test_defect23_2_a_huge_sparse_file_is_not_read(store: LocalDirectoryStore) -> None:
    """512 MiB behind a valid header of a 256-byte page: read no more than the header."""
    k = key(1)
    path = store.path(k)
    path.parent.mkdir()
    payload = raw(page(1))
    with open(path, "wb") as f:
        f.write(frame_page(k, payload, store.namespace) + payload)
        f.truncate(512 << 20)
    misses_reading_little(store, k)


def test_defect23_2_a_header_declaring_a_huge_payload_is_not_believed(
    store: LocalDirectoryStore,
) -> None:
    k = key(1)
    path = store.path(k)
    path.parent.mkdir()
    payload = raw(page(1))
    head = bytearray(frame_page(k, payload, store.namespace))
    head[8:16] = (1 << 62).to_bytes(8, "little")  # the payload length field
    assert parse_header(k, head, store.namespace) is not None  # a header of this page
    path.write_bytes(bytes(head) + payload)
    misses_reading_little(store, k)


@pytest.mark.parametrize("kind", ["memory", "directory"])
def test_defect23_2_pages_over_the_expected_size_are_refused_and_never_read(
    tmp_path: Path, kind: str
) -> None:
    """``max_page_bytes`` bounds what a put stores and what a read believes."""
    s: QueuedStore
    if kind == "memory":
        s = MemoryStore(max_page_bytes=256)
    else:
        s = LocalDirectoryStore(tmp_path, "ns", max_page_bytes=256)
    with s:
        with pytest.raises(InvalidPut, match="256"):
            s.put("t", [key(1)], page(1, 65))
        assert s.pending == 0
        stored(s, key(1), page(1, 64))
        assert s.get(key(1)) == raw(page(1, 64))
    if kind == "directory":  # a bigger whole page put by a store that allowed it
        with LocalDirectoryStore(tmp_path, "ns") as big:
            stored(big, key(2), page(2, 128))
        with LocalDirectoryStore(tmp_path, "ns", max_page_bytes=256) as small:
            assert small.get(key(2)) is None and small.stats().pages_corrupt == 1


def test_get_into_fills_the_buffer_only_for_a_page_of_that_size(
    store: LocalDirectoryStore,
) -> None:
    k = key(1)
    stored(store, k, page(1))
    out = bytearray(256)
    assert store.get_into(k, memoryview(out)) and bytes(out) == raw(page(1))
    parts = [bytearray(100), bytearray(156)]  # the payload split over two buffers
    assert store.get_into(k, [memoryview(p) for p in parts])
    assert bytes(parts[0] + parts[1]) == raw(page(1))
    assert not store.get_into(k, memoryview(bytearray(255)))  # another size: not this page
    assert not store.get_into(key(2), memoryview(bytearray(256)))
    assert store.stats().pages_corrupt == 0
