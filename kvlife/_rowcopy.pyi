# Each of dst, src and row_bytes: a contiguous buffer of uint64 (a numpy array, an
# array.array('Q')); checked in C. stream=False: memcpy, no streaming stores. team=True:
# on torch's OpenMP team where use_openmp found it (from the thread that owns that team).
# Returns whether it ran on that team.
def copy_rows(
    dst: object,
    src: object,
    row_bytes: object,
    threads: int,
    stream: bool = True,
    team: bool = False,
    /,
) -> bool: ...

# Copy on the team of the OpenMP runtime already loaded from path (torch's); True if its
# GOMP_parallel was found.
def use_openmp(path: str, /) -> bool: ...

# pages's items as int64 (a bytearray) when each is an exact int (or pages is a 1-D int32
# or int64 array) in [0, limit) and none repeats; else the position of the first that is not.
def pages(pages: object, limit: int, /) -> bytearray | int: ...

# A layout's copy of pages (1-D int64, each in [0, num_pages)) to or from host rows: runs
# int64 (offset, first row, length) triples, host (rows, address, row stride), geometry an
# int64 (address, row stride, offset in a host row, row bytes) per buffer. Every page and
# run is checked, and a refusal raises `error` with nothing copied; else as copy_rows.
def copy_pages(
    load: bool,
    pages: object,
    num_pages: int,
    runs: object,
    host: tuple[int, int, int],
    geometry: object,
    threads: int,
    stream: bool,
    team: bool,
    error: type[BaseException],
    /,
) -> bool: ...

# A chunk's marks on page-use counts (int32 buffers writes/reads at int64 indices
# written/read): n=1 marks (written -1, read +1) if free, n=0 checks, n=-1 unmarks.
# Whether the pages were free.
def claim(writes: object, written: object, reads: object, read: object, n: int, /) -> bool: ...

# The maximal runs of consecutive pages (read as pages() reads them): (offset, first page,
# length); None where an item is not an exact int.
def runs(pages: object, /) -> list[tuple[int, int, int]] | None: ...
