"""Copy engines: device pages to host pages (stores) and back (loads), asynchronously,
one ack per chunk; ``submit`` returns the chunk's completion handle.

:class:`CpuCopyEngine` runs real worker threads over a CPU layout (for tests
and the simulator); :class:`CudaCopyEngine` uses a side stream and
``torch.cuda.Event`` over a CUDA layout. Both follow :class:`CopyEngine`.
"""

from kvlife.engine.base import Ack, CopyEngine, host_runs
from kvlife.engine.cpu import CpuCopyEngine, CpuCopyEvent, Gate
from kvlife.engine.cuda import CudaCopyEngine
from kvlife.errors import CopyFault, EngineClosed, EngineError, PageBusy, UnallocatedHostPage

__all__ = [
    "Ack",
    "CopyEngine",
    "CopyFault",
    "CpuCopyEngine",
    "CpuCopyEvent",
    "CudaCopyEngine",
    "EngineClosed",
    "EngineError",
    "Gate",
    "PageBusy",
    "UnallocatedHostPage",
    "host_runs",
]
