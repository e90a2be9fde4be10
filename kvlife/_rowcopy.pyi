# Each of dst, src and row_bytes: a contiguous buffer of uint64 (a numpy array, an
# array.array('Q')); checked in C. stream=False: memcpy, no streaming stores.
def copy_rows(
    dst: object, src: object, row_bytes: object, threads: int, stream: bool = True, /
) -> None: ...

# pages's items as int64 (a bytearray) when each is an exact int in [0, limit) and none
# repeats; else the position of the first that is not.
def pages(pages: object, limit: int, /) -> bytearray | int: ...
