"""Device KV pools as serving engines lay them out, and page-wise copies out of them.

A page is ``page_size`` consecutive token slots of every buffer; one host page is one row
of ``page_numel`` elements, the page's *page rows* (each buffer viewed as ``[num_pages,
row_numel]``) one after the other. A CPU copy is one call of ``kvlife._rowcopy`` over every
(page, buffer) row; elsewhere, or without it, one ``index_select`` / ``index_copy_`` per
buffer. Layouts, copies and their speed (``bench/engine.py``): ``docs/engines.md``.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvlife._checks import buffer_spec, device_of, positive_int
from kvlife.errors import ConfigError

try:
    from kvlife import _rowcopy
except ImportError:  # installed where it could not be built: torch's copies alone
    _rowcopy = None  # type: ignore[assignment]


def _torch_openmp() -> str | None:
    """The path of the OpenMP runtime torch loaded (libgomp, libomp or libiomp5), if any."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "omp" in line}
    except OSError:  # not Linux
        return None
    names = ("libgomp", "libomp", "libiomp5")
    found = sorted(p for p in paths if p.rsplit("/", 1)[-1].startswith(names))
    return next((p for p in found if "torch" in p), found[0] if found else None)


#: Whether a CPU copy on the main thread runs on torch's own OpenMP team (docs/engines.md).
OPENMP = (
    _rowcopy is not None and (path := _torch_openmp()) is not None and _rowcopy.use_openmp(path)
)

__all__ = ["KVLayout", "LayerFirstLayout", "MLALayout", "PageFirstLayout"]


#: CPU copies of this many bytes or more (source and target fill a 32 MiB cache) are streamed.
STREAM_BYTES = 16 << 20
#: CPU copies of this many bytes or more are split over torch's thread count (smaller ones
#: would spend more starting a thread than it saves).
THREADS_BYTES = 4 << 20


def staging_windows(
    n: int, runs: Sequence[tuple[int, int, int]], window: int
) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
    """A chunk of ``n`` pages, copied through staging ``window`` pages at a time. ``runs`` are
    the chunk's host rows as ``(offset, first row, length)``. Yields ``(lo, hi, pieces)`` per
    window of chunk pages ``[lo, hi)``; each piece ``(first, last, row)`` is staging rows
    ``[first, last)`` and host rows ``[row, row + last - first)``. Used by both directions, so
    they cannot differ."""
    for lo in range(0, n, window):
        hi = min(n, lo + window)
        pieces = []
        for offset, row, length in runs:
            a, b = max(offset, lo), min(offset + length, hi)
            if a < b:
                pieces.append((a - lo, b - lo, row + a - offset))
        yield lo, hi, pieces


def _per_layer(
    num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: object
) -> list[torch.Tensor]:
    """One zeroed buffer of ``shape`` per layer, one allocation each, as a runtime makes them;
    a ``device`` this machine cannot allocate on is refused first (ConfigError)."""
    on = device_of(device)
    return [torch.zeros(shape, dtype=dtype, device=on) for _ in range(num_layers)]


def _plain_rows(rows: torch.Tensor) -> tuple[tuple[int, int], int, int] | None:
    """Where 2-D ``rows`` lie in their storage (the bytes ``[first, end)``; none: 0, 0), how
    many and their stride in bytes, if a byte copy by address reads or writes them as torch
    would: contiguous, apart, and no lazy conjugation or negation; else None. One read of
    their shape and strides."""
    (n, width), (step, one), size = rows.shape, rows.stride(), rows.element_size()
    if one != 1 or step < width or rows.is_conj() or rows.is_neg():
        return None
    first = int(rows.storage_offset()) * size
    span = (first, first + ((n - 1) * step + width) * size) if n and width else (0, 0)
    return span, n, step * size


