"""Loading a runtime by name (``module:factory``) under a deadline: what ``kvlife check
--runtime`` and ``--vllm-manager`` share. Both run the import, and the factory's first
call, on a daemon thread joined with a timeout (see :mod:`kvlife.testing.command`)."""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable
from typing import cast

from kvlife.errors import ConfigError

__all__ = ["RUNTIME_TIMEOUT_S", "load_factory"]

#: Seconds the ``--runtime`` import, and then the factory's first call, may each take.
RUNTIME_TIMEOUT_S = 60.0


def _one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line (a refusal is one line of stderr), cut at ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _describe(exc: BaseException) -> str:
    return _one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _within(seconds: float, call: Callable[[], object], what: str) -> object:
    """``call()`` on a daemon thread joined for ``seconds``: its result, or ConfigError
    saying ``what`` raised (the exception is the ``__cause__``) or did not return."""
    outcome: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # SystemExit too: the runtime's, reported, never ours
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="kvlife-check-runtime", daemon=True)
    thread.start()
    thread.join(seconds)
    if not outcome:
        raise ConfigError(
            f"{what} did not return within {seconds} s (--runtime-timeout): does it wait "
            "for a device, a server or a lock?"
        )
    ok, value = outcome[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise ConfigError(f"{what} raised {_describe(value)}") from value
    return value


def load_factory(spec: str, *, timeout: float = RUNTIME_TIMEOUT_S) -> Callable[[], object]:
    """``"module:factory"`` (``factory`` may be dotted: ``module:Class.method``) -> callable.

    The current directory is searched first, as ``python -m`` does; the import runs under
    ``timeout`` seconds. Refused with :class:`~kvlife.errors.ConfigError` if it cannot
    be imported (it raised, or took too long), or names nothing callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--runtime wants module:factory, got {spec!r}")
    if module_name.startswith("."):
        raise ConfigError(
            f"--runtime {spec}: {module_name!r} is a relative name; give the module's "
            "absolute name (run from the directory that holds it)"
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        what = f"--runtime {spec}: importing {module_name!r}"
        target = _within(timeout, lambda: importlib.import_module(module_name), what)
    except ConfigError as exc:
        if not isinstance(exc.__cause__, ImportError):
            raise
        why = _describe(exc.__cause__)
        raise ConfigError(f"--runtime {spec}: cannot import {module_name!r}: {why}") from None
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except Exception:  # AttributeError, or whatever a module __getattr__ raises
            raise ConfigError(f"--runtime {spec}: {module_name} has no {attr!r}") from None
    if not callable(target):
        raise ConfigError(f"--runtime {spec}: {attr!r} is not callable")
    return cast(Callable[[], object], target)
