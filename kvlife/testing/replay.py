"""Replay files: a counterexample as a versioned JSON file that someone else re-runs.

:func:`save` writes one (the events, shrunk toward the fewest that still break the same
rule, the kit's options, the seed, the kvlife version and the runtime's ``module:factory``);
:func:`load` reads one back, refusing a file of another format version or of another kind
with a typed :class:`ReplayFileError`; :func:`rerun` runs it and says whether it still
fails (``kvlife check --replay FILE``; docs/testing-kit.md, "Replay files").

One format for every kit: a file's ``kind`` says whose events it holds. ``"kit"``: the
kvlife kit's events on a :class:`~kvlife.testing.adapter.RuntimeAdapter` (``kvlife check``,
``run_kit``); ``"vllm-manager"``: vLLM's connector calls on an ``OffloadingManager``
(``kvlife check --vllm-manager``, ``run_manager_kit``), which :mod:`kvlife.testing.vllm`
decodes, shrinks (with :func:`shrink_run`) and re-runs; this module never imports vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

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
from kvlife.testing.loading import _one_line
from kvlife.testing.options import KitOptions
from kvlife.testing.oracle import Oracle
from kvlife.testing.report import format_trace, rule_of

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "KINDS",
    "Replay",
    "ReplayFileError",
    "ReplayKindError",
    "ReplayVersionError",
    "default_dir",
    "event_table",
    "factory_spec",
    "kind_of",
    "load",
    "load_kind",
    "print_rerun",
    "rerun",
    "save",
    "shrink",
    "shrink_run",
]

#: What a replay file says it is.
FORMAT = "kvlife-replay"
#: Bumped whenever events, options or rules change meaning: a file of another version is
#: refused, never misread. 2: every file names its ``kind`` (vLLM manager replays came).
FORMAT_VERSION = 2
#: The kinds of replay file: whose events one holds, and what re-runs it.
KINDS: dict[str, tuple[str, str]] = {
    "kit": (
        "kvlife kit events on a runtime adapter, from kvlife check or run_kit",
        "kvlife check --replay FILE [--runtime MODULE:FACTORY]",
    ),
    "vllm-manager": (
        "vLLM connector calls on an OffloadingManager, from kvlife check --vllm-manager or "
        "run_manager_kit",
        "kvlife check --replay FILE [--vllm-manager MODULE:FACTORY], with vLLM installed",
    ),
}
#: Most replays one shrink may run, and most seconds it may take.
SHRINK_BUDGET = 400
SHRINK_SECONDS = 10.0


class ReplayFileError(ConfigError):
    """A replay file refused: unreadable, not a replay file, or malformed. ``kvlife check
    --replay`` prints its one line and exits 2."""

    def __init__(self, path: str | os.PathLike[str], message: str) -> None:
        super().__init__(f"--replay {path}: {message}")
        self.path = str(path)


class ReplayVersionError(ReplayFileError):
    """A file of another format version than this kvlife reads (``version``, written by
    kvlife ``wrote``): its events may mean other things, so it is refused, never misread."""

    def __init__(self, path: str | os.PathLike[str], version: object, wrote: str) -> None:
        age = "an older" if isinstance(version, int) and version < FORMAT_VERSION else "another"
        super().__init__(
            path,
            f"replay format version {version!r} (written by kvlife {wrote}) is {age} format "
            f"than this kvlife {_kvlife_version()} reads (version {FORMAT_VERSION}); events "
            "and rules may mean other things there, so it is not re-run: run the check that "
            "found it again with this kvlife",
        )
        self.version = version
        self.wrote = wrote


class ReplayKindError(ReplayFileError):
    """A replay of another ``kind`` than the one asked for (kit events for a vLLM manager,
    or the reverse), or of a kind this kvlife does not know."""

    def __init__(
        self, path: str | os.PathLike[str], kind: object, wanted: str | None, why: str = ""
    ) -> None:
        if not isinstance(kind, str) or kind not in KINDS:
            known = ", ".join(KINDS)
            text = f"a replay of kind {kind!r}, which this kvlife does not know ({known})"
        else:
            what, how = KINDS[kind]
            text = f"a {kind} replay ({what}), not a {wanted} one{why}: re-run it with {how}"
        super().__init__(path, text)
        self.kind = kind
        self.wanted = wanted


class _Options(Protocol):
    def as_dict(self) -> dict[str, Any]: ...


E = TypeVar("E", bound="DataclassInstance")
Opt = TypeVar("Opt", bound=_Options)


@dataclass
class Replay(Generic[E, Opt]):
    """One counterexample, as a replay file holds it."""

    events: list[E]
    options: Opt
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
    #: Whose events: a key of :data:`KINDS`.
    kind: str = "kit"

    def as_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {
            "format": FORMAT,
            "version": self.version,
            "kind": self.kind,
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


def event_to_json(event: DataclassInstance) -> dict[str, Any]:
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


def event_table(*classes: type[E]) -> dict[str, type[E]]:
    """Event classes by the ``kind`` their JSON objects carry (the lower-cased class name)."""
    return {cls.__name__.lower(): cls for cls in classes}


_KIT_EVENTS: dict[str, type[KitEvent]] = event_table(
    Start, Step, Finish, Resume, Return, Complete, Poll, Close
)


#: The largest count or index a replay file may hold: no run comes near it, and a file
#: that says more is refused rather than run (an index of 10**30 is a typo or an attack).
_MOST = 2**31 - 1


def _decoded(hint: Any, value: Any) -> Any:
    """``value`` as a field typed ``hint`` holds it; TypeError or ValueError if it cannot:
    an int is a count or an index (0 to :data:`_MOST`, never a bool), a tuple a list."""
    if hint is FinishReason:
        return FinishReason(value)
    if hint in (bool, str):
        if type(value) is not hint:
            raise TypeError(f"{value!r:.40} is not a {hint.__name__}")
        return value
    if hint is int:
        if type(value) is not int or not 0 <= value <= _MOST:
            raise ValueError(f"{value!r:.40} is not a count or index (0 to {_MOST})")
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple and isinstance(value, list):
        return tuple(_decoded(args[0], v) for v in value)
    if origin is typing.Literal and value in args:
        return value
    if type(None) in args and value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        return _decoded(next(a for a in args if a is not type(None)), value)
    raise TypeError(f"{value!r:.40} is not a {hint}")


def event_from_json(data: Any, events: Mapping[str, type[E]]) -> E:
    """The event (of ``events``, by kind) a JSON object names, every field of the type its
    class declares; ConfigError if none, or if a field is of another type or out of range."""
    kind = data.get("kind") if isinstance(data, dict) else None
    if not isinstance(kind, str) or kind not in events:
        raise ConfigError(f"not a replay event here: {data!r:.80}")
    cls = events[kind]
    try:
        hints = typing.get_type_hints(cls)
        kwargs = {
            f.name: _decoded(hints[f.name], data[f.name])
            for f in dataclasses.fields(cls)
            if f.name in data
        }
        event = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"a malformed {kind} event: {exc}") from None
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


def shrink_run(
    events: Sequence[E],
    fails: Callable[[list[E]], bool],
    *,
    last: type[Any],
    budget: int = SHRINK_BUDGET,
    seconds: float = SHRINK_SECONDS,
) -> list[E]:
    """``events`` with as many events left out as possible while ``fails`` (a replay still
    breaks the same rule) holds (greedy: chunks, then single events, until nothing more
    goes; at most ``budget`` replays and ``seconds``). Events of type ``last`` (the kit's
    ``close``, the vLLM kit's ``end``) are never left out: one stays at the end."""
    body: list[E] = [e for e in events if not isinstance(e, last)]
    tail: list[E] = [e for e in events if isinstance(e, last)][-1:]
    runs = 0
    deadline = time.monotonic() + seconds

    def still_fails(candidate: list[E]) -> bool:
        nonlocal runs
        runs += 1
        if time.monotonic() > deadline:
            runs = budget
            return False
        return fails([*candidate, *tail])

    size = max(1, len(body) // 2)
    while size >= 1 and runs < budget:
        start, changed = 0, False
        while start < len(body) and runs < budget:
            candidate = body[:start] + body[start + size :]
            if candidate != body and still_fails(candidate):
                body, changed = candidate, True
            else:
                start += size
        if not changed:
            size //= 2
    return [*body, *tail]


def shrink(
    factory: Callable[[], RuntimeAdapter],
    events: Sequence[KitEvent],
    options: KitOptions,
    rule: str,
    *,
    budget: int = SHRINK_BUDGET,
    seconds: float = SHRINK_SECONDS,
) -> list[KitEvent]:
    """The kit's ``events`` shrunk (:func:`shrink_run`) while a replay on ``factory``'s
    adapter still breaks ``rule``. A final ``close`` stays."""

    def fails(candidate: list[KitEvent]) -> bool:
        found = _failure(factory, candidate, options)
        return found is not None and found[0] == rule

    return shrink_run(events, fails, last=Close, budget=budget, seconds=seconds)


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
    replay: Replay[Any, Any],
    factory: Callable[[], RuntimeAdapter] | None = None,
    *,
    directory: str | os.PathLike[str] | None = None,
    shrunk: bool = True,
) -> Path:
    """Shrink a kit ``replay`` (with ``factory``, unless ``shrunk`` is False or no factory;
    other kinds come shrunk) and write it as ``<directory>/kvlife-<source>-<rule>-<n>.json``
    (``kvlife-<kind>-<source>-...`` for a kind other than ``kit``); its path."""
    if shrunk and factory is not None and replay.kind == "kit":
        replay.events = shrink(factory, replay.events, replay.options, replay.rule)
    folder = Path(directory) if directory is not None else default_dir()
    folder.mkdir(parents=True, exist_ok=True)
    kind = "" if replay.kind == "kit" else f"{replay.kind}-"
    stem = f"kvlife-{kind}{replay.source}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', replay.rule)}"
    n = 0
    while (path := folder / f"{stem}-{n}.json").exists():
        n += 1
    path.write_text(json.dumps(replay.as_dict(), indent=1) + "\n", encoding="utf-8")
    return path


#: The types of a replay file's fields that are read back (the rest are only shown).
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "options": dict,
    "events": list,
    "runtime": (str, type(None)),
    "config": (dict, type(None)),
    "seed": (int, type(None)),
}


