"""Argument checks shared by the parts that build torch buffers (layouts, the host pool,
the CPU copy engine): each refuses with :class:`~kvlife.errors.ConfigError` naming the
argument, before anything is allocated. One place, so the parts cannot disagree on what a
size, a dtype, a device or a delay is.
"""

from __future__ import annotations

import math
import numbers

import torch

from kvlife.errors import ConfigError

__all__ = ["buffer_spec", "device_of", "finite_seconds", "pin_memory_of", "positive_int"]


def positive_int(name: str, value: object, least: int = 1) -> int:
    """``value`` if it is an int (not a bool) of at least ``least``, else
    :class:`ConfigError` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        what = "a positive int" if least == 1 else f"an int >= {least}"
        raise ConfigError(f"{name} must be {what}, got {value!r}")
    return value


def buffer_spec(dtype: object, **dims: object) -> None:
    """Refuse ``dims`` that are not positive ints or a ``dtype`` that is not a torch.dtype."""
    for name, value in dims.items():
        positive_int(name, value)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")


def device_of(device: object) -> torch.device:
    """``device`` as a torch.device this process can allocate on: a name torch does not
    know, something that is not a device, or a device this machine lacks (a GPU ordinal
    past the last) is refused, torch's own answer the message's tail."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ConfigError(f"device must be a torch.device, a name or an ordinal, got {device!r}")
    try:
        parsed = torch.device(device)
        if parsed.type == "cuda" and torch.cuda.is_available():
            count = torch.cuda.device_count()
            if parsed.index is not None and parsed.index >= count:
                raise RuntimeError(f"this machine has {count} CUDA devices")
        torch.empty(0, device=parsed)  # allocates nothing; fails where the device is missing
    except (RuntimeError, AssertionError, ValueError) as exc:
        raise ConfigError(f"device {device!r} cannot be used here: {exc}") from None
    return parsed


def pin_memory_of(pin_memory: object) -> bool:
    """Whether host pages are pinned: ``None`` means "where CUDA is"; ``True`` needs CUDA."""
    if pin_memory is None:
        return torch.cuda.is_available()
    if not isinstance(pin_memory, bool):
        raise ConfigError(f"pin_memory must be True, False or None, got {pin_memory!r}")
    if pin_memory and not torch.cuda.is_available():
        raise ConfigError(
            "pin_memory=True needs CUDA (pinned pages are for CUDA copies), and this torch "
            "has none: pass pin_memory=False or None"
        )
    return pin_memory


def finite_seconds(name: str, value: object) -> float:
    """``value`` as finite seconds >= 0 (a real number, not a bool), else ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be finite seconds >= 0, got {value!r}")
    try:
        as_float = float(value)
    except OverflowError:  # an int past float's range
        as_float = math.inf
    if not 0.0 <= as_float < math.inf:
        raise ConfigError(f"{name} must be finite seconds >= 0, got {value!r}")
    return as_float
