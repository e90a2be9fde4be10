"""LocalDirectoryStore: one file per page under a root directory, the embedded default.

File naming
===========

``<root>/<namespace>/@pages/<key[:2]>/<key>.page``

- The namespace is one or more ``/``-separated components (``"llama-7b/rank0"``),
  each made of letters, digits, ``.``, ``_`` and ``-`` and not starting with
  ``.``; so no namespace is absolute, none contains ``..``, and none can reach
  into another namespace's ``@pages`` directory (``@`` is never in a component).
- Keys are 2 to 128 lowercase hex digits (content hashes), never paths. The
  first two digits pick a subdirectory so no directory grows past ~1/256 of the
  pages.
- Opening a store creates the missing directories up to ``@pages``, or none of
  them: a root that is a file (or under one), a path the file system refuses,
  or a namespace that makes the longest page path too long is refused with
  ``ConfigError`` and leaves the disk as it was.

File format and verification
============================

A page file is the page in the shared format of ``kvlife.store.base``
(``frame_page``): a 22-byte header (magic ``KVLP``, version, key length,
payload length, XXH3-64 checksum of the payload), the key's digits, then the
payload. The caller knows the payload's dtype and shape. ``get`` and ``contains`` read the
whole file and check it (``unframe_page``); a file that is truncated, extended,
damaged, of another version or of another key is a miss (``get`` returns None),
counted in ``stats().pages_corrupt``, and the next put of that key replaces it.
``keys()`` lists page file names without reading them.

Atomic writes, first writer wins
================================

The writer thread writes each page to a temporary file in the page's own
directory (``.<key>.<pid>.<random>.tmp``). Only when *every* page of the put
is complete on disk does it give each one its name with ``os.link``, which
fails if the name exists. So a reader (this or another process) sees a page
file only when it is complete, and the first complete page of a key wins, in
any number of processes:

- the name is free: the link makes this put's page the stored one;
- a whole page with the same bytes is there: nothing is written (deduplicated);
- a whole page with other bytes is there: the put fails with ``PageMismatch``
  and the stored page is kept;
- a page failing verification is there: it is moved aside to a temporary name
  and removed (or put back, if another writer had replaced it with a whole page
  in the meantime), and the link is tried again.

A writer killed mid-write leaves a temporary file, never a partial page.
Listing and lookups ignore temporary files; opening a store removes those left
by processes that no longer run on this host (``clean_temps``). The store needs
a file system with hard links (any local POSIX one).

With ``fsync=True`` every temporary file is flushed to the disk before it is
linked and the directories after; without it a killed *process* still leaves
only whole pages, but a power loss may not (and verification turns such a page
into a miss).

Failures
========

All-or-nothing per put: on an error (I/O error, injected fault, or a key that
already holds different bytes) the writer removes the put's temporary files and
every page file this put linked into place, then reports the error. A page that
already held the same bytes is left alone. A put in which a *process kill*
strikes between two links can leave some of its pages visible (each one
complete and correct, as keys are content hashes); no result was reported for
it, so no caller relies on it either way.

Concurrent writers of the same namespace (other processes) are safe for
readers; the rollback of a failed put may remove a page another writer found
already stored with the same bytes in the same instant, which only costs a
later rewrite.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from kvlife.errors import ConfigError, PageMismatch
from kvlife.store.base import (
    QueuedStore,
    Written,
    check_key,
    fault_steps,
    frame_page,
    unframe_page,
)

__all__ = ["LocalDirectoryStore", "check_namespace"]

#: Name of the directory that holds a namespace's pages (``@`` is never in a component).
PAGES_DIR = "@pages"

_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
_PAGE_FILE = re.compile(r"([0-9a-f]{2,128})\.page")
_TEMP_FILE = re.compile(r"\.([0-9a-f]{2,128})\.([0-9]+)\.[0-9a-f]+\.tmp")
# The longest path below ``@pages``: "/ff/" and a temporary file name with a
# 128-digit key, a 10-digit pid and 8 random hex digits.
_LONGEST_BELOW = len("/ff/." + "f" * 128 + "." + "9" * 10 + ".ffffffff.tmp")


def check_namespace(namespace: object) -> tuple[str, ...]:
    """Split a namespace into safe directory components, or raise ConfigError."""
    if not isinstance(namespace, str):
        raise ConfigError(f"namespace must be a str, got {type(namespace).__name__}")
    parts = tuple(namespace.split("/"))
    for part in parts:
        if _COMPONENT.fullmatch(part) is None:
            raise ConfigError(
                f"namespace {namespace!r}: component {part!r} must be 1-100 letters, digits, "
                "'.', '_' or '-' not starting with '.' (no absolute paths, no '..')"
            )
    return parts


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


class LocalDirectoryStore(QueuedStore):
    """Pages as files under ``root/namespace``, written atomically by a writer thread."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: str = "default",
        *,
        fail_rate: float = 0.0,
        seed: int = 0,
        fsync: bool = False,
        clean_temps: bool = True,
    ) -> None:
        parts = check_namespace(namespace)
        self._root = Path(root)
        self._namespace = namespace
        self._directory = self._root.joinpath(*parts, PAGES_DIR)
        self._fsync = fsync
        longest = len(os.fsencode(os.path.abspath(self._directory))) + _LONGEST_BELOW
        if longest >= _path_max():
            base = len(os.fsencode(os.path.abspath(self._root.joinpath(PAGES_DIR))))
            culprit = "the root" if base + _LONGEST_BELOW >= _path_max() else "the namespace"
            raise ConfigError(
                f"root {str(root)[:40]!r}... with namespace {namespace[:40]!r}... gives page "
                f"paths of up to {longest} bytes; the file system takes {_path_max() - 1} "
                f"({culprit} is too long)"
            )
        _make_directories(self._directory)
        if clean_temps:
            self.clean_stale_temps()
        super().__init__(fail_rate=fail_rate, seed=seed, name="directory-store")

    @property
    def root(self) -> Path:
        """The root directory shared by all namespaces."""
        return self._root

    @property
    def namespace(self) -> str:
        """This store's namespace (e.g. model and rank)."""
        return self._namespace

    @property
    def directory(self) -> Path:
        """The directory that holds this namespace's page files."""
        return self._directory

    def path(self, key: str) -> Path:
        """The file a page with ``key`` is stored in."""
        check_key(key)
        return self._directory / key[:2] / f"{key}.page"

    # -- reads

    def get(self, key: str) -> bytes | None:
        """The stored payload bytes of a page, or None when no whole page is stored under it."""
        return self._read(self.path(key), key)

    def contains(self, key: str) -> bool:
        """Whether a whole, verified page file is stored under ``key``."""
        return self.get(key) is not None

    def _read(self, file: Path, key: str, *, count: bool = True) -> bytes | None:
        """The payload of page ``file`` if it is a whole page of ``key``; None if not.

        A file failing verification is counted in ``pages_corrupt`` when ``count``.
        """
        try:
            stored = file.read_bytes()
        except (FileNotFoundError, IsADirectoryError):
            return None
        payload = unframe_page(key, stored)
        if payload is None and count:
            self._count_corrupt()
        return payload

    def keys(self) -> Iterator[str]:
        """Every stored key, read from the directory (temporary files are not pages)."""
        for shard in self._shards():
            with os.scandir(shard) as entries:
                for entry in entries:
                    match = _PAGE_FILE.fullmatch(entry.name)
                    if match and match.group(1)[:2] == shard.name and entry.is_file():
                        yield match.group(1)

    def clean_stale_temps(self) -> int:
        """Remove temporary files left by writers no longer running on this host; count them."""
        removed = 0
        for shard in self._shards():
            with os.scandir(shard) as entries:
                for entry in entries:
                    match = _TEMP_FILE.fullmatch(entry.name)
                    if match and not _pid_alive(int(match.group(2))):
                        try:
                            os.unlink(entry.path)
                        except FileNotFoundError:
                            continue
                        removed += 1
        return removed

    def _shards(self) -> Iterator[Path]:
        try:
            with os.scandir(self._directory) as entries:
                shards = [Path(e.path) for e in entries if len(e.name) == 2 and e.is_dir()]
        except FileNotFoundError:
            return
        yield from shards

    # -- writes (writer thread)

    def _write_page(self, file: BinaryIO, page: memoryview) -> None:
        """Write one page's payload to its open temporary file (an override point for tests)."""
        file.write(page)

    def _fault_steps(self, n_pages: int) -> int:
        # Before writing each page's temporary file, and before each link.
        return 2 * n_pages

    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[memoryview], fault_at: int | None
    ) -> Written:
        n = len(keys)
        temps: dict[int, tuple[Path, Path]] = {}  # page index -> (temporary, final)
        created: list[Path] = []
        tag = f"{os.getpid()}.{secrets.token_hex(4)}"

        step = fault_steps(fault_at, n)

        try:
            for i, key in enumerate(keys):
                step(i, f"before writing page {i}")
                final = self.path(key)
                page = pages[i]
                if self._holds(final, key, page):
                    continue
                final.parent.mkdir(exist_ok=True)
                temp = final.parent / f".{key}.{tag}.tmp"
                temps[i] = (temp, final)
                with open(temp, "xb") as file:
                    file.write(frame_page(key, page))
                    self._write_page(file, page)
                    if self._fsync:
                        file.flush()
                        os.fsync(file.fileno())
            for i in range(n):
                step(n + i, f"before linking page {i}")
                if i in temps:
                    temp, final = temps[i]
                    if self._claim(temp, final, keys[i], pages[i]):
                        created.append(final)
                    temp.unlink()
                    del temps[i]
            if self._fsync:
                for directory in {p.parent for p in created}:
                    _fsync_directory(directory)
        except BaseException:
            for temp, _ in temps.values():
                temp.unlink(missing_ok=True)
            for final in created:
                final.unlink(missing_ok=True)
            raise
        return Written(len(created), n - len(created), len(created) * len(pages[0]))

    def _holds(self, final: Path, key: str, page: memoryview, *, count: bool = True) -> bool:
        """True if ``final`` holds exactly ``page``; PageMismatch if a whole other page.

        False when there is no whole page (none, or one failing verification).
        """
        held = self._read(final, key, count=count)
        if held is not None and held != page:
            raise PageMismatch(
                f"key {key} is stored with different bytes; the stored page is kept", key=key
            )
        return held is not None

    def _claim(self, temp: Path, final: Path, key: str, page: memoryview) -> bool:
        """Give the complete ``temp`` the name ``final`` unless a whole page has it first.

        True if this put's page is now the stored one, False if the same bytes
        were already there; PageMismatch if other bytes were.
        """
        while True:
            try:
                os.link(temp, final)  # fails if the name exists: the first page wins
                return True
            except FileExistsError:
                pass
            if self._holds(final, key, page, count=False):  # counted before writing
                return False
            # No whole page under the name (a bad one, or one just removed): move it aside,
            # but put back a whole page another writer may have linked in the meantime.
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(os.lstat(final).st_mode):
                    raise FileExistsError(errno.EEXIST, "not a page file", str(final))
            aside = final.parent / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                os.rename(final, aside)
            except FileNotFoundError:
                continue
            try:
                if unframe_page(key, aside.read_bytes()) is not None:
                    with contextlib.suppress(FileExistsError):
                        os.link(aside, final)
            finally:
                aside.unlink()


def _path_max() -> int:
    """The longest path (in bytes, with its terminating NUL) the file system takes."""
    try:
        return os.pathconf("/", "PC_PATH_MAX")
    except (AttributeError, OSError, ValueError):
        return 4096


def _make_directories(directory: Path) -> None:
    """Create ``directory`` and its missing parents, or none of them.

    Raises ConfigError (nothing created) when a parent is a file, or the
    file system refuses (permissions, read-only, name too long).
    """
    missing: list[Path] = []
    created: list[Path] = []
    try:
        path = directory
        while True:
            try:
                mode = os.stat(path).st_mode
            except FileNotFoundError:
                missing.append(path)
                path = path.parent
                continue
            if not stat.S_ISDIR(mode):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
            break
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                if not path.is_dir():
                    raise
                continue
            created.append(path)
    except OSError as exc:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise ConfigError(f"cannot use {str(directory)!r} as a store: {exc}") from exc


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
