"""Issue 36 items 5 and 6: a store serves only its own namespace's pages, and keeps them
private.

Real files and directories: a page file copied or hard-linked from one namespace into
another, a page of the previous format written byte by byte, the modes on disk under a
real umask.
"""

from __future__ import annotations

import os
import shutil
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import xxhash

from kvlife.errors import ConfigError
from kvlife.store import LocalDirectoryStore, MemoryStore
from kvlife.store.base import (
    MAX_NAMESPACE_BYTES,
    frame_page,
    parse_header,
    unframe_page,
)


def key(i: int) -> str:
    return f"{i:064x}"


def page(tag: int, numel: int = 64) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.int32).add(tag).reshape(1, numel)


def raw(p: torch.Tensor) -> bytes:
    return p.contiguous().view(torch.uint8).numpy().tobytes()


def put(s: LocalDirectoryStore | MemoryStore, k: str, p: torch.Tensor) -> None:
    s.put("t", [k], p)
    (result,) = s.drain()
    assert result.ok, result.error


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The common umask, under which the old store made 0755 directories and 0644 pages."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# ----------------------------------------------------------------------------- item 5


@pytest.mark.parametrize("how", ["link", "copy"])
def test_issue36_5_a_page_of_another_namespace_is_a_counted_miss(tmp_path: Path, how: str) -> None:
    """Scenario: a page file of ``model-a/rank0`` is hard-linked or copied to the same key's
    path in ``model-b/rank0``. Model B must not serve it (it is model A's KV): a miss
    counted in ``pages_corrupt``; B's own put of the key then stores B's page, and A
    still serves its own bytes."""
    k, a_page, b_page = key(7), page(1), page(2)
    with (
        LocalDirectoryStore(tmp_path, "model-a/rank0") as a,
        LocalDirectoryStore(tmp_path, "model-b/rank0") as b,
    ):
        put(a, k, a_page)
        b.path(k).parent.mkdir(parents=True, exist_ok=True)
        if how == "link":
            os.link(a.path(k), b.path(k))
        else:
            shutil.copyfile(a.path(k), b.path(k))
        assert b.get(k) is None
        assert not b.contains(k)
        out = bytearray(len(raw(b_page)))
        assert b.get_into(k, memoryview(out)) is False
        assert b.stats().pages_corrupt == 3
        put(b, k, b_page)  # not a PageMismatch: the foreign page is replaced
        assert b.get(k) == raw(b_page)
        assert a.get(k) == raw(a_page)
        assert a.stats().pages_corrupt == 0


def test_issue36_5_a_page_of_the_previous_format_is_a_counted_miss(tmp_path: Path) -> None:
    """Scenario: a page file written by the previous version (format 1: magic, version,
    key length, payload length, checksum, key; no namespace) sits under its key. It is a
    counted miss, never misread as a page of format 2, and a put replaces it."""
    k, p = key(3), page(5)
    payload = raw(p)
    old = (
        struct.pack("<4sBBQQ", b"KVLP", 1, len(k), len(payload), xxhash.xxh3_64_intdigest(payload))
        + k.encode()
        + payload
    )
    with LocalDirectoryStore(tmp_path, "model/rank0") as s:
        s.path(k).parent.mkdir(parents=True, exist_ok=True)
        s.path(k).write_bytes(old)
        assert s.get(k) is None and not s.contains(k)
        assert s.stats().pages_corrupt == 2
        put(s, k, p)
        assert s.get(k) == payload
        assert s.path(k).read_bytes() != old
    assert parse_header(k, old) is None
    assert unframe_page(k, old) is None


def test_issue36_5_the_frame_binds_key_and_namespace() -> None:
    """A frame verifies only under its own key and namespace, whatever the other is."""
    payload = b"\x01" * 100
    framed = frame_page(key(1), payload, "model-a/rank0") + payload
    assert unframe_page(key(1), framed, "model-a/rank0") == payload
    assert unframe_page(key(1), framed, "model-b/rank0") is None
    assert unframe_page(key(1), framed, "model-a/rank") is None  # a prefix is not the name
    assert unframe_page(key(1), framed) is None
    assert unframe_page(key(2), framed, "model-a/rank0") is None
    plain = frame_page(key(1), payload) + payload
    assert unframe_page(key(1), plain) == payload
    assert unframe_page(key(1), plain, "model-a/rank0") is None


def test_issue36_5_a_namespace_no_header_holds_is_refused_before_anything(tmp_path: Path) -> None:
    """A namespace longer than a page header holds is a ConfigError; nothing is created."""
    long_ns = "/".join(["n" * 99] * (MAX_NAMESPACE_BYTES // 100 + 1))
    with pytest.raises(ConfigError):
        LocalDirectoryStore(tmp_path / "root", long_ns)
    assert not (tmp_path / "root").exists()


# ----------------------------------------------------------------------------- item 6


def test_issue36_6_pages_and_directories_are_private_by_default(
    tmp_path: Path, umask_022: None
) -> None:
    """Scenario: under umask 022 a store is opened on a new root and stores a page. Every
    directory it made is 0700 and the page 0600: no other local user reads a prompt's KV."""
    root = tmp_path / "root"
    with LocalDirectoryStore(root, "model/rank0") as s:
        put(s, key(1), page(1))
        assert s.mode == 0o600
        made = [root, root / "model", root / "model" / "rank0", s.directory, s.path(key(1)).parent]
        assert {str(d.relative_to(tmp_path)): mode_of(d) for d in made} == {
            str(d.relative_to(tmp_path)): 0o700 for d in made
        }
        assert mode_of(s.path(key(1))) == 0o600


def test_issue36_6_the_mode_is_configurable_and_exact_whatever_the_umask(tmp_path: Path) -> None:
    """mode=0o640 gives 0640 pages and 0750 directories, even under umask 077."""
    old = os.umask(0o077)
    try:
        with LocalDirectoryStore(tmp_path / "root", "m", mode=0o640) as s:
            put(s, key(1), page(1))
            assert mode_of(s.path(key(1))) == 0o640
            assert mode_of(s.path(key(1)).parent) == 0o750
            assert mode_of(s.directory) == 0o750
            assert mode_of(tmp_path / "root") == 0o750
    finally:
        os.umask(old)


def test_issue36_6_an_older_stores_pages_directory_is_made_private_at_open(
    tmp_path: Path, umask_022: None
) -> None:
    """Scenario: pages left readable (0755 directories, 0644 files) by an older version.
    Opening the store gives its ``@pages`` directory the store's mode, so no other user
    can reach them; the pages stay served."""
    with LocalDirectoryStore(tmp_path, "m") as s:
        put(s, key(1), page(1))
    for path in (tmp_path / "m" / "@pages").rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chmod(tmp_path / "m" / "@pages", 0o755)
    with LocalDirectoryStore(tmp_path, "m") as s:
        assert mode_of(s.directory) == 0o700
        assert s.get(key(1)) == raw(page(1))


@pytest.mark.parametrize("mode", [0o400, 0o200, 0o1600, -1, 0o4000, True, "0600", 0.5, None])
def test_issue36_6_a_mode_that_is_not_a_private_page_mode_is_refused_before_anything(
    tmp_path: Path, mode: object
) -> None:
    """A mode that is not permission bits, or that leaves the owner unable to read and
    write the pages, is a ConfigError raised before anything is created."""
    root = tmp_path / "root"
    with pytest.raises(ConfigError, match="mode"):
        LocalDirectoryStore(root, "model/rank0", mode=mode)  # type: ignore[arg-type]
    assert not root.exists()
