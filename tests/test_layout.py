"""KV layouts: where a page lives, bit-exact gather and scatter, refusals that copy nothing."""

from __future__ import annotations

import os
import shutil
import threading
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kvlife.layout as layout_module
from kvlife.errors import ConfigError
from kvlife.layout import KVLayout, LayerFirstLayout, MLALayout, PageFirstLayout

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def make(kind: str, dtype: torch.dtype, num_pages: int = 6) -> KVLayout:
    """A small layout of each kind (3 layers, page size 4)."""
    if kind == "layer_first":
        return LayerFirstLayout.zeros(3, num_pages, 4, 2, 8, dtype=dtype)
    if kind == "page_first":
        return PageFirstLayout.zeros(3, num_pages, 4, 2, 8, dtype=dtype)
    return MLALayout.zeros(3, num_pages, 4, 24, dtype=dtype)


KINDS = ["layer_first", "page_first", "mla"]


def fill_random_bits(layout: KVLayout, seed: int) -> None:
    """Every bit pattern, NaNs and infinities included: a copy must move bits, not values."""
    g = torch.Generator().manual_seed(seed)
    for buf in layout.buffers():
        bits = buf.view(BITS[layout.dtype])
        info = torch.iinfo(bits.dtype)
        bits.copy_(torch.randint(info.min, info.max, bits.shape, generator=g, dtype=bits.dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def snapshot(layout: KVLayout) -> list[torch.Tensor]:
    return [b.clone() for b in layout.buffers()]


def unchanged(layout: KVLayout, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(bits(a), bits(b)) for a, b in zip(layout.buffers(), before, strict=True))


def test_layer_first_shapes_follow_the_mha_pool() -> None:
    layout = LayerFirstLayout.zeros(3, 6, 4, 2, 8, dtype=torch.float16)
    assert len(layout.k_buffers) == len(layout.v_buffers) == 3
    assert all(b.shape == (24, 2, 8) for b in layout.k_buffers + layout.v_buffers)
    assert layout.page_numel == 3 * 2 * 4 * 2 * 8
    assert layout.page_nbytes == layout.page_numel * 2
    # separate allocations, as a runtime makes them
    assert len({b.data_ptr() for b in layout.buffers()}) == 6


def test_page_first_and_mla_shapes() -> None:
    pf = PageFirstLayout.zeros(3, 6, 4, 2, 8)
    assert pf.tensor.shape == (6, 3, 2, 4, 2, 8)
    assert pf.page_numel == 3 * 2 * 4 * 2 * 8
    mla = MLALayout.zeros(3, 6, 4, 24)
    assert [b.shape for b in mla.kv_buffers] == [(24, 1, 24)] * 3
    assert mla.page_numel == 3 * 4 * 24


def test_a_page_is_page_size_consecutive_slots() -> None:
    """Page p of a layer-first pool is slots [p*page_size, (p+1)*page_size) of every buffer."""
    layout = LayerFirstLayout.zeros(2, 5, 4, 2, 3, dtype=torch.float32)
    layout.k_buffers[1][8:12] = 1.0  # page 2 of layer 1's K
    layout.v_buffers[0][12] = 2.0  # first slot of page 3 of layer 0's V
    page2 = layout.read_page(2).view(2, 2, 4, 2, 3)  # [layer, k/v, slot, head, dim]
    assert bool((page2[1, 0] == 1).all()) and page2.sum() == 4 * 2 * 3
    page3 = layout.read_page(3).view(2, 2, 4, 2, 3)
    assert bool((page3[0, 1, 0] == 2).all()) and page3.sum() == 2 * 2 * 3
    for p in (0, 1, 4):
        assert layout.read_page(p).abs().sum() == 0


def test_page_first_page_is_one_row() -> None:
    layout = PageFirstLayout.zeros(2, 5, 4, 2, 3, dtype=torch.float32)
    layout.tensor[3, 1, 0] = 5.0
    assert torch.equal(layout.read_page(3), layout.tensor[3].flatten())
    assert layout.read_page(2).abs().sum() == 0


@pytest.mark.parametrize("kind", KINDS)
def test_write_page_then_read_page(kind: str) -> None:
    layout = make(kind, torch.float32)
    values = torch.arange(layout.page_numel, dtype=torch.float32)
    layout.write_page(4, values)
    assert torch.equal(layout.read_page(4), values)
    assert all(layout.read_page(p).abs().sum() == 0 for p in (0, 1, 2, 3, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact(kind: str, dtype: torch.dtype) -> None:
    """Gather pages to page-major host rows, scatter them into a fresh layout: same bits."""
    src = make(kind, dtype, num_pages=9)
    fill_random_bits(src, seed=1)
    pages = torch.tensor([7, 0, 3, 8, 5])
    host = torch.empty((5, src.page_numel), dtype=dtype)
    src.gather(pages, host)
    for i, p in enumerate(pages.tolist()):
        assert torch.equal(bits(host[i]), bits(src.read_page(p)))
    dst = make(kind, dtype, num_pages=9)
    dst.scatter(pages, host)
    for p in range(9):
        if p in pages.tolist():
            assert torch.equal(bits(dst.read_page(p)), bits(src.read_page(p)))
        else:
            assert dst.read_page(p).abs().sum() == 0  # pages not named stay untouched


@pytest.mark.parametrize("kind", KINDS)
def test_gather_runs_writes_only_the_named_host_rows(kind: str) -> None:
    layout = make(kind, torch.float32)
    fill_random_bits(layout, seed=2)
    host = torch.zeros((10, layout.page_numel))
    pages = torch.tensor([5, 1, 2, 0])
    layout.gather_runs(pages, host, [(0, 7, 2), (2, 3, 1), (3, 0, 1)])
    for row, p in ((7, 5), (8, 1), (3, 2), (0, 0)):
        assert torch.equal(bits(host[row]), bits(layout.read_page(p)))
    for row in (1, 2, 4, 5, 6, 9):
        assert host[row].abs().sum() == 0


def test_a_layout_wraps_a_runtimes_buffers_without_copying() -> None:
    k = [torch.zeros(4 * 3 + 1, 2, 5) for _ in range(2)]  # one padding slot past the last page
    v = [torch.zeros(4 * 3 + 1, 2, 5) for _ in range(2)]
    layout = LayerFirstLayout(k, v, page_size=4)
    assert (layout.num_pages, layout.num_layers, layout.page_numel) == (3, 2, 2 * 2 * 4 * 2 * 5)
    v[1][4:8] = 3.0
    assert layout.read_page(1).view(2, 2, -1)[1, 1].eq(3).all()
    mla = MLALayout([torch.zeros(8, 1, 6)], page_size=4)
    assert (mla.num_pages, mla.latent_dim) == (2, 6)
    tensor = torch.zeros(3, 2, 2, 4, 2, 5)
    pf = PageFirstLayout(tensor)
    assert (pf.num_pages, pf.num_layers, pf.page_size, pf.num_heads, pf.head_dim) == (3, 2, 4, 2, 5)
    tensor[2] = 1.0
    assert pf.read_page(2).eq(1).all() and pf.buffers() == (tensor,)
    rows = KVLayout([torch.zeros(3, 10), torch.zeros(3, 6)], page_size=2)  # page rows as given
    assert (rows.num_pages, rows.page_numel, len(rows.buffers())) == (3, 16, 2)
    with pytest.raises(ConfigError):
        LayerFirstLayout(k, v[:1], page_size=4)
    with pytest.raises(ConfigError):
        LayerFirstLayout(k, [v[0], torch.zeros(13, 2, 4)], page_size=4)
    with pytest.raises(ConfigError):
        LayerFirstLayout(k, v, page_size=14)  # not one whole page
    with pytest.raises(ConfigError):
        LayerFirstLayout([], [], page_size=4)
    with pytest.raises(ConfigError):
        MLALayout([torch.zeros(8, 2, 6)], page_size=4)
    with pytest.raises(ConfigError):
        PageFirstLayout(torch.zeros(3, 2, 3, 4, 2, 5))  # not K and V
    for bad_rows in (
        [],
        [torch.zeros(3, 10), torch.zeros(4, 6)],  # two page counts
        [torch.zeros(3, 10), torch.zeros(3, 6, dtype=torch.float16)],  # two dtypes
        [torch.zeros(10, 3).t()],  # rows not contiguous
    ):
        with pytest.raises(ConfigError):
            KVLayout(bad_rows, page_size=2)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_gather_and_scatter_are_refused_and_copy_nothing(kind: str) -> None:
    layout = make(kind, torch.float32)
    fill_random_bits(layout, seed=3)
    before = snapshot(layout)
    n = layout.page_numel
    out = torch.zeros((2, n))
    cases = [
        (torch.tensor([0, 6]), out),  # page out of range
        (torch.tensor([-1, 0]), out),
        (torch.tensor([0, 1], dtype=torch.int32), out),  # not int64
        (torch.tensor([[0, 1]]), out),  # not 1-D
        (torch.tensor([0, 1]), torch.zeros((2, n), dtype=torch.float16)),  # wrong dtype
        (torch.tensor([0, 1]), torch.zeros((2, n + 1))),  # wrong width
        (torch.tensor([0, 1, 2]), out),  # wrong count
        (torch.tensor([0, 1]), torch.zeros((n, 2)).t()),  # rows not contiguous
    ]
    for pages, rows in cases:
        with pytest.raises(ConfigError):
            layout.gather(pages, rows)
        assert rows.abs().sum() == 0
        with pytest.raises(ConfigError):
            layout.scatter(pages, rows)
        assert unchanged(layout, before)
    for bad in (6, -1, True):
        with pytest.raises(ConfigError):
            layout.read_page(bad)
        with pytest.raises(ConfigError):
            layout.write_page(bad, torch.zeros(n))
    with pytest.raises(ConfigError):
        layout.write_page(0, torch.zeros(n + 1))
    with pytest.raises(ConfigError):
        layout.gather_runs(torch.tensor([0]), torch.zeros((2, n + 1)), [(0, 0, 1)])
    assert unchanged(layout, before)


def test_page_index_checks_pages() -> None:
    layout = make("page_first", torch.float32)
    assert layout.page_index([3, 1]).tolist() == [3, 1]
    for bad in ([6], [-1], ["x"], [1.5]):
        with pytest.raises(ConfigError):
            layout.page_index(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "args",
    [(0, 6, 4, 2, 8), (3, 0, 4, 2, 8), (3, 6, 0, 2, 8), (3, 6, 4, -2, 8), (3, 6, 4, 2, 1.5)],
)
def test_bad_layout_arguments_are_refused(args: tuple[Any, ...]) -> None:
    with pytest.raises(ConfigError):
        LayerFirstLayout.zeros(*args)
    with pytest.raises(ConfigError):
        PageFirstLayout.zeros(*args)
    with pytest.raises(ConfigError):
        MLALayout.zeros(*args[:3], args[3] * args[4])
    with pytest.raises(ConfigError):
        LayerFirstLayout.zeros(3, 6, 4, 2, 8, dtype="float32")  # type: ignore[arg-type]


def _unusable_devices() -> list[object]:
    """Devices this machine cannot allocate on: a name torch does not know, a bool, None,
    and CUDA where there is none (else a CUDA ordinal past the last GPU)."""
    devices: list[object] = ["nope", True, None, 1.5]
    if torch.cuda.is_available():
        devices += [f"cuda:{torch.cuda.device_count()}", torch.cuda.device_count()]
    else:
        devices += ["cuda", "cuda:0", torch.device("cuda"), 0]
    return devices


@pytest.mark.parametrize("device", _unusable_devices(), ids=repr)
def test_issue23_a_device_that_cannot_be_used_is_a_config_error_naming_it(device: object) -> None:
    """It was torch's RuntimeError (an unknown name) or AssertionError (no CUDA)."""
    for zeros in (
        lambda: LayerFirstLayout.zeros(1, 2, 2, 1, 2, device=device),  # type: ignore[arg-type]
        lambda: PageFirstLayout.zeros(1, 2, 2, 1, 2, device=device),  # type: ignore[arg-type]
        lambda: MLALayout.zeros(1, 2, 2, 4, device=device),  # type: ignore[arg-type]
    ):
        with pytest.raises(ConfigError, match="device"):
            zeros()


# ---------------------------------------------------------------- restore (host -> device)

# A CPU copy takes one of three paths; each test runs through all of them: torch's
# (index_select / index_copy_, where kvlife._rowcopy is not built), and the C row copy
# by address, by memcpy on one thread or streamed.
PATHS = ["torch", "memcpy", "stream"]


def restore_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    monkeypatch.setattr(layout_module, "STREAM_BYTES", 0 if path == "stream" else 1 << 62)
    if path == "torch":
        monkeypatch.setattr(layout_module, "_rowcopy", None)
    elif layout_module._rowcopy is None:
        pytest.skip("kvlife._rowcopy is not built (no C compiler at install)")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_scatter_runs_round_trip_is_bit_exact(
    monkeypatch: pytest.MonkeyPatch, kind: str, dtype: torch.dtype, path: str
) -> None:
    """Store pages to scattered host rows, restore them into other device pages: same bits.

    Device pages mix consecutive stretches (2 3 4 5, 9 10) and lone pages;
    host rows come in runs (offset, first row, length) as the engine makes them.
    """
    restore_path(monkeypatch, path)
    src = make(kind, dtype, num_pages=12)
    fill_random_bits(src, seed=4)
    stored = torch.tensor([11, 0, 7, 3, 5, 1, 8, 6])
    runs = [(0, 9, 3), (3, 2, 1), (4, 4, 4)]  # host rows 9 10 11 | 2 | 4 5 6 7
    host = torch.zeros((13, src.page_numel), dtype=dtype)
    src.gather_runs(stored, host, runs)
    host_before = host.clone()
    dst = make(kind, dtype, num_pages=12)
    restored = torch.tensor([2, 3, 4, 5, 9, 10, 0, 7])
    dst.scatter_runs(restored, host, runs)
    for s, d in zip(stored.tolist(), restored.tolist(), strict=True):
        assert torch.equal(bits(dst.read_page(d)), bits(src.read_page(s)))
    for p in set(range(12)) - set(restored.tolist()):
        assert dst.read_page(p).abs().sum() == 0  # pages not named stay untouched
    assert torch.equal(bits(host), bits(host_before))  # a restore only reads the host


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_scatter_matches_index_copy(monkeypatch: pytest.MonkeyPatch, kind: str, path: str) -> None:
    """The fast restore writes exactly what ``index_copy_`` per buffer would, random pages."""
    restore_path(monkeypatch, path)
    g = torch.Generator().manual_seed(9)
    for trial in range(5):
        n = int(torch.randint(1, 12, (1,), generator=g))
        pages = torch.randperm(12, generator=g)[:n]
        if trial % 2:
            pages = pages.sort().values  # consecutive stretches
        src = torch.randn((n, make(kind, torch.float32).page_numel), generator=g)
        fast, reference = make(kind, torch.float32, 12), make(kind, torch.float32, 12)
        fill_random_bits(fast, seed=trial)
        fill_random_bits(reference, seed=trial)
        fast.scatter(pages, src)
        start = 0
        for row in reference.page_rows():
            end = start + row.shape[1]
            row.index_copy_(0, pages, src[:, start:end])
            start = end
        assert all(
            torch.equal(bits(a), bits(b))
            for a, b in zip(fast.buffers(), reference.buffers(), strict=True)
        )


@pytest.mark.parametrize("path", PATHS)
def test_scatter_into_a_runtimes_buffers_leaves_padding_slots_alone(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    restore_path(monkeypatch, path)
    k = [torch.full((4 * 3 + 1, 2, 5), 7.0) for _ in range(2)]  # one padding slot
    v = [torch.full((4 * 3 + 1, 2, 5), 7.0) for _ in range(2)]
    layout = LayerFirstLayout(k, v, page_size=4)
    rows = torch.arange(3 * layout.page_numel, dtype=torch.float32).view(3, -1)
    layout.scatter(torch.tensor([2, 0, 1]), rows)
    for i, p in enumerate((2, 0, 1)):
        assert torch.equal(layout.read_page(p), rows[i])
    assert all(bool(b[12].eq(7).all()) for b in (*k, *v))
    mla_buffers = [torch.full((9, 1, 6), 7.0)]
    mla = MLALayout(mla_buffers, page_size=4)
    mla_rows = torch.arange(2 * mla.page_numel, dtype=torch.float32).view(2, -1)
    mla.scatter(torch.tensor([1, 0]), mla_rows)
    assert torch.equal(mla.read_page(1), mla_rows[0]) and bool(mla_buffers[0][8].eq(7).all())


@pytest.mark.parametrize("kind", KINDS)
def test_bad_scatter_runs_is_refused_and_copies_nothing(kind: str) -> None:
    layout = make(kind, torch.float32)
    fill_random_bits(layout, seed=5)
    before = snapshot(layout)
    n = layout.page_numel
    for host in (
        torch.zeros((2, n + 1)),  # wrong width
        torch.zeros((2, n), dtype=torch.float16),  # wrong dtype
        torch.zeros(2 * n),  # not 2-D
    ):
        with pytest.raises(ConfigError):
            layout.scatter_runs(torch.tensor([0, 1]), host, [(0, 0, 2)])
        assert unchanged(layout, before)


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    window=st.integers(1, 9),
    gap=st.integers(0, 3),
)
def test_staging_windows_map_each_chunk_page_to_its_host_row_once(
    lengths: list[int], window: int, gap: int
) -> None:
    """The device-staging path of both directions (GPU only) walks these windows: each chunk
    page lands in exactly one window, in order, paired with its own host row."""
    from kvlife.layout import staging_windows

    runs, offset, row = [], 0, 3
    for length in lengths:
        runs.append((offset, row, length))
        offset, row = offset + length, row + length + gap
    expected = {o + i: r + i for o, r, n in runs for i in range(n)}
    seen: dict[int, int] = {}
    for lo, hi, pieces in staging_windows(offset, runs, window):
        assert 0 < hi - lo <= window
        for first, last, host_row in pieces:
            assert 0 <= first < last <= hi - lo
            for i in range(last - first):
                page = lo + first + i
                assert page not in seen
                seen[page] = host_row + i
    assert seen == expected


@pytest.mark.parametrize("kind", KINDS)
def test_the_staged_path_copies_what_the_direct_path_copies(kind: str) -> None:
    """A host tensor on another device goes through device staging, a window at a time.

    No second device here: the layout is told it lives on ``cpu:0``, which compares
    unequal to the host tensor's ``cpu``, so gather_runs and scatter_runs take the
    staging branch a GPU takes, with windows of two pages, on real CPU tensors.
    """
    stored = torch.tensor([11, 0, 7, 3, 5, 1, 8, 6])
    restored = torch.tensor([2, 3, 4, 5, 9, 10, 0, 7])
    runs = [(0, 9, 3), (3, 2, 1), (4, 4, 4)]  # host rows 9 10 11 | 2 | 4 5 6 7
    results = []
    for staged in (False, True):
        src = make(kind, torch.float32, num_pages=12)
        fill_random_bits(src, seed=7)
        dst = make(kind, torch.float32, num_pages=12)
        if staged:
            src.device = dst.device = torch.device("cpu", 0)
        window = 2 * src.page_nbytes
        host = torch.zeros((13, src.page_numel))
        src.gather_runs(stored, host, runs, max_staging_bytes=window)
        dst.scatter_runs(restored, host, runs, max_staging_bytes=window)
        results.append((host, dst.buffers()))
    (host, restored_buffers), (staged_host, staged_buffers) = results
    assert torch.equal(bits(staged_host), bits(host)) and bool(bits(host).any())
    assert all(
        torch.equal(bits(a), bits(b)) for a, b in zip(staged_buffers, restored_buffers, strict=True)
    )


def test_the_row_copy_extension_is_built_where_a_compiler_is() -> None:
    """Without it CPU copies still work, through torch, slower: an install that silently
    lost it is a failure here wherever it could have been built."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: kvlife installs without kvlife._rowcopy")
    assert layout_module._rowcopy is not None


def _scattered_rows(seed: int) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """64 rows of 4 KiB in a random order: the source, a zeroed target, their addresses."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-128, 127, (64, 4096), dtype=torch.int8, generator=g)
    dst = torch.zeros_like(src)
    order = torch.randperm(64, generator=g).tolist()
    targets = np.array([dst[j].data_ptr() for j in order], dtype=np.uint64)
    sources = np.array([src[j].data_ptr() for j in order], dtype=np.uint64)
    return src, dst, targets, sources


def _rowcopy_or_skip() -> Any:
    if layout_module._rowcopy is None:
        pytest.skip("kvlife._rowcopy is not built")
    return layout_module._rowcopy


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("threads", [1, 2, 3, 17])
def test_row_copies_move_every_byte_at_any_alignment(threads: int, stream: bool) -> None:
    """Rows of 0 to 300 bytes from and to addresses at every offset mod 16 (the streaming
    stores need 16-byte aligned targets: the head and tail go by memcpy), on 1 to 17
    threads (more than rows, more than the C side's cap of 16), streamed or by memcpy."""
    rowcopy = _rowcopy_or_skip()
    g = torch.Generator().manual_seed(1)
    src = torch.randint(-128, 127, (8192,), dtype=torch.int8, generator=g)
    dst = torch.zeros(8192, dtype=torch.int8)
    widths = [0, 1, 15, 16, 63, 64, 65, 129, 300]
    sources, targets, expected = [], [], dst.clone()
    at = 0
    for i, width in enumerate(widths):
        s_off, d_off = 7 * i + 1, at + (i % 16)
        sources.append(src.data_ptr() + s_off)
        targets.append(dst.data_ptr() + d_off)
        expected[d_off : d_off + width] = src[s_off : s_off + width]
        at = d_off + width + 32
    # Widths are per column (entry i takes width i % len(widths)): one row per column here.
    rowcopy.copy_rows(
        np.array(targets, dtype=np.uint64),
        np.array(sources, dtype=np.uint64),
        np.array(widths, dtype=np.uint64),
        threads,
        stream,
    )
    assert torch.equal(dst, expected)


def test_row_copies_never_wait_for_a_late_thread_and_leave_it_nothing_to_touch() -> None:
    """The C copy waits only for the rows its helper threads took, so a helper may start
    after the call returned: it must find no rows left and touch neither the address
    buffers (freed by then) nor the rows. On one core, with 16 threads a call, many
    helpers start late: every call's bytes must be exact, later calls' too, and the
    process must not crash."""
    rowcopy = _rowcopy_or_skip()
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        for i in range(120):
            src, dst, targets, sources = _scattered_rows(seed=i)
            rowcopy.copy_rows(targets, sources, np.array([4096], dtype=np.uint64), 16, i % 2)
            del targets, sources  # a late helper must not read them
            assert torch.equal(dst, src), i
    finally:
        os.sched_setaffinity(0, cores)


def test_the_c_page_check_takes_distinct_ints_in_range_and_names_the_first_other() -> None:
    """``kvlife._rowcopy.pages``, the engines' page check: the pages as int64, or the
    position of the first that is not an exact int in range or repeats an earlier one."""
    rowcopy = _rowcopy_or_skip()
    assert np.frombuffer(rowcopy.pages([3, 0, 2], 4), dtype=np.int64).tolist() == [3, 0, 2]
    assert rowcopy.pages((), 4) == bytearray()
    for bad, at in [
        ([3, 1, 3], 2),  # a repeat: the second one
        ([1, True], 1),  # a bool is not a page
        ([1, np.int64(2)], 1),  # nor a numpy int
        ([1, 2.0], 1),
        ([0, 4], 1),
        ([-1, 0], 0),
        ([2**70], 0),
    ]:
        assert rowcopy.pages(bad, 4) == at, bad
    many = list(range(100_000))[::-1]
    assert len(rowcopy.pages(many, 100_000)) == 8 * 100_000
    assert rowcopy.pages([*many, 77], 100_000) == 100_000


def test_the_c_page_check_reads_an_int32_or_int64_array_as_it_is() -> None:
    """vLLM hands block ids over as an int32 array: ``pages`` reads an int32 or int64
    array (strided too) in the same pass with the same rules; another array type is read
    item by item, and its numpy items are not pages."""
    rowcopy = _rowcopy_or_skip()
    for dtype in (np.int32, np.int64):
        ids = np.array([5, 0, 2, 7], dtype=dtype)
        for array, want in ((ids, [5, 0, 2, 7]), (ids[::-2], [7, 0])):
            assert np.frombuffer(rowcopy.pages(array, 8), dtype=np.int64).tolist() == want
        assert rowcopy.pages(ids, 7) == 3  # out of range
        assert rowcopy.pages(np.array([1, 2, 1], dtype=dtype), 8) == 2  # a repeat
        assert rowcopy.pages(np.array([1, -2], dtype=dtype), 8) == 1
        assert rowcopy.pages(np.array([], dtype=dtype), 8) == bytearray()
    for other in (np.array([1, 2], dtype=np.uint32), np.array([1.0]), np.zeros((2, 2), int)):
        assert rowcopy.pages(other, 8) == 0, other.dtype


def test_row_copies_refuse_mismatched_address_buffers() -> None:
    rowcopy = _rowcopy_or_skip()
    two, three = np.zeros(2, dtype=np.uint64), np.zeros(3, dtype=np.uint64)
    for args in (
        (two, three, np.ones(1, dtype=np.uint64)),  # dst and src differ in length
        (three, three, np.ones(2, dtype=np.uint64)),  # not a whole number of rows
        (two, two, np.zeros(0, dtype=np.uint64)),  # no row widths
        (b"abc", b"abc", np.ones(1, dtype=np.uint64)),  # not uint64 addresses
    ):
        with pytest.raises(ValueError):
            rowcopy.copy_rows(*args, 2)


@pytest.mark.parametrize(
    "runs",
    [
        [(0, 0, 3), (2, 5, 3)],  # overlapping runs: page 2 has two host rows
        [(0, 0, 2), (1, 5, 2)],  # overlapping runs leave pages 3 and 4 with none
        [(0, 0, 4)],  # page 4 has no host row
        [(0, 6, 5)],  # host rows past the pool's 8
        [(0, -1, 5)],  # a negative host row
        [(0, 0, 6)],  # more pages than the chunk's 5
        [(0, 0, 5), (0, 5, 1), (0, 0, -1)],  # a negative run: the lengths add up, rows clash
        [(0, 0), (2, 2), (4, 4)],  # pairs, not triples (as many numbers as two triples)
        [],  # no runs for five pages
    ],
)
@pytest.mark.parametrize("path", ["memcpy", "stream"])
def test_a_streamed_copy_with_bad_runs_is_refused_and_copies_nothing(
    monkeypatch: pytest.MonkeyPatch, runs: list[tuple[int, int, int]], path: str
) -> None:
    """The copy by address (memcpy or streamed) writes by raw address: every run and page
    is checked first."""
    _rowcopy_or_skip()
    restore_path(monkeypatch, path)
    layout = make("layer_first", torch.float32, num_pages=12)
    fill_random_bits(layout, seed=6)
    before = snapshot(layout)
    host = torch.randn(8, layout.page_numel)
    host_before = host.clone()
    pages = torch.tensor([1, 3, 5, 7, 9])
    for copy in (layout.scatter_runs, layout.gather_runs):
        with pytest.raises(ConfigError):
            copy(pages, host, runs)
        assert unchanged(layout, before) and torch.equal(host, host_before)
    with pytest.raises(ConfigError):  # a page out of range
        layout.scatter_runs(torch.tensor([1, 3, 5, 7, 12]), host, [(0, 0, 5)])
    with pytest.raises(ConfigError):  # pages not int64
        layout.scatter_runs(torch.tensor([1, 3, 5, 7, 9], dtype=torch.int32), host, [(0, 0, 5)])
    assert unchanged(layout, before)


def test_a_copy_by_address_reads_pages_through_their_strides() -> None:
    """Pages as a strided view (every other element of a tensor) are read as torch reads
    them, not as the memory they sit in."""
    _rowcopy_or_skip()
    layout = make("layer_first", torch.float32, num_pages=12)
    fill_random_bits(layout, seed=7)
    strided = torch.tensor([1, 0, 3, 0, 5, 0, 7])[::2]
    host = torch.zeros(4, layout.page_numel)
    layout.gather_runs(strided, host, [(0, 2, 2), (2, 0, 2)])
    expected = torch.zeros_like(host)
    layout.gather_runs(strided.contiguous(), expected, [(0, 2, 2), (2, 0, 2)])
    bits = host.view(torch.int32)  # random bits: NaNs among them, equal to nothing
    assert torch.equal(bits, expected.view(torch.int32))
    assert torch.equal(bits[2], layout.read_page(1).cpu().view(torch.int32))


def test_int8_rows_of_odd_widths_at_odd_offsets_stream_bit_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Page rows as a runtime may hand them: int8, odd widths, a storage offset of 3 (no
    row 16-byte aligned); a round trip through the streamed copy against index_select."""
    _rowcopy_or_skip()
    restore_path(monkeypatch, "stream")
    g = torch.Generator().manual_seed(3)
    flat = [
        torch.randint(-128, 127, (3 + 20 * w,), dtype=torch.int8, generator=g) for w in (1, 65, 333)
    ]
    rows = [f[3:].view(20, -1) for f in flat]
    layout = KVLayout(rows, page_size=1)
    pages = torch.tensor([19, 2, 7, 3, 11])
    host = torch.zeros(9, layout.page_numel, dtype=torch.int8)
    layout.gather_runs(pages, host, [(0, 4, 2), (2, 0, 3)])
    expected = torch.cat([r[pages] for r in rows], dim=1)
    assert torch.equal(host[4:6], expected[:2]) and torch.equal(host[0:3], expected[2:])
    targets = torch.tensor([0, 1, 4, 5, 6])
    layout.scatter_runs(targets, host, [(0, 4, 2), (2, 0, 3)])
    assert all(torch.equal(r[targets], r[pages]) for r in rows)


@pytest.mark.parametrize("path", ["memcpy", "stream"])
def test_rows_a_byte_copy_would_get_wrong_are_left_to_torch(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Host rows that overlap (an expanded tensor) are refused as torch's paths refuse them,
    and a lazily conjugated host is copied as torch copies it (its values, conjugated):
    neither is copied as raw bytes by the copy by address."""
    _rowcopy_or_skip()
    restore_path(monkeypatch, path)
    layout = make("layer_first", torch.float32, num_pages=12)
    fill_random_bits(layout, seed=8)
    before = snapshot(layout)
    overlapping = torch.zeros(1, layout.page_numel).expand(4, -1)
    with pytest.raises(RuntimeError):
        layout.gather_runs(torch.tensor([1, 2, 3, 4]), overlapping, [(0, 0, 4)])
    assert unchanged(layout, before)
    rows = [torch.randn(6, 8, dtype=torch.complex64) for _ in range(2)]
    complex_layout = KVLayout(rows, page_size=1)
    host = torch.randn(3, complex_layout.page_numel, dtype=torch.complex64)
    complex_layout.scatter_runs(torch.tensor([5, 0, 2]), host.conj(), [(0, 0, 3)])
    written = torch.cat([r[[5, 0, 2]] for r in rows], dim=1)
    assert torch.equal(written, host.conj().resolve_conj())
    assert not torch.equal(written, host)  # (not its raw bytes)


def _in_a_child(call: Any, timeout: float = 30.0) -> tuple[int, str]:
    """Run ``call()`` (returning a str) in a forked child process, so a crash kills the
    child, not pytest: the child's wait status and what ``call`` returned or raised."""
    import os
    import select
    import signal

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's teardown
        try:
            os.close(read)
            torch.set_num_threads(1)  # the parent's OpenMP pool is not in the child
            try:
                said = call()
            except BaseException as exc:  # reported to the parent
                said = f"raised {type(exc).__name__}: {exc}"
            os.write(write, said.encode()[:60000])
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    try:
        while select.select([read], [], [], timeout)[0]:
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read)
    _, status = os.waitpid(pid, 0)
    return status, b"".join(chunks).decode()


@pytest.mark.parametrize("path", ["memcpy", "stream"])
@pytest.mark.parametrize("released", ["kv_buffer", "host", "host_shrunk"])
def test_issue36_8_a_streamed_copy_of_released_storage_is_refused_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, released: str, path: str
) -> None:
    """Scenario: a KV buffer's (or the host pool's) storage is released after the layout
    was built (``untyped_storage().resize_(0)``, or shrunk to half), then a CPU copy runs
    both ways through the C row copy (the path of copies of ``STREAM_BYTES`` and more,
    taken here by small ones too). The old code copied by address into freed memory and
    the process died of SIGSEGV; now each copy is a ConfigError and no live byte changes.
    Run in a forked child, so the old crash fails this test instead of killing pytest."""
    import os

    restore_path(monkeypatch, path)
    layout = make("layer_first", torch.float32, num_pages=12)
    fill_random_bits(layout, seed=9)
    host = torch.randn(12, layout.page_numel)
    pages = torch.tensor([11, 0, 7, 3, 5, 9, 1, 2])
    before, host_before = snapshot(layout), host.clone()

    def copies() -> str:
        live = list(range(len(before)))
        if released == "kv_buffer":
            layout.buffers()[1].untyped_storage().resize_(0)
            live.remove(1)
        elif released == "host":
            host.untyped_storage().resize_(0)
        else:
            host.untyped_storage().resize_(host.untyped_storage().nbytes() // 2)
        said = []
        for copy in (layout.gather_runs, layout.scatter_runs):
            try:
                copy(pages, host, [(0, 4, 8)])
                said.append("copied")
            except ConfigError as exc:
                said.append("refused" if "released or shrunk" in str(exc) else str(exc))
            same = all(torch.equal(bits(layout.buffers()[i]), bits(before[i])) for i in live)
            if released == "kv_buffer":
                same = same and torch.equal(host, host_before)
            said.append("unchanged" if same else "changed")
        return " ".join(said)

    status, said = _in_a_child(copies)
    assert os.WIFEXITED(status), f"the copy killed its process (status {status:#x}): {said}"
    assert said == "refused unchanged refused unchanged", said


def test_main_thread_copies_run_on_torchs_openmp_team_other_threads_on_their_own() -> None:
    """Where torch loaded an OpenMP runtime, a copy asked to (the main thread's, from
    kvlife.layout) runs on torch's own team, whose threads are awake, rather than on new
    threads that wait for a core one of them holds (docs/engines.md); a copy not asked to,
    or of one thread, or in a forked child (whose runtime may not run a team), runs on the
    module's own threads. Every byte arrives either way."""
    rowcopy = _rowcopy_or_skip()
    if layout_module._torch_openmp() is None:
        pytest.skip("torch loaded no OpenMP runtime here")
    assert layout_module.OPENMP
    width = np.array([4096], dtype=np.uint64)
    for team, threads, on_team in ((True, 4, True), (False, 4, False), (True, 1, False)):
        src, dst, targets, sources = _scattered_rows(3)
        assert rowcopy.copy_rows(targets, sources, width, threads, False, team) is on_team
        assert torch.equal(dst, src), (team, threads)

    def in_the_child() -> str:
        src, dst, targets, sources = _scattered_rows(4)
        on_team = rowcopy.copy_rows(targets, sources, width, 4, False, True)
        return f"{on_team} {torch.equal(dst, src)}"

    status, said = _in_a_child(in_the_child)
    assert status == 0 and said == "False True", (status, said)


def test_a_layouts_copy_takes_the_team_on_the_main_thread_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvlife.layout asks for torch's team on the main thread alone: another thread's team
    would be a second one, spinning beside the model's."""
    _rowcopy_or_skip()
    asked: list[bool] = []
    real = layout_module._rowcopy.copy_pages

    def copy_pages(*args: Any) -> bool:
        asked.append(args[8])
        return real(*args)

    monkeypatch.setattr(layout_module._rowcopy, "copy_pages", copy_pages)
    layout = LayerFirstLayout.zeros(2, 8, 4, 2, 8, dtype=torch.float32)
    host = torch.zeros(3, layout.page_numel)
    layout.gather_runs(torch.tensor([5, 1, 6]), host, [(0, 0, 3)])
    elsewhere = threading.Thread(
        target=layout.scatter_runs, args=(torch.tensor([2, 3, 4]), host, [(0, 0, 3)])
    )
    elsewhere.start()
    elsewhere.join()
    assert asked == [layout_module.OPENMP, False]
