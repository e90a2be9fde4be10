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
- A page file holds the page's raw bytes and nothing else; the caller knows the
  dtype and shape.

Atomic writes
=============

The writer thread writes each page to a temporary file in the page's own
directory (``.<key>.<pid>.<random>.tmp``), and only when *every* page of the put
is complete on disk does it ``os.replace`` them to their names. A reader (this
or another process) therefore sees a page file only when it is complete: a
writer killed mid-write leaves a temporary file, never a partial page. Listing
and lookups ignore temporary files; opening a store removes those left by
processes that no longer run on this host (``clean_temps``).

With ``fsync=True`` every temporary file is flushed to the disk before its
rename and the directories after; without it a killed *process* still leaves
only whole pages, but a power loss may not.

Failures
========

All-or-nothing per put: on an error (I/O error, injected fault, or a key that
already holds different bytes) the writer removes the put's temporary files and
every page file this put renamed into place that did not exist before, then
reports the error. A page that already held the same bytes is left alone.
A put in which a *process kill* strikes between two renames can leave some of
its pages visible (each one complete and correct, as keys are content hashes);
no result was reported for it, so no caller relies on it either way.

Concurrent writers of the same namespace (other processes) are safe for
readers; the rollback of a failed put may remove a page another writer put
under the same key in the same instant, which only costs a later rewrite.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kvlife.store.base import (
    InjectedStoreFailure,
    InvalidNamespace,
    PageBytes,
    PageMismatch,
    QueuedStore,
    Written,
    check_key,
)

__all__ = ["LocalDirectoryStore", "check_namespace"]

#: Name of the directory that holds a namespace's pages (``@`` is never in a component).
PAGES_DIR = "@pages"

_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
_PAGE_FILE = re.compile(r"([0-9a-f]{2,128})\.page")
_TEMP_FILE = re.compile(r"\.([0-9a-f]{2,128})\.([0-9]+)\.[0-9a-f]+\.tmp")


def check_namespace(namespace: object) -> tuple[str, ...]:
    """Split a namespace into safe directory components, or raise InvalidNamespace."""
    if not isinstance(namespace, str):
        raise InvalidNamespace(f"namespace must be a str, got {type(namespace).__name__}")
    parts = tuple(namespace.split("/"))
    for part in parts:
        if _COMPONENT.fullmatch(part) is None:
            raise InvalidNamespace(
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
        self._directory.mkdir(parents=True, exist_ok=True)
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
        """The stored bytes of a page, or None when the key is not stored."""
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        """Whether a complete page file is stored under ``key``."""
        return self.path(key).is_file()

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
        """Write one page's bytes to its open temporary file (an override point for tests)."""
        file.write(page)

    def _fault_steps(self, n_pages: int) -> int:
        # Before writing each page's temporary file, and before each rename.
        return 2 * n_pages

    def _store_pages(
        self, keys: tuple[str, ...], pages: PageBytes, fault_at: int | None
    ) -> Written:
        n = len(keys)
        temps: dict[int, tuple[Path, Path]] = {}  # page index -> (temporary, final)
        created: list[Path] = []
        tag = f"{os.getpid()}.{secrets.token_hex(4)}"

        def step(i: int, what: str) -> None:
            if fault_at == i:
                raise InjectedStoreFailure(f"injected failure {what} ({n} pages)")

        try:
            for i, key in enumerate(keys):
                step(i, f"before writing page {i}")
                final = self.path(key)
                page = pages.page(i)
                if self._holds(final, key, page):
                    continue
                final.parent.mkdir(exist_ok=True)
                temp = final.parent / f".{key}.{tag}.tmp"
                temps[i] = (temp, final)
                with open(temp, "xb") as file:
                    self._write_page(file, page)
                    if self._fsync:
                        file.flush()
                        os.fsync(file.fileno())
            for i in range(n):
                step(n + i, f"before renaming page {i}")
                if i in temps:
                    temp, final = temps.pop(i)
                    os.replace(temp, final)
                    created.append(final)
            if self._fsync:
                for directory in {p.parent for p in created}:
                    _fsync_directory(directory)
        except BaseException:
            for temp, _ in temps.values():
                temp.unlink(missing_ok=True)
            for final in created:
                final.unlink(missing_ok=True)
            raise
        return Written(len(created), n - len(created), len(created) * pages.page_nbytes)

    @staticmethod
    def _holds(final: Path, key: str, page: memoryview) -> bool:
        """True if ``final`` already holds exactly ``page``; PageMismatch if other bytes."""
        try:
            with open(final, "rb") as file:
                same = os.fstat(file.fileno()).st_size == len(page) and file.read() == page
        except FileNotFoundError:
            return False
        if not same:
            raise PageMismatch(
                f"key {key} is stored with different bytes; the stored page is kept", key=key
            )
        return True


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
