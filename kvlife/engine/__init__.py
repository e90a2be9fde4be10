"""Copy engines: device pages to host pages (stores) and back (loads), asynchronously, one
ack per chunk: :class:`CpuCopyEngine` on worker threads (tests, the simulator),
:class:`CudaCopyEngine` on a side stream. Both follow :class:`CopyEngine` (``docs/engines.md``).
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
