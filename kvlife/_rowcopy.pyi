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

# pages's items as int64 (a bytearray) when each is an exact int in [0, limit) and none
# repeats; else the position of the first that is not.
def pages(pages: object, limit: int, /) -> bytearray | int: ...
