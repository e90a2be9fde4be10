"""The public surface: every name in ``kvlife.__all__`` resolves; the core needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvlife


@pytest.mark.parametrize("name", kvlife.__all__)
def test_every_public_name_resolves(name: str) -> None:
    assert getattr(kvlife, name) is not None


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        kvlife.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018


def test_importing_the_core_does_not_import_torch() -> None:
    code = "import sys, kvlife; kvlife.Lifecycle('r', page_size=1); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_every_error_is_a_kvlife_error() -> None:
    public = [getattr(kvlife, n) for n in kvlife.__all__]
    errors = [e for e in public if isinstance(e, type) and issubclass(e, BaseException)]
    assert len(errors) >= 20 and all(issubclass(e, kvlife.KVLifeError) for e in errors)


def test_kvlife_exports_every_error_in_kvlife_errors() -> None:
    """One place documents the errors (``kvlife.errors``); ``kvlife`` re-exports them all."""
    import kvlife.errors

    assert set(kvlife.errors.__all__) <= set(kvlife.__all__)
