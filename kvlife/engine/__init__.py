"""Copy engines: device pages to host pages (stores) and back (loads), asynchronously,
one ack per chunk.

:class:`CpuCopyEngine` runs real worker threads over a CPU layout (for tests
and the simulator); :class:`CudaCopyEngine` uses a side stream and
``torch.cuda.Event`` over a CUDA layout. Both follow :class:`CopyEngine`.
"""

from kvlife.engine.base import (
    Ack,
    Completion,
    CopyEngine,
    CopyFault,
    DevicePageBusy,
    DrainTimeout,
    DuplicatePage,
    EngineClosed,
    EngineConfigError,
    EngineError,
    HostPageBusy,
    InvalidTicket,
    LayoutMismatch,
    LengthMismatch,
    PageOutOfRange,
    UnallocatedHostPage,
    check_chunk,
    check_compatible,
    check_pages,
    host_runs,
)
from kvlife.engine.cpu import CpuCopyEngine, CpuCopyEvent, Gate
from kvlife.engine.cuda import CudaCopyEngine

__all__ = [
    "Ack",
    "Completion",
    "CopyEngine",
    "CopyFault",
    "CpuCopyEngine",
    "CpuCopyEvent",
    "CudaCopyEngine",
    "DevicePageBusy",
    "DrainTimeout",
    "DuplicatePage",
    "EngineClosed",
    "EngineConfigError",
    "EngineError",
    "Gate",
    "HostPageBusy",
    "InvalidTicket",
    "LayoutMismatch",
    "LengthMismatch",
    "PageOutOfRange",
    "UnallocatedHostPage",
    "check_chunk",
    "check_compatible",
    "check_pages",
    "host_runs",
]