def _read(path: str | os.PathLike[str], kind: str | None) -> dict[str, Any]:
    """The file's JSON object, once its format, version and kind (``kind``, if given; else
    any this kvlife knows) are this kvlife's."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON's, digits' limit
        raise ReplayFileError(path, f"cannot read it: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ReplayFileError(path, f"not a kvlife replay file (no format {FORMAT!r})")
    version = data.get("version")
    if version != FORMAT_VERSION:
        raise ReplayVersionError(path, version, str(data.get("kvlife", "an unknown kvlife")))
    found = data.get("kind")
    if not isinstance(found, str) or found not in KINDS or (kind is not None and found != kind):
        raise ReplayKindError(path, found, kind)
    return data


def kind_of(path: str | os.PathLike[str]) -> str:
    """The kind of replay a file holds (a key of :data:`KINDS`); refused as :func:`load`
    refuses it (:class:`ReplayFileError`, :class:`ReplayVersionError`,
    :class:`ReplayKindError`)."""
    return str(_read(path, None)["kind"])


def load(path: str | os.PathLike[str]) -> Replay[KitEvent, KitOptions]:
    """The kit replay a file holds (:func:`load_kind` of ``"kit"``)."""
    return load_kind(path, "kit", _KIT_EVENTS, KitOptions)


def load_kind(
    path: str | os.PathLike[str],
    kind: str,
    events: Mapping[str, type[E]],
    options: Callable[..., Opt],
) -> Replay[E, Opt]:
    """The replay a file of ``kind`` holds, its events of ``events`` (by kind) and its
    options ``options(**dict)``. A file of another format, version or kind is refused
    with a :class:`ReplayFileError` (a ``ConfigError``) naming what it is and what this
    kvlife reads."""
    data = _read(path, kind)
    try:
        for name, types_ in _FIELDS.items():
            if not isinstance(data.get(name), types_):
                raise TypeError(f"{name} is {data.get(name)!r:.40}")
        made = options(**data["options"])
        decoded = [event_from_json(e, events) for e in data["events"]]
    except (KeyError, TypeError, ValueError, ConfigError) as exc:
        raise ReplayFileError(path, f"a malformed replay file: {exc}") from None
    return Replay(
        decoded,
        made,
        str(data.get("rule", "")),
        str(data.get("message", "")),
        runtime=data.get("runtime"),
        config=data.get("config"),
        seed=data.get("seed"),
        source=str(data.get("source", "check")),
        kvlife=str(data.get("kvlife", "")),
        version=FORMAT_VERSION,
        kind=kind,
    )


def rerun(
    replay: Replay[KitEvent, KitOptions], factory: Callable[[], RuntimeAdapter]
) -> tuple[str, str] | None:
    """Run ``replay`` exactly on a fresh adapter from ``factory``: (rule, message) of what
    it breaks now, or None if it passes."""
    return _failure(factory, replay.events, replay.options)


def print_rerun(
    path: str,
    replay: Replay[Any, Any],
    on: str,
    found: tuple[str, str] | None,
    *,
    json_out: bool,
    trace: Sequence[str] | None = None,
) -> int:
    """``kvlife check --replay``'s report of one re-run of ``replay`` on ``on`` (what ran
    it): the file, the run (``trace``, else its events) and whether it still fails
    (``found``: the rule and message it broke now). Its exit status: 1 if it fails, 0."""
    if json_out:
        out = {"file": path, "kind": replay.kind, "fails": found is not None}
        out |= {"rule": found and found[0], "recorded_rule": replay.rule}
        print(json.dumps({**out, "events": len(replay.events)}))
    else:
        print(
            f"kvlife check --replay {path}: {len(replay.events)} events on {on} "
            f"(written by kvlife {replay.kvlife}, {replay.source}; it broke {replay.rule})"
        )
        print(format_trace(list(trace) if trace is not None else [str(e) for e in replay.events]))
        if found is None:
            print("PASSES now: the runtime keeps every rule on this run")
        else:
            same = "the same rule" if found[0] == replay.rule else f"not {replay.rule}"
            print(f"STILL FAILS ({same}): {_one_line(found[1], 400)}")
    return 0 if found is None else 1
