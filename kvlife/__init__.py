"""kvlife: an explicit, checked lifecycle for each request's KV-cache offload."""

from kvlife._lifecycle import (
    TABLE,
    Event,
    FinishReason,
    Lifecycle,
    LifecycleSnapshot,
    State,
    Ticket,
    Transition,
)
from kvlife.errors import (
    AckError,
    DuplicateAck,
    ForeignAck,
    InvalidChunk,
    InvalidEvent,
    InvalidTransition,
    KVLifeError,
    LifecycleError,
    ReleaseCallbackError,
    UnknownChunk,
)

__version__ = "0.1.0"

__all__ = [
    "TABLE",
    "AckError",
    "DuplicateAck",
    "Event",
    "FinishReason",
    "ForeignAck",
    "InvalidChunk",
    "InvalidEvent",
    "InvalidTransition",
    "KVLifeError",
    "Lifecycle",
    "LifecycleError",
    "LifecycleSnapshot",
    "ReleaseCallbackError",
    "State",
    "Ticket",
    "Transition",
    "UnknownChunk",
    "__version__",
]
