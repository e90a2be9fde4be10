"""Every script in examples/ runs to exit status 0, as a real subprocess.

Examples are discovered, so a new one is covered without touching this file.
``test_*.py`` files in examples/ are run with pytest. An example declares what
it needs in a comment line near its top, for instance::

    # example-requires: cuda, slow

``cuda`` skips it where torch sees no CUDA device; ``transformers`` skips it
where transformers is not installed (``pip install 'kvlife[hf]'``); ``slow``
runs it only with ``-m slow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
_REQUIRES = re.compile(r"^#\s*example-requires:\s*(.+)$", re.MULTILINE)
KNOWN_NEEDS = {"cuda", "slow", "transformers"}


def _needs(path: Path) -> set[str]:
    head = path.read_text(encoding="utf-8")[:2000]
    found = _REQUIRES.search(head)
    return {n.strip() for n in found.group(1).split(",")} if found else set()


def _params() -> list[object]:
    params: list[object] = []
    for path in EXAMPLES:
        marks = [pytest.mark.slow] if "slow" in _needs(path) else []
        params.append(pytest.param(path, id=path.name, marks=marks))
    return params


def test_examples_exist() -> None:
    assert EXAMPLES, "examples/ holds no scripts"


@pytest.mark.parametrize("path", _params())
def test_example_runs(path: Path) -> None:
    needs = _needs(path)
    assert needs <= KNOWN_NEEDS, f"{path.name} declares unknown needs {needs - KNOWN_NEEDS}"
    if "transformers" in needs:
        pytest.importorskip("transformers")
    if "cuda" in needs:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
    if path.name.startswith("test_"):
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    else:
        command = [sys.executable, str(path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, (
        f"{path.name} exited {done.returncode}\n"
        f"--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    )
