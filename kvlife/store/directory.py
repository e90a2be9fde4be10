"""LocalDirectoryStore: one file per page under a root directory, the embedded default
(``docs/store.md``: the file layout, atomicity, first writer wins, safe reads, permissions).
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

from kvlife._checks import positive_int
from kvlife.errors import ConfigError
from kvlife.store.base import (
    DEFAULT_MAX_PAGE_BYTES,
    Payload,
    QueuedStore,
    Written,
    _checksum,
    _pieces,
    check_frame_namespace,
    check_held,
    check_key,
    frame_page,
    header_size,
    parse_header,
    payload_nbytes,
)

__all__ = ["DEFAULT_MODE", "LocalDirectoryStore", "check_mode", "check_namespace"]

#: Name of the directory that holds a namespace's pages (``@`` is never in a component).
PAGES_DIR = "@pages"

_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,99}")
_PAGE_FILE = re.compile(r"([0-9a-f]{2,128})\.page")
_TEMP_FILE = re.compile(r"\.([0-9a-f]{2,128})\.([0-9]+)\.[0-9a-f]+\.tmp")
# The longest path below ``@pages``: "/ff/" and a temporary file name with a
# 128-digit key, a 10-digit pid and 8 random hex digits.
_LONGEST_BELOW = len("/ff/." + "f" * 128 + "." + "9" * 10 + ".ffffffff.tmp")
# Page files are opened never through a symlink, never blocking (a FIFO), never inherited
# by a child; temporary ones are created new.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: Permission bits of page files by default: the owner's alone (KV pages reveal prompts);
#: the directories the store creates get 0o700 (:func:`directory_mode`).
DEFAULT_MODE = 0o600
# preadv takes at most this many buffers in one call (IOV_MAX on Linux).
_IOV_MAX = 1024


def check_namespace(namespace: object) -> tuple[str, ...]:
    """Split a store's namespace into safe directory components that a page header can
    hold (:func:`~kvlife.store.base.check_frame_namespace`), or raise ConfigError."""
    if not isinstance(namespace, str):
        raise ConfigError(f"namespace must be a str, got {type(namespace).__name__}")
    parts = tuple(namespace.split("/"))
    for part in parts:
        if _COMPONENT.fullmatch(part) is None:
            raise ConfigError(
                f"namespace {namespace!r}: component {part!r} must be 1-100 letters, digits, "
                "'.', '_' or '-' not starting with '.' (no absolute paths, no '..')"
            )
    check_frame_namespace(namespace)
    return parts


def _temp_name(final: Path, key: str) -> Path:
    """A fresh temporary name beside page file ``final`` (``_TEMP_FILE``)."""
    return final.parent / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, OSError):  # another user's process, or not a pid at all
        pass
    return True


class LocalDirectoryStore(QueuedStore):
    """Pages as files under ``root/namespace``, written atomically by a writer thread."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: str = "default",
        *,
        fsync: bool = False,
        max_page_bytes: int = DEFAULT_MAX_PAGE_BYTES,
        mode: int = DEFAULT_MODE,
    ) -> None:
        parts = check_namespace(namespace)  # all before anything is created
        self._mode = check_mode(mode)
        self._dir_mode = directory_mode(self._mode)
        positive_int("max_page_bytes", max_page_bytes)
        self._root = Path(root)
        self._directory = self._root.joinpath(*parts, PAGES_DIR)
        self._fsync = fsync
        longest = len(os.fsencode(os.path.abspath(self._directory))) + _LONGEST_BELOW
        try:  # the longest path (in bytes, with its terminating NUL) the file system takes
            limit = os.pathconf("/", "PC_PATH_MAX")
        except (AttributeError, OSError, ValueError):
            limit = 4096
        if longest >= limit:
            base = len(os.fsencode(os.path.abspath(self._root.joinpath(PAGES_DIR))))
            culprit = "the root" if base + _LONGEST_BELOW >= limit else "the namespace"
            raise ConfigError(
                f"root {str(root)[:40]!r}... with namespace {namespace[:40]!r}... gives page "
                f"paths of up to {longest} bytes; the file system takes {limit - 1} "
                f"({culprit} is too long)"
            )
        _make_directories(self._directory, self._dir_mode)
        with contextlib.suppress(OSError):  # pages an older version left readable: this mode
            info = os.stat(self._directory)
            if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != self._dir_mode:
                os.chmod(self._directory, self._dir_mode)
        self.clean_stale_temps()
        super().__init__(name="directory-store", max_page_bytes=max_page_bytes, namespace=namespace)

    @property
    def root(self) -> Path:
        """The root directory shared by all namespaces."""
        return self._root

    @property
    def mode(self) -> int:
        """The permission bits of every page file this store writes (directories it
        creates get the same bits, with search where read is given)."""
        return self._mode

    @property
    def directory(self) -> Path:
        """The directory that holds this namespace's page files."""
        return self._directory

    def path(self, key: str) -> Path:
        """The file a page with ``key`` is stored in."""
        check_key(key)
        return self._directory / key[:2] / f"{key}.page"

    # -- reads: every one goes through _open_page, then reads what its header declares

    def get(self, key: str) -> bytes | None:
        """The stored payload bytes of a page, or None when no whole page is stored under it."""
        return self._read(self.path(key), key)

    def get_batch_into(
        self, keys: Sequence[str], outs: Sequence[memoryview | Sequence[memoryview]]
    ) -> list[bool]:
        """``get_into`` of every key: each payload read straight into its ``outs[i]``."""
        paths = [self.path(k) for k in keys]
        return [
            self._read_into(p, k, _pieces(o)) for p, k, o in zip(paths, keys, outs, strict=True)
        ]

    def _read(self, file: Path, key: str, *, count: bool = True) -> bytes | None:
        """The payload of page ``file`` if it is a whole page of ``key``; None if not."""
        opened = self._open_page(file, key, None, count)
        if opened is None:
            return None
        fd, length, check = opened
        try:
            payload = os.pread(fd, length, header_size(key, self._namespace))
        except OSError:
            self._count(read_errors=1)
            return None
        finally:
            os.close(fd)
        if len(payload) != length or _checksum(payload) != check:
            if count:
                self._count(pages_corrupt=1)
            return None
        return payload

    def _read_into(self, file: Path, key: str, out: Payload) -> bool:
        """Read the payload of page ``file`` into ``out`` if it is a whole page of ``key``
        of exactly that size (a page of another size is a miss, not a bad page)."""
        opened = self._open_page(file, key, payload_nbytes(out), True)
        if opened is None:
            return False
        fd, length, check = opened
        try:
            done, at = 0, header_size(key, self._namespace)
            for start in range(0, len(out), _IOV_MAX):
                done += os.preadv(fd, out[start : start + _IOV_MAX], at + done)
        except OSError:
            self._count(read_errors=1)
            return False
        finally:
            os.close(fd)
        if done != length or _checksum(out) != check:
            self._count(pages_corrupt=1)
            return False
        return True

    def _open_page(
        self, file: Path, key: str, expect: int | None, count: bool
    ) -> tuple[int, int, int] | None:
        """(open descriptor, payload length, checksum) of page ``file`` if it is a whole page
        of ``key`` (exactly ``expect`` bytes if given); else None, counted as
        ``docs/store.md`` says ("Reading is safe whatever sits at a page path")."""
        try:
            fd = os.open(file, _READ_FLAGS)
        except FileNotFoundError:
            return None
        except OSError:  # ENOTDIR, ELOOP (a symlink), EACCES, EIO, EMFILE, ...
            self._count(read_errors=1)
            return None
        fields: tuple[int, int] | None = None
        try:
            info = os.fstat(fd)
            if stat.S_ISREG(info.st_mode):
                head = os.pread(fd, header_size(key, self._namespace), 0)
                fields = parse_header(key, head, self._namespace)
        except OSError:
            os.close(fd)
            self._count(read_errors=1)
            return None
        whole = (
            fields is not None
            and fields[0] <= self.max_page_bytes
            and info.st_size == header_size(key, self._namespace) + fields[0]
        )
        if fields is not None and whole and (expect is None or fields[0] == expect):
            return fd, fields[0], fields[1]
        os.close(fd)
        if not whole and count:
            self._count(pages_corrupt=1)
        return None

    def keys(self) -> Iterator[str]:
        """Every stored key, read from the directory (temporary files are not pages)."""
        for shard, match, entry in self._files(_PAGE_FILE):
            if match.group(1)[:2] == shard and entry.is_file():
                yield match.group(1)

    def _clear(self) -> int:
        """Unlink every page file of this namespace (writer thread); other names stay."""
        removed = 0
        for _, _, entry in self._files(_PAGE_FILE):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
                removed += 1
        return removed

    def clean_stale_temps(self) -> int:
        """Remove temporary files left by writers no longer running on this host; count them."""
        removed = 0
        for _, match, entry in self._files(_TEMP_FILE):
            if not _pid_alive(int(match.group(2))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def _files(
        self, name: re.Pattern[str]
    ) -> Iterator[tuple[str, re.Match[str], os.DirEntry[str]]]:
        """(shard, match, entry) of each entry of a shard directory whose name matches."""
        try:
            with os.scandir(self._directory) as entries:
                shards = [e for e in entries if len(e.name) == 2 and e.is_dir()]
        except FileNotFoundError:
            return
        for shard in shards:
            with os.scandir(shard.path) as entries:
                for entry in entries:
                    match = name.fullmatch(entry.name)
                    if match:
                        yield shard.name, match, entry

    # -- writes (writer thread)

    def _write_page(self, file: BinaryIO, page: memoryview) -> None:
        """Write one piece of a page's payload to its open temporary file (an override
        point for tests)."""
        file.write(page)

    def _store_pages(
        self, keys: tuple[str, ...], pages: Sequence[Payload], kept: list[str] | None = None
    ) -> Written:
        # Steps 0 to n - 1: before writing each page's temporary file; n to 2n - 1: before
        # each link.
        n = len(keys)
        temps: dict[int, tuple[Path, Path]] = {}  # page index -> (temporary, final)
        created: list[Path] = []
        written: list[Payload] = []
        try:
            for i, (key, page) in enumerate(zip(keys, pages, strict=True)):
                self._step(i, f"before writing page {i}")
                final = self.path(key)
                if check_held(key, self._read(final, key), page, kept):
                    continue
                with contextlib.suppress(FileExistsError):  # exactly the mode, whatever the umask
                    os.mkdir(final.parent, self._dir_mode)
                    os.chmod(final.parent, self._dir_mode)
                temp = _temp_name(final, key)
                fd = os.open(temp, _WRITE_FLAGS, self._mode)
                temps[i] = (temp, final)
                try:  # exactly the store's mode, whatever the umask took away
                    os.fchmod(fd, self._mode)
                except BaseException:
                    os.close(fd)
                    raise
                with os.fdopen(fd, "wb") as file:
                    file.write(frame_page(key, page, self._namespace))
                    for part in page:
                        self._write_page(file, part)
                    if self._fsync:
                        file.flush()
                        os.fsync(file.fileno())
            for i in range(n):
                self._step(n + i, f"before linking page {i}")
                if i in temps:
                    temp, final = temps[i]
                    if self._claim(temp, final, keys[i], pages[i], kept):
                        created.append(final)
                        written.append(pages[i])
                    temp.unlink()
                    del temps[i]
            if self._fsync:
                for directory in {p.parent for p in created}:
                    fd = os.open(directory, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        except BaseException:
            for temp, _ in temps.values():
                temp.unlink(missing_ok=True)
            for final in created:
                final.unlink(missing_ok=True)
            raise
        return written

    def _claim(
        self, temp: Path, final: Path, key: str, page: Payload, kept: list[str] | None
    ) -> bool:
        """Give the complete ``temp`` the name ``final`` unless a whole page has it first:
        True if this put's page is now the stored one, False if the same bytes were there
        (other bytes: :func:`check_held`; docs/store.md, "First writer wins")."""
        while True:
            try:
                os.link(temp, final)  # fails if the name exists: the first page wins
                return True
            except FileExistsError:
                pass
            # A bad page was counted when _store_pages read it before writing.
            if check_held(key, self._read(final, key, count=False), page, kept):
                return False
            # No whole page under the name (a bad one, or one just removed): move it aside,
            # but put back a whole page another writer may have linked in the meantime.
            with contextlib.suppress(FileNotFoundError):
                if not stat.S_ISREG(os.lstat(final).st_mode):
                    raise FileExistsError(errno.EEXIST, "not a page file", str(final))
            aside = _temp_name(final, key)
            try:
                os.rename(final, aside)
            except FileNotFoundError:
                continue
            try:
                if self._read(aside, key, count=False) is not None:
                    with contextlib.suppress(FileExistsError):
                        os.link(aside, final)
            finally:
                aside.unlink()


def check_mode(mode: object) -> int:
    """Return ``mode`` if it is permission bits a store's page files can have (0 to 0o777,
    the owner able to read and write them), else raise ConfigError."""
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise ConfigError(f"mode must be permission bits 0o000 to 0o777, got {mode!r}")
    if mode & 0o600 != 0o600:
        raise ConfigError(
            f"mode {mode:#o} does not let the store's owner read and write its pages (0o600)"
        )
    return mode


def directory_mode(mode: int) -> int:
    """The bits of a directory the store creates for page files of ``mode``: the same,
    with search (x) for whoever may read (0o600 -> 0o700, 0o640 -> 0o750)."""
    return mode | (mode & 0o444) >> 2


def _make_directories(directory: Path, mode: int) -> None:
    """Create ``directory`` and its missing parents with exactly ``mode``, or none of them
    (ConfigError: a parent is a file, the file system refuses)."""
    missing: list[Path] = []
    created: list[Path] = []
    try:
        path = directory
        while True:
            try:
                found = os.stat(path).st_mode
            except FileNotFoundError:
                missing.append(path)
                path = path.parent
                continue
            if not stat.S_ISDIR(found):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
            break
        for path in reversed(missing):
            try:
                os.mkdir(path, mode)
                created.append(path)
                os.chmod(path, mode)  # exactly: the umask may have taken bits away
            except FileExistsError:  # another process made it meanwhile: not ours to remove
                if not path.is_dir():
                    raise
    except OSError as exc:
        for path in reversed(created):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise ConfigError(f"cannot use {str(directory)!r} as a store: {exc}") from exc