def _check_live(what: str | int, tensor: torch.Tensor, span: tuple[int, int]) -> int:
    """``tensor``'s address (its storage's plus ``span``'s start); ConfigError unless
    ``span`` lies inside its storage as it is now: a storage released or shrunk after the
    layout was built (``untyped_storage().resize_(0)``) would have a copy by address touch
    memory it no longer owns (torch's own copies check it and raise). ``what``: its name, or
    its index among the KV buffers."""
    storage = tensor.untyped_storage()
    start, held = storage.data_ptr(), storage.nbytes()
    first, end = span
    if end and (held == 0 or end > held):
        raise ConfigError(
            f"{f'KV buffer {what}' if type(what) is int else what} {tuple(tensor.shape)} needs "
            f"{end - first} bytes at offset {first} of its storage, which holds {held}: its "
            "storage was released or shrunk (untyped_storage().resize_); nothing was copied"
        )
    return start + first


class KVLayout:
    """A device KV pool cut into pages; copies whole pages to and from page-major rows. Made
    from its *page rows*, the buffers viewed as ``[num_pages, row_numel]`` (one page of one
    buffer is one contiguous row), of one dtype and device. The kinds below make them from a
    runtime's buffers; a runtime whose buffers are already page rows (vLLM's block views) passes
    them here."""

    def __init__(self, rows: Sequence[torch.Tensor], page_size: int) -> None:
        self._rows: tuple[torch.Tensor, ...] = tuple(rows)
        if not self._rows:
            raise ConfigError("a layout needs at least one buffer")
        first = self._rows[0]
        for row in self._rows:
            if (
                row.dim() != 2
                or row.shape[0] != first.shape[0]
                or row.dtype != first.dtype
                or row.device != first.device
                or (row.numel() and row.stride(1) != 1)
            ):
                raise ConfigError(
                    "page rows must be 2-D [num_pages, row] with contiguous rows, one page "
                    f"count, dtype and device; got {row.dtype} {tuple(row.shape)} on {row.device}"
                )
        self.num_pages = positive_int("num_pages", int(first.shape[0]))
        self.page_size = positive_int("page_size", page_size)
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        # Each buffer's row and its column block of a page: the one walk of every copy.
        ends = list(itertools.accumulate(int(r.shape[1]) for r in self._rows))
        self._blocks = tuple(
            (row, slice(end - int(row.shape[1]), end))
            for row, end in zip(self._rows, ends, strict=True)
        )
        self._page_numel = ends[-1]
        size = first.element_size()  # copies by address: each buffer's bytes in its storage,
        plain = [_plain_rows(row) for row in self._rows]  # its row stride and its columns
        self._spans = [  # (none unless every buffer's rows are plain)
            (rows[0], rows[2], cols.start * size, int(row.shape[1]) * size)
            for rows, (row, cols) in zip(plain, self._blocks, strict=True)
            if rows is not None and None not in plain
        ]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The device tensors that hold the KV cache, as the runtime sees them."""
        return self._rows

    def page_rows(self) -> tuple[torch.Tensor, ...]:
        """Each buffer viewed as ``[num_pages, row_numel]``; a page is its rows concatenated."""
        return self._rows

    @property
    def page_numel(self) -> int:
        """Elements of one page across all layers and K/V: the width of a host page."""
        return self._page_numel

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page."""
        return self._page_numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} pages={self.num_pages} page_size={self.page_size} "
            f"page_numel={self._page_numel} {self.dtype} {self.device}>"
        )

    def page_index(self, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Pages as a checked int64 index tensor on this layout's device."""
        if isinstance(pages, torch.Tensor):
            index = pages
        else:
            listed = list(pages)
            if not all(isinstance(p, int) and not isinstance(p, bool) for p in listed):
                raise ConfigError(f"pages must be ints, got {listed!r}")
            index = torch.tensor(listed, dtype=torch.int64)
        self._check_index(index)
        return index.to(self.device)

    def _check_index(self, pages: torch.Tensor) -> None:
        if pages.dtype != torch.int64 or pages.dim() != 1:
            raise ConfigError(
                f"pages must be a 1-D int64 tensor, got {pages.dtype} {tuple(pages.shape)}"
            )
        if pages.numel() and pages.device.type == "cpu":  # a device tensor would cost a sync
            low, high = int(pages.min()), int(pages.max())
            if low < 0 or high >= self.num_pages:
                raise ConfigError(f"page out of range [0, {self.num_pages}): min {low}, max {high}")

    def _check_rows(self, what: str, rows: torch.Tensor, n: int | None = None) -> None:
        """``rows`` must be ``[n, page_numel]`` of this dtype (any count when ``n`` is
        ``None``, a host pool; else with contiguous rows)."""
        if (
            rows.dtype != self.dtype
            or rows.dim() != 2
            or rows.shape[1] != self._page_numel
            or (n is not None and (rows.shape[0] != n or (n and rows.stride(1) != 1)))
        ):
            raise ConfigError(
                f"{what} must be {self.dtype} [{'rows' if n is None else n}, "
                f"{self._page_numel}] with contiguous rows, got {rows.dtype} {tuple(rows.shape)}"
            )

    def _page(self, page: int) -> int:
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < self.num_pages:
            raise ConfigError(f"page {page!r} out of range [0, {self.num_pages})")
        return page

    def gather(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """Copy ``pages`` into ``out`` ``[n, page_numel]``, page-major, flat; ``out`` on
        another device as :meth:`gather_runs` (pinned: the caller then waits for the
        current stream)."""
        self._check_index(pages)
        self._check_rows("out", out, pages.numel())
        self.gather_runs(pages.to(self.device), out, [(0, 0, pages.numel())])

    def scatter(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` ``[n, page_numel]`` back into ``pages`` (restore from host)."""
        self._check_index(pages)
        self._check_rows("src", src, pages.numel())
        self.scatter_runs(pages.to(self.device), src, [(0, 0, pages.numel())])

    def gather_runs(
        self,
        pages: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
        *,
        max_staging_bytes: int = 256 << 20,
    ) -> None:
        """Copy ``pages`` into rows of ``host`` given as runs ``(offset, first row, length)``:
        a copy engine's step, the chunk's page ``offset + i`` to host row ``row + i`` (pages
        and runs checked by the engine). A host tensor on another device goes through device
        staging of at most ``max_staging_bytes`` at a time, ``non_blocking`` when pinned."""
        self._copy_runs(False, pages, host, runs, max_staging_bytes)

    def scatter_runs(
        self,
        pages: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
        *,
        max_staging_bytes: int = 256 << 20,
    ) -> None:
        """The mirror of :meth:`gather_runs` (a load: host -> device): rows of ``host``
        given as runs ``(offset, first row, length)`` into ``pages``."""
        self._copy_runs(True, pages, host, runs, max_staging_bytes)

    def _copy_runs(
        self,
        load: bool,
        pages: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
        max_staging_bytes: int,
    ) -> None:
        """Both directions of :meth:`gather_runs` and :meth:`scatter_runs`: they cannot differ."""
        self._check_rows("host", host)
        if host.device == self.device:
            if not self._by_address(load, pages, host, runs):
                for offset, row, length in runs:
                    self._torch_copy(
                        load, pages[offset : offset + length], host[row : row + length]
                    )
            return
        non_blocking = host.is_pinned()
        window = max(1, max_staging_bytes // max(1, self.page_nbytes))
        for lo, hi, pieces in staging_windows(pages.numel(), runs, window):
            staging = torch.empty((hi - lo, self._page_numel), dtype=self.dtype, device=self.device)
            if not load:
                self._torch_copy(False, pages[lo:hi], staging)
            for first, last, row in pieces:
                src, dst = staging[first:last], host[row : row + last - first]
                if load:
                    src, dst = dst, src
                dst.copy_(src, non_blocking=non_blocking)
            if load:
                self._torch_copy(True, pages[lo:hi], staging)

    def _by_address(
        self,
        load: bool,
        pages: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
    ) -> bool:
        """A CPU copy: every (page, buffer) row in one call of ``kvlife._rowcopy``, by
        address, without the GIL, the next rows prefetched; from ``THREADS_BYTES`` up over
        torch's thread count, from ``STREAM_BYTES`` up streamed (docs/engines.md). False,
        nothing copied, where the extension is not built or the rows are not plain; the
        caller then copies through torch."""
        plain = (
            _plain_rows(host) if _rowcopy and self._spans and self.device.type == "cpu" else None
        )
        if plain is None:
            return False  # torch's paths copy it, or refuse it (overlapping rows) as they do
        at = pages.numpy()
        n = at.size
        # Raw addresses: each page and host row is checked in the call (each page read once, so
        # no thread can change it once checked); each buffer where it was at construction, and
        # the host pool, inside their storage as it is now.
        geometry = [
            (_check_live(i, row, span), *rest)
            for i, (row, (span, *rest)) in enumerate(zip(self._rows, self._spans, strict=True))
        ]
        span, rows, stride = plain
        host_rows = (rows, _check_live("the host pool", host, span), stride)
        nbytes = n * self.page_nbytes
        threads = torch.get_num_threads() if nbytes >= THREADS_BYTES else 1
        team = OPENMP and threading.current_thread() is threading.main_thread()
        where = (np.array(runs, dtype=np.int64), host_rows, np.array(geometry, dtype=np.int64))
        how = (threads, nbytes >= STREAM_BYTES, team)
        _rowcopy.copy_pages(load, at, self.num_pages, *where, *how, ConfigError)
        return True

    def _torch_copy(self, load: bool, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows ``[n, page_numel]`` (on this device) to ``pages`` (``load``) or from them,
        one ``index_copy_`` / ``index_select`` per buffer."""
        for row, cols in self._blocks:
            if load:
                row.index_copy_(0, pages, rows[:, cols])
            else:
                torch.index_select(row, 0, pages, out=rows[:, cols])

    def read_page(self, page: int) -> torch.Tensor:
        """A flat copy of one page (for verification), on the layout's device."""
        p = self._page(page)
        return torch.cat([row[p] for row in self._rows])

    def write_page(self, page: int, values: torch.Tensor) -> None:
        """Overwrite one page with the flat ``values`` ``[page_numel]``."""
        p = self._page(page)
        if values.dtype != self.dtype or tuple(values.shape) != (self._page_numel,):
            raise ConfigError(
                f"values must be {self.dtype} of shape ({self._page_numel},), "
                f"got {values.dtype} {tuple(values.shape)}"
            )
        for row, cols in self._blocks:
            row[p].copy_(values[cols])


def _slot_rows(
    buffers: Sequence[torch.Tensor], page_size: int, what: str
) -> tuple[list[torch.Tensor], int]:
    """Buffers ``[slots, ...]`` of one shape, dtype and device as page rows, and the
    page size; slots past the last whole page (a runtime's padding slots) are in no page."""
    if not buffers:
        raise ConfigError(f"need {what}, at least one layer")
    page_size = positive_int("page_size", page_size)
    first = buffers[0]
    num_pages = first.shape[0] // page_size
    slots = num_pages * page_size
    tail = tuple(first.shape[1:])
    for buf in buffers:
        if (
            tuple(buf.shape[1:]) != tail
            or buf.shape[0] < slots
            or not buf.is_contiguous()
            or buf.dtype != first.dtype
            or buf.device != first.device
        ):
            raise ConfigError(
                f"every buffer must be contiguous [>= {slots}, {', '.join(map(str, tail))}] "
                f"of one dtype and device, got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
            )
    width = page_size * math.prod(tail)
    return [b[:slots].view(num_pages, width) for b in buffers], page_size


class LayerFirstLayout(KVLayout):
    """Per layer one K and one V buffer of token slots x heads x head dim (SGLang's MHA pool).
    Wraps a runtime's own K and V buffers ``[slots, heads, head_dim]`` (no copy); :meth:`zeros`
    allocates them. Page rows are ordered layer by layer, K before V: a host page is
    ``[num_layers, 2, page_size, num_heads, head_dim]``."""

    def __init__(
        self, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int
    ) -> None:
        if len(k_buffers) != len(v_buffers):
            raise ConfigError("need one K and one V buffer per layer")
        if k_buffers and k_buffers[0].dim() != 3:
            raise ConfigError(
                f"buffers must be [slots, heads, head_dim], got {tuple(k_buffers[0].shape)}"
            )
        kv = [b for pair in zip(k_buffers, v_buffers, strict=True) for b in pair]
        rows, page_size = _slot_rows(kv, page_size, "one K and one V buffer per layer")
        super().__init__(rows, page_size)
        self.k_buffers, self.v_buffers = list(k_buffers), list(v_buffers)
        self.num_layers = len(k_buffers)
        self.num_heads, self.head_dim = int(kv[0].shape[1]), int(kv[0].shape[2])

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> LayerFirstLayout:
        """A layout over fresh zeroed K and V buffers, one allocation per buffer."""
        buffer_spec(
            dtype, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            num_heads=num_heads, head_dim=head_dim,
        )  # fmt: skip
        shape = (num_pages * page_size, num_heads, head_dim)
        k = _per_layer(num_layers, shape, dtype, device)
        return cls(k, _per_layer(num_layers, shape, dtype, device), page_size)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """K and V buffers, layer by layer: ``(k0, v0, k1, v1, ...)``."""
        return tuple(b for kv in zip(self.k_buffers, self.v_buffers, strict=True) for b in kv)


class PageFirstLayout(KVLayout):
    """One tensor ``[num_pages, num_layers, 2, page_size, heads, head_dim]``: a page is one row.
    Wraps a runtime's own tensor (no copy); :meth:`zeros` allocates it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.dim() != 6 or tensor.shape[2] != 2 or not tensor.is_contiguous():
            raise ConfigError(
                "the tensor must be contiguous [num_pages, num_layers, 2, page_size, heads, "
                f"head_dim], got {tuple(tensor.shape)}"
            )
        pages, layers, _, page_size, heads, head_dim = (int(d) for d in tensor.shape)
        super().__init__([tensor.view(pages, math.prod(tensor.shape[1:]))], page_size)
        self.tensor = tensor
        self.num_layers, self.num_heads, self.head_dim = layers, heads, head_dim

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> PageFirstLayout:
        """A layout over a fresh zeroed tensor."""
        buffer_spec(
            dtype, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            num_heads=num_heads, head_dim=head_dim,
        )  # fmt: skip
        shape = (num_pages, num_layers, 2, page_size, num_heads, head_dim)
        return cls(_per_layer(1, shape, dtype, device)[0])

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The single page-first tensor."""
        return (self.tensor,)


class MLALayout(KVLayout):
    """Per layer one latent buffer ``[slots, 1, latent_dim]`` (multi-head latent attention).
    Wraps a runtime's own latent buffers (no copy); :meth:`zeros` allocates them."""

    def __init__(self, kv_buffers: Sequence[torch.Tensor], page_size: int) -> None:
        if kv_buffers and (kv_buffers[0].dim() != 3 or kv_buffers[0].shape[1] != 1):
            raise ConfigError(
                f"buffers must be [slots, 1, latent_dim], got {tuple(kv_buffers[0].shape)}"
            )
        rows, page_size = _slot_rows(kv_buffers, page_size, "one latent buffer per layer")
        super().__init__(rows, page_size)
        self.kv_buffers = list(kv_buffers)
        self.num_layers = len(kv_buffers)
        self.latent_dim = int(kv_buffers[0].shape[2])

    @classmethod
    def zeros(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        latent_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> MLALayout:
        """A layout over fresh zeroed latent buffers, one allocation per layer."""
        buffer_spec(
            dtype, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            latent_dim=latent_dim,
        )  # fmt: skip
        shape = (num_pages * page_size, 1, latent_dim)
        return cls(_per_layer(num_layers, shape, dtype, device), page_size)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The latent buffers, one per layer."""
        return tuple(self.kv_buffers)
