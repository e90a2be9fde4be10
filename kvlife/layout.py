"""Device KV pools as serving engines lay them out, and page-wise copies out of them.

A page is ``page_size`` consecutive token slots: page ``p`` covers slots
``[p * page_size, (p + 1) * page_size)`` of every buffer of the layout. The
host side is always page-contiguous: one host page is one row of
``page_numel`` elements, the page's *rows* one after the other.

Every layout is described by its *page rows*: each buffer viewed as
``[num_pages, row_numel]``, so that one page of one buffer is one contiguous
row. A page is the concatenation of its rows in the order of
:meth:`KVLayout.page_rows`. Copying is then one ``index_select`` per buffer,
written straight into a strided column block of the page-major output: no
temporary, no per-page Python loop (a naive ``index_select`` + ``index_copy_``
runs at about a quarter of a contiguous copy here; this runs at about four fifths,
see ``bench/engine.py``).

Every layout is made from the runtime's buffers (no copy); each kind also has
a ``zeros(...)`` classmethod that allocates fresh zeroed buffers, one per
layer, as a runtime does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from kvlife.errors import ConfigError

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


def _positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return value


def _positive_ints(dtype: torch.dtype, **dims: int) -> None:
    """Refuse a ``zeros`` call whose ``dims`` are not positive ints or whose dtype is wrong."""
    for name, value in dims.items():
        _positive_int(name, value)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")


def _zeros(
    count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """``count`` zeroed buffers, one allocation each, as a runtime makes them."""
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]


class KVLayout:
    """A device KV pool cut into pages; copies whole pages to and from page-major rows.

    Made from its *page rows*: ``rows`` are the buffers viewed as
    ``[num_pages, row_numel]`` (one page of one buffer is one row, whose
    elements are contiguous), of one dtype and device; a page is its rows
    concatenated. The kinds below make their rows from the runtime's buffers;
    a runtime whose buffers are already page rows (vLLM's block views) passes
    them here.
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
        self.num_pages = _positive_int("num_pages", int(first.shape[0]))
        self.page_size = _positive_int("page_size", page_size)
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        self._np_rows: tuple[np.ndarray[Any, np.dtype[np.void]], ...] | None = None
        self._page_numel = sum(int(r.shape[1]) for r in self._rows)

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

    def _check_rows(self, what: str, pages: torch.Tensor, rows: torch.Tensor) -> None:
        self._check_index(pages)
        n = pages.numel()
        if rows.dtype != self.dtype:
            raise ConfigError(f"{what} dtype {rows.dtype} is not the layout's {self.dtype}")
        if tuple(rows.shape) != (n, self._page_numel):
            raise ConfigError(f"{what} shape {tuple(rows.shape)} is not ({n}, {self._page_numel})")
        if n and rows.stride(1) != 1:
            raise ConfigError(f"{what} rows must be contiguous (stride(1) == 1)")

    # ---------------------------------------------------------------- copies

    def gather(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        """Copy ``pages`` into ``out`` ``[n, page_numel]``, page-major, flat.

        ``out`` on another device (pinned host memory for a CUDA layout) goes
        through a device staging buffer and ``non_blocking`` copies when
        ``out`` is pinned; the caller then waits for the current stream.
        """
        self._check_rows("out", pages, out)
        self.gather_runs(pages.to(self.device), out, [(0, 0, pages.numel())])

    def _gather_into(self, pages: torch.Tensor, out: torch.Tensor) -> None:
        rows = self._rows
        if len(rows) == 1:
            torch.index_select(rows[0], 0, pages, out=out)
            return
        start = 0
        for row in rows:
            end = start + row.shape[1]
            torch.index_select(row, 0, pages, out=out[:, start:end])
            start = end

    def _check_host(self, host: torch.Tensor) -> None:
        if host.dtype != self.dtype or host.dim() != 2 or host.shape[1] != self._page_numel:
            raise ConfigError(
                f"host must be {self.dtype} [rows, {self._page_numel}], "
                f"got {host.dtype} {tuple(host.shape)}"
            )

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
        consecutive rows of the host pool. Pages and runs must already be
        checked (the engine does); a host tensor on another device goes through
        device staging of at most ``max_staging_bytes`` at a time, with
        ``non_blocking`` copies when it is pinned.
        """
        self._check_host(host)
        if host.device == self.device:
            for offset, row, length in runs:
                self._gather_into(pages[offset : offset + length], host[row : row + length])
            return
        non_blocking = host.is_pinned()
        for lo, hi, pieces in staging_windows(pages.numel(), runs, self._window(max_staging_bytes)):
            staging = torch.empty((hi - lo, self._page_numel), dtype=self.dtype, device=self.device)
            self._gather_into(pages[lo:hi], staging)
            for first, last, row in pieces:
                host[row : row + last - first].copy_(staging[first:last], non_blocking=non_blocking)

    def scatter(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` ``[n, page_numel]`` back into ``pages`` (restore from host)."""
        self._check_rows("src", pages, src)
        self.scatter_runs(pages.to(self.device), src, [(0, 0, pages.numel())])

    def scatter_runs(
        self,
        pages: torch.Tensor,
        host: torch.Tensor,
        runs: Sequence[tuple[int, int, int]],
        *,
        max_staging_bytes: int = 256 << 20,
    ) -> None:
        """Copy rows of ``host`` given as runs ``(offset, first row, length)`` into ``pages``.

        The mirror of :meth:`gather_runs` (a load: host -> device): the chunk's
        page ``offset + i`` is host row ``row + i``. Pages and runs must already
        be checked (the engine does). Each run is one contiguous host slice;
        on a CPU layout, device pages that are consecutive too are written with
        one ``copy_`` per buffer, the others with one row-wise memcpy scatter per
        buffer. A host tensor on another device is copied into device staging of
        at most ``max_staging_bytes`` at a time (``non_blocking`` when pinned),
        then ``index_copy_`` per buffer on the device.
        """
        self._check_host(host)
        if host.device == self.device:
            for offset, row, length in runs:
                self._scatter_from(pages[offset : offset + length], host[row : row + length])
            return
        non_blocking = host.is_pinned()
        for lo, hi, pieces in staging_windows(pages.numel(), runs, self._window(max_staging_bytes)):
            staging = torch.empty((hi - lo, self._page_numel), dtype=self.dtype, device=self.device)
            for first, last, row in pieces:
                staging[first:last].copy_(host[row : row + last - first], non_blocking=non_blocking)
            self._scatter_from(pages[lo:hi], staging)

    def _window(self, max_staging_bytes: int) -> int:
        """Pages per device staging buffer of at most ``max_staging_bytes`` (one at least)."""
        return max(1, max_staging_bytes // max(1, self.page_nbytes))

    def _scatter_from(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """Write rows ``src`` ``[n, page_numel]`` (on this device) into ``pages`` (checked)."""
        rows = self._rows
        if self.device.type != "cpu" or pages.numel() == 0:
            # On a GPU index_copy_ runs at memory bandwidth.
            start = 0
            for row in rows:
                end = start + row.shape[1]
                row.index_copy_(0, pages, src[:, start:end])
                start = end
            return
        # On a CPU index_copy_ copies element by element (about 0.3x a contiguous
        # copy); whole rows are copied instead: consecutive device pages with one
        # copy_ per buffer, scattered ones with numpy's fancy assignment over rows
        # viewed as one opaque item each (a memcpy per row, the GIL released).
        listed = pages.tolist()
        n = len(listed)
        short_from = -1  # start of the current stretch of scattered (short-run) pages
        i = 0
        while i <= n:
            j = i + 1
            while j < n and listed[j] == listed[j - 1] + 1:
                j += 1
            if i < n and j - i < _MIN_RUN:
                if short_from < 0:
                    short_from = i
                i = j
                continue
            if short_from >= 0:
                self._scatter_rows(pages[short_from:i], src[short_from:i])
                short_from = -1
            if i < n:
                first, start = listed[i], 0
                for row in rows:
                    end = start + row.shape[1]
                    row[first : first + j - i].copy_(src[i:j, start:end])
                    start = end
            i = j

    def _scatter_rows(self, pages: torch.Tensor, src: torch.Tensor) -> None:
        """CPU: one numpy fancy assignment per buffer, one memcpy per page row.

        Rows of ``_BIG_ROW_BYTES`` and more (a page-first page) are copied with one
        ``copy_`` each instead: the call's cost is then lost in the copy's.
        """
        itemsize = self.dtype.itemsize
        if all(int(row.shape[1]) * itemsize >= _BIG_ROW_BYTES for row in self._rows):
            start = 0
            for row in self._rows:
                end = start + int(row.shape[1])
                for i, page in enumerate(pages.tolist()):
                    row[page].copy_(src[i, start:end])
                start = end
            return
        targets = self._numpy_rows()
        index = pages.numpy()
        host = src.detach().view(torch.uint8).numpy()
        start = 0
        for row, target in zip(self._rows, targets, strict=True):
            end = start + int(row.shape[1]) * itemsize
            target[index] = host[:, start:end].view(target.dtype)[:, 0]
            start = end

    def _numpy_rows(self) -> tuple[np.ndarray[Any, np.dtype[np.void]], ...]:
        """Each page-row buffer as a 1-D numpy array of opaque row-sized items (cached)."""
        if self._np_rows is None:
            made = []
            for row in self._rows:
                as_bytes = row.detach().view(torch.uint8).numpy()
                made.append(as_bytes.view(np.dtype((np.void, as_bytes.shape[1])))[:, 0])
            self._np_rows = tuple(made)
        return self._np_rows

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
        start = 0
        for row in self._rows:
            end = start + row.shape[1]
            row[p].copy_(values[start:end])
            start = end

    def _page(self, page: int) -> int:
        if not isinstance(page, int) or isinstance(page, bool) or not 0 <= page < self.num_pages:
            raise ConfigError(f"page {page!r} out of range [0, {self.num_pages})")
        return page


def _slot_rows(
    buffers: Sequence[torch.Tensor], page_size: int, what: str
) -> tuple[list[torch.Tensor], int]:
    """Buffers ``[slots, ...]`` of one shape, dtype and device as page rows, and the
    page size; slots past the last whole page (a runtime's padding slots) are in no page."""
    if not buffers:
        raise ConfigError(f"need {what}, at least one layer")
    page_size = _positive_int("page_size", page_size)
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
        _positive_ints(
            dtype, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            num_heads=num_heads, head_dim=head_dim,
        )  # fmt: skip
        shape = (num_pages * page_size, num_heads, head_dim)
        k = _zeros(num_layers, shape, dtype, device)
        return cls(k, _zeros(num_layers, shape, dtype, device), page_size)

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
        _positive_ints(
            dtype, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            num_heads=num_heads, head_dim=head_dim,
        )  # fmt: skip
        shape = (num_pages, num_layers, 2, page_size, num_heads, head_dim)
        return cls(_zeros(1, shape, dtype, device)[0])

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
        _positive_ints(
            dtype, num_layers=num_layers, num_pages=num_pages, page_size=page_size,
            latent_dim=latent_dim,
        )  # fmt: skip
        shape = (num_pages * page_size, 1, latent_dim)
        return cls(_zeros(num_layers, shape, dtype, device), page_size)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The latent buffers, one per layer."""
        return tuple(self.kv_buffers)
