"""Device KV pools as serving engines lay them out, and page-wise copies out of them.

A page is ``page_size`` consecutive token slots of every buffer; one host page is
one row of ``page_numel`` elements, the page's *page rows* (each buffer viewed as
``[num_pages, row_numel]``) one after the other. A copy is one ``index_select``
per buffer straight into that buffer's column block of the page-major output: no
temporary, no per-page Python loop. Layouts, restores and their speed
(``bench/engine.py``): ``docs/engines.md``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvlife._checks import buffer_spec, device_of, positive_int
from kvlife.errors import ConfigError

try:
    from kvlife import _rowcopy
except ImportError:  # installed where it could not be built: torch's copies alone
    _rowcopy = None  # type: ignore[assignment]

__all__ = [
    "KVLayout",
    "LayerFirstLayout",
    "MLALayout",
    "PageFirstLayout",
]


#: Consecutive device pages from this many up are restored with one ``copy_`` per buffer.
_MIN_RUN = 4
#: Scattered page rows this large or larger are restored with one ``copy_`` each.
_BIG_ROW_BYTES = 1 << 20
#: CPU copies of this many bytes or more go through ``kvlife._rowcopy``: streaming stores
#: on torch's thread count. Smaller ones stay in the cache and are faster through torch.
STREAM_BYTES = 32 << 20


def staging_windows(
    n: int, runs: Sequence[tuple[int, int, int]], window: int
) -> Iterator[tuple[int, int, list[tuple[int, int, int]]]]:
    """A chunk of ``n`` pages, copied through staging ``window`` pages at a time.

    ``runs`` are the chunk's host rows as ``(offset, first row, length)``. Yields
    ``(lo, hi, pieces)`` per window of chunk pages ``[lo, hi)``; each piece
    ``(first, last, row)`` is staging rows ``[first, last)`` and host rows
    ``[row, row + last - first)``. Used by both directions, so they cannot differ.
    """
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


def _plain_rows(rows: torch.Tensor) -> bool:
    """Rows a byte copy by address reads or writes as torch would: contiguous, apart, and
    no lazy conjugation or negation."""
    return (
        rows.stride(1) == 1
        and rows.stride(0) >= rows.shape[1]
        and not rows.is_conj()
        and not rows.is_neg()
    )


def _check_live(what: str, tensor: torch.Tensor) -> None:
    """ConfigError unless every element of ``tensor`` lies inside its storage as it is
    now: a buffer whose storage was released or shrunk after the layout was built
    (``untyped_storage().resize_(0)``) keeps its shape and strides, and a copy by address
    would read or write memory it no longer owns (torch's own copies check it and raise)."""
    if tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    start, held = storage.data_ptr(), storage.nbytes()
    size = tensor.element_size()
    first = tensor.data_ptr()
    extent = (
        sum((n - 1) * step for n, step in zip(tensor.shape, tensor.stride(), strict=True)) + 1
    ) * size
    if held == 0 or first < start or first + extent > start + held:
        raise ConfigError(
            f"{what} {tuple(tensor.shape)} needs {extent} bytes at offset {first - start} of "
            f"its storage, which holds {held}: its storage was released or shrunk "
            "(untyped_storage().resize_); nothing was copied"
        )


class KVLayout:
    """A device KV pool cut into pages; copies whole pages to and from page-major rows.

    Made from its *page rows*, the buffers viewed as ``[num_pages, row_numel]``
    (one page of one buffer is one contiguous row), of one dtype and device. The
    kinds below make them from a runtime's buffers; a runtime whose buffers are
    already page rows (vLLM's block views) passes them here.
    """

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
        self._np_rows: tuple[np.ndarray[Any, np.dtype[np.void]], ...] | None = None

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

    # ---------------------------------------------------------------- checks

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

    # ---------------------------------------------------------------- copies

    def gather(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """Copy ``pages`` into ``out`` ``[n, page_numel]``, page-major, flat.

        ``out`` on another device (pinned host memory for a CUDA layout) goes
        through a device staging buffer and ``non_blocking`` copies when
        ``out`` is pinned; the caller then waits for the current stream.
        """
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
        """Copy ``pages`` into rows of ``host`` given as runs ``(offset, first row, length)``.

        This is a copy engine's step: a chunk's host pages are a few runs of
        consecutive rows of the host pool; the chunk's page ``offset + i`` is host
        row ``row + i``. Pages and runs must already be checked (the engine does);
        a host tensor on another device goes through device staging of at most
        ``max_staging_bytes`` at a time, with ``non_blocking`` copies when it is pinned.
        """
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
        given as runs ``(offset, first row, length)`` into ``pages``.

        On a CPU layout, device pages that are consecutive too are written with
        one ``copy_`` per buffer, the others with one row-wise memcpy scatter per
        buffer; from another device, through device staging, then ``index_copy_``
        per buffer on the device.
        """
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
            if self._stream(load, pages, host, runs):
                return
            for offset, row, length in runs:
                on_device, on_host = pages[offset : offset + length], host[row : row + length]
                if load:
                    self._scatter_from(on_device, on_host)
                else:
                    self._gather_into(on_device, on_host)
            return
        non_blocking = host.is_pinned()
        window = max(1, max_staging_bytes // max(1, self.page_nbytes))
        for lo, hi, pieces in staging_windows(pages.numel(), runs, window):
            staging = torch.empty((hi - lo, self._page_numel), dtype=self.dtype, device=self.device)
            if not load:
                self._gather_into(pages[lo:hi], staging)
            for first, last, row in pieces:
                src, dst = staging[first:last], host[row : row + last - first]
                if load:
                    src, dst = dst, src
                dst.copy_(src, non_blocking=non_blocking)
            if load:
                self._scatter_from(pages[lo:hi], staging)

    def _stream(
        self,
        load: bool,
        pages: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
    ) -> bool:
        """A CPU copy of ``STREAM_BYTES`` or more: every (page, buffer) row in one call of
        ``kvlife._rowcopy``, by address, without the GIL, split over torch's thread count,
        with streaming stores (docs/engines.md). False, nothing copied, when it does not
        apply; the caller then copies through torch."""
        n = int(pages.numel())
        if (
            _rowcopy is None
            or self.device.type != "cpu"
            or n * self.page_nbytes < STREAM_BYTES
            or not _plain_rows(host)
            or not all(_plain_rows(row) for row in self._rows)
        ):
            return False  # torch's paths copy it, or refuse it (overlapping rows) as they do
        # Raw addresses: every page and host row is checked here, whatever the caller did,
        # on a private copy of the pages (no other thread can change them once checked),
        # and every buffer and the host pool lie inside their storage as it is now.
        for i, buffer in enumerate(self._rows):
            _check_live(f"KV buffer {i}", buffer)
        _check_live("the host pool", host)
        pages, runs = pages.clone(), list(runs)
        self._check_index(pages)
        rows = torch.full((n,), -1, dtype=torch.int64)
        for offset, row, length in runs:
            if not (0 <= offset <= offset + length <= n and 0 <= row <= row + length <= len(host)):
                raise ConfigError(
                    f"host run {(offset, row, length)}: not within {n} pages, {len(host)} host rows"
                )
            rows[offset : offset + length] = torch.arange(row, row + length)
        if sum(length for _, _, length in runs) != n or (n and int(rows.min()) < 0):
            raise ConfigError(f"host runs {list(runs)} do not cover {n} pages once each")
        size = self.dtype.itemsize
        bases = torch.tensor([r.data_ptr() for r in self._rows], dtype=torch.int64)
        strides = torch.tensor([r.stride(0) * size for r in self._rows], dtype=torch.int64)
        cols = torch.tensor([c.start * size for _, c in self._blocks], dtype=torch.int64)
        widths = np.array([int(r.shape[1]) * size for r in self._rows], dtype=np.uint64)
        on_device = pages.view(-1, 1) * strides + bases
        on_host = rows.view(-1, 1) * (host.stride(0) * size) + (host.data_ptr() + cols)
        dst, src = (on_device, on_host) if load else (on_host, on_device)
        _rowcopy.copy_rows(dst.numpy(), src.numpy(), widths, torch.get_num_threads())
        return True

    def _gather_into(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        for row, cols in self._blocks:
            torch.index_select(row, 0, pages, out=out[:, cols])

    def _scatter_from(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """Write rows ``src`` ``[n, page_numel]`` (on this device) into ``pages`` (checked)."""
        if self.device.type != "cpu" or pages.numel() == 0:
            # On a GPU index_copy_ runs at memory bandwidth.
            for row, cols in self._blocks:
                row.index_copy_(0, pages, src[:, cols])
            return
        # On a CPU index_copy_ copies element by element (about 0.3x a contiguous
        # copy); whole rows are copied instead: runs of _MIN_RUN or more consecutive
        # device pages with one copy_ per buffer, the pages between them by _scatter_rows.
        listed = pages.tolist()
        n = len(listed)
        short = start = 0  # short: the first page of the stretch between long runs
        for end in range(1, n + 1):
            if end < n and listed[end] == listed[end - 1] + 1:
                continue
            if end - start >= _MIN_RUN:
                if short < start:
                    self._scatter_rows(pages[short:start], src[short:start])
                first = listed[start]
                for row, cols in self._blocks:
                    row[first : first + end - start].copy_(src[start:end, cols])
                short = end
            start = end
        if short < n:
            self._scatter_rows(pages[short:], src[short:])

    def _scatter_rows(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """CPU: one numpy fancy assignment per buffer over its rows viewed as opaque items
        (a memcpy per row, the GIL released); rows of ``_BIG_ROW_BYTES`` and more (a
        page-first page) with one ``copy_`` each instead, the call's cost lost in the copy's.
        """
        itemsize = self.dtype.itemsize
        if all(int(row.shape[1]) * itemsize >= _BIG_ROW_BYTES for row in self._rows):
            for row, cols in self._blocks:
                for i, page in enumerate(pages.tolist()):
                    row[page].copy_(src[i, cols])
            return
        if self._np_rows is None:
            as_bytes = [row.detach().view(torch.uint8).numpy() for row in self._rows]
            self._np_rows = tuple(b.view(np.dtype((np.void, b.shape[1])))[:, 0] for b in as_bytes)
        index = pages.numpy()
        host = src.detach().view(torch.uint8).numpy()
        for (_, cols), target in zip(self._blocks, self._np_rows, strict=True):
            block = host[:, cols.start * itemsize : cols.stop * itemsize]
            target[index] = block.view(target.dtype)[:, 0]

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

    Wraps a runtime's own K and V buffers ``[slots, heads, head_dim]`` (no
    copy); :meth:`zeros` allocates them. Page rows are ordered layer by layer,
    K before V: a host page is ``[num_layers, 2, page_size, num_heads, head_dim]``.
    """

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

    Wraps a runtime's own tensor (no copy); :meth:`zeros` allocates it.
    """

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

    Wraps a runtime's own latent buffers (no copy); :meth:`zeros` allocates them.
    """

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
