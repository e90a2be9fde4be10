"""Copy engines: device pages to host pages (stores) and back (loads), asynchronously,
one ack per chunk; ``submit`` returns the chunk's completion handle.

:class:`CpuCopyEngine` runs real worker threads over a CPU layout (for tests
and the simulator); :class:`CudaCopyEngine` uses a side stream and
``torch.cuda.Event`` over a CUDA layout. Both follow :class:`CopyEngine`.
"""

from kvlife.engine.base import (
    Ack,
    CopyEngine,
    CopyFault,
    DevicePageBusy,
    DuplicatePage,
    EngineClosed,
    EngineError,
    HostPageBusy,
    InvalidTicket,
    LayoutMismatch,
    LengthMismatch,
    PageOutOfRange,
    UnallocatedHostPage,
    host_runs,
)
from kvlife.engine.cpu import CpuCopyEngine, CpuCopyEvent, Gate
from kvlife.engine.cuda import CudaCopyEngine

__all__ = [
    "Ack",
    "CopyEngine",
    "CopyFault",
    "CpuCopyEngine",
    "CpuCopyEvent",
    "CudaCopyEngine",
    "DevicePageBusy",
    "DuplicatePage",
    "EngineClosed",
    "EngineError",
    "Gate",
    "HostPageBusy",
    "InvalidTicket",
    "LayoutMismatch",
    "LengthMismatch",
    "PageOutOfRange",
    "UnallocatedHostPage",
    "host_runs",
]
