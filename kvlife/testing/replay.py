"""Replay files: a counterexample as a versioned JSON file that someone else re-runs.

:func:`save` writes one (the events, shrunk toward the fewest that still break the same
rule, the kit's options, the seed, the kvlife version and the runtime's ``module:factory``);
:func:`load` reads one back, refusing a file of another format version with a clear
:class:`~kvlife.errors.ConfigError`; :func:`rerun` runs it and says whether it still fails
(``kvlife check --replay FILE``; docs/testing-kit.md, "Replay files").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlife._lifecycle import FinishReason
from kvlife.errors import ConfigError
from kvlife.testing.adapter import RuntimeAdapter
from kvlife.testing.events import (
    Close,
    Complete,
    Finish,
    KitEvent,
    Poll,
    Resume,
    Return,
    Start,
    Step,
)
from kvlife.testing.options import KitOptions
from kvlife.testing.oracle import Oracle
from kvlife.testing.report import rule_of

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "Replay",
    "default_dir",
    "factory_spec",
    "load",
    "rerun",
    "save",
    "shrink",
]

#: What a replay file says it is.
FORMAT = "kvlife-replay"
#: Bumped whenever events, options or rules change meaning: a file of another version is
#: refused, never misread.
FORMAT_VERSION = 1
#: Most replays one shrink may run, and most seconds it may take.
SHRINK_BUDGET = 400
SHRINK_SECONDS = 10.0


@dataclass
class Replay:
    """One counterexample, as a replay file holds it."""

    events: list[KitEvent]
    options: KitOptions
    rule: str
    message: str = ""
    #: ``module:factory`` of the runtime; ``None``: kvlife's manager sized by ``config``.
    runtime: str | None = None
    #: The ``kvlife check`` bounds it came from (``CheckConfig.as_dict()``), if any.
    config: dict[str, Any] | None = None
    seed: int | None = None
    #: Who found it: ``"check"``, ``"kit"``.
    source: str = "check"
    kvlife: str = ""
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {
            "format": FORMAT,
            "version": self.version,
            "kvlife": self.kvlife or _kvlife_version(),
            "source": self.source,
            "runtime": self.runtime,
            "config": self.config,
            "options": self.options.as_dict(),
            "seed": self.seed,
            "rule": self.rule,
            "message": self.message,
            "events": [event_to_json(e) for e in self.events],
            "trace": [str(e) for e in self.events],
            **self.extra,
        }


def _kvlife_version() -> str:
    from kvlife import __version__

    return __version__


def event_to_json(event: KitEvent) -> dict[str, Any]:
    """One event as a JSON object: its kind and its fields."""
    data: dict[str, Any] = {"kind": type(event).__name__.lower()}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if isinstance(value, FinishReason):
            value = value.value
        elif isinstance(value, tuple):
            value = list(value)
        data[f.name] = value
    return data


_EVENTS = (Start, Step, Finish, Resume, Return, Complete, Poll, Close)
_KINDS: dict[str, type[Any]] = {cls.__name__.lower(): cls for cls in _EVENTS}


def event_from_json(data: Any) -> KitEvent:
    """The event a JSON object names; ConfigError if it names none."""
    if not isinstance(data, dict) or data.get("kind") not in _KINDS:
        raise ConfigError(f"not a kit event: {data!r:.80}")
    cls = _KINDS[data["kind"]]
    kwargs: dict[str, Any] = {}
    try:
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name == "reason":
                value = FinishReason(value)
            elif isinstance(value, list):
                value = tuple(int(v) for v in value)
            kwargs[f.name] = value
        event: KitEvent = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a malformed {data['kind']} event: {exc}") from None
    return event


def factory_spec(factory: Callable[..., object]) -> str | None:
    """``module:qualname`` of ``factory`` if that imports back to it, else ``None``."""
    module = getattr(factory, "__module__", None)
    name = getattr(factory, "__qualname__", None)
    if not module or not name or "<" in name:
        return None
    return f"{module}:{name}"


def default_dir() -> Path:
    """Where replay files go unless told: ``$KVLIFE_REPLAY_DIR``, else ``kvlife-replays``
    in the temporary directory."""
    chosen = os.environ.get("KVLIFE_REPLAY_DIR")
    return Path(chosen) if chosen else Path(tempfile.gettempdir()) / "kvlife-replays"


def shrink(
    factory: Callable[[], RuntimeAdapter],
    events: Sequence[KitEvent],
    options: KitOptions,
    rule: str,
    *,
    budget: int = SHRINK_BUDGET,
    seconds: float = SHRINK_SECONDS,
) -> list[KitEvent]:
    """``events`` with as many events left out as possible while a replay still breaks
    ``rule`` (greedy: chunks, then single events, until nothing more goes; at most
    ``budget`` replays and ``seconds``). A final ``close`` stays."""
    body: list[KitEvent] = [e for e in events if not isinstance(e, Close)]
    closed = len(body) < len(events)
    runs = 0
    deadline = time.monotonic() + seconds

    def fails(candidate: list[KitEvent]) -> bool:
        nonlocal runs
        runs += 1
        if time.monotonic() > deadline:
            runs = budget
            return False
        found = _failure(factory, [*candidate, *([Close()] if closed else [])], options)
        return found is not None and found[0] == rule

    size = max(1, len(body) // 2)
    while size >= 1 and runs < budget:
        start, changed = 0, False
        while start < len(body) and runs < budget:
            candidate = body[:start] + body[start + size :]
            if candidate != body and fails(candidate):
                body, changed = candidate, True
            else:
                start += size
        if not changed:
            size //= 2
    return [*body, *([Close()] if closed else [])]


def _failure(
    factory: Callable[[], RuntimeAdapter], events: Sequence[KitEvent], options: KitOptions
) -> tuple[str, str] | None:
    """Replay ``events`` on a fresh adapter: (rule, message) of what it broke, or None."""
    try:
        oracle = Oracle(factory(), options)
        oracle.run(events)
    except Exception as exc:
        return rule_of(exc), str(exc)
    return None


def save(
    replay: Replay,
    factory: Callable[[], RuntimeAdapter] | None = None,
    *,
    directory: str | os.PathLike[str] | None = None,
    shrunk: bool = True,
) -> Path:
    """Shrink ``replay`` (with ``factory``, unless ``shrunk`` is False or no factory) and
    write it as ``<directory>/kvlife-<source>-<rule>-<n>.json``; its path."""
    if shrunk and factory is not None:
        replay.events = shrink(factory, replay.events, replay.options, replay.rule)
    folder = Path(directory) if directory is not None else default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"kvlife-{replay.source}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', replay.rule)}"
    n = 0
    while (path := folder / f"{stem}-{n}.json").exists():
        n += 1
    path.write_text(json.dumps(replay.as_dict(), indent=1) + "\n", encoding="utf-8")
    return path


def load(path: str | os.PathLike[str]) -> Replay:
    """The replay a file holds. A file of another format or version is refused with a
    :class:`~kvlife.errors.ConfigError` naming what it is and what this kvlife reads."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--replay {path}: cannot read it: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"--replay {path}: not a kvlife replay file (no format {FORMAT!r})")
    version = data.get("version")
    if version != FORMAT_VERSION:
        wrote = data.get("kvlife", "an unknown kvlife")
        age = "an older" if isinstance(version, int) and version < FORMAT_VERSION else "another"
        raise ConfigError(
            f"--replay {path}: replay format version {version!r} (written by kvlife {wrote}) "
            f"is {age} format than this kvlife {_kvlife_version()} reads (version "
            f"{FORMAT_VERSION}); events and rules may mean other things there, so it is not "
            "re-run: run the check that found it again with this kvlife"
        )
    try:
        options = KitOptions(**data["options"])
        events = [event_from_json(e) for e in data["events"]]
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"--replay {path}: a malformed replay file: {exc}") from None
    return Replay(
        events,
        options,
        str(data.get("rule", "")),
        str(data.get("message", "")),
        runtime=data.get("runtime"),
        config=data.get("config"),
        seed=data.get("seed"),
        source=str(data.get("source", "check")),
        kvlife=str(data.get("kvlife", "")),
        version=version,
    )


def rerun(replay: Replay, factory: Callable[[], RuntimeAdapter]) -> tuple[str, str] | None:
    """Run ``replay`` exactly on a fresh adapter from ``factory``: (rule, message) of what
    it breaks now, or None if it passes."""
    return _failure(factory, replay.events, replay.options)
