"""A real transformers decoder through kvlife: restored KV gives the logits of a full recompute.

Runs ``examples/transformers_decode.py`` in-process at a small size (the model
is built once per run from a seeded config; nothing is downloaded). Skipped
when the optional ``hf`` extra (transformers) is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvlife.hashing import page_hashes
from kvlife.store.directory import LocalDirectoryStore

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--requests", "4", "--followups", "3", "--max-new-extra", "4", "--layers", "2"]


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example script as a module (examples/ is not a package)."""
    path = ROOT / "examples" / "transformers_decode.py"
    spec = importlib.util.spec_from_file_location("transformers_decode_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run(
    example: ModuleType, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, dict[str, Any]]:
    """Run the example's main with ``--json``; its exit status and its JSON line."""
    status = example.main([*argv, "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    return status, json.loads(lines[-1])


def test_restored_prefixes_decode_to_the_logits_of_a_full_recompute(
    example: ModuleType, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Scenario: fresh requests decode with continuous batching and reused rids; their prompt
    pages (prefill side) and decode pages (kvlife) reach the store; follow-ups restore them."""
    status, r = run(example, capsys, *SMALL, "--store", str(tmp_path))
    assert status == 0, r
    # Continuous batching with a small rid pool: rids and device pages were reused.
    assert r["requests"] == 7 and r["rid_reuses"] > 0 and r["device_page_reuses"] > 0
    # Pages came back from the store, some of them offloaded by an earlier request's decode.
    assert r["restored_decode_pages"] > 0
    assert r["restored_pages"] == r["expected_restored_pages"] > r["restored_decode_pages"]
    assert r["missed_pages"] == 0 and r["misrestored_pages"] == 0
    # Never-stored prefixes restore nothing; nor does an impostor whose pages after the
    # first carry the same tokens as stored pages (the chained keys differ).
    assert r["fresh_restored_pages"] == 0
    assert r["impostors"] == 1 and r["impostor_shared_pages"] > 0
    assert r["impostor_restored_pages"] == 0
    # float32: identical to a forward pass that never saw a cache, within 1e-5.
    assert r["logits_compared"] == r["tokens_generated"] > 0
    assert 0 <= r["max_abs_logit_diff"] <= 1e-5
    assert 0 <= r["max_abs_logit_diff_restored"] <= 1e-5
    # Every page put is in the store with the KV of a full recompute; nothing leaked.
    assert r["store_pages_checked"] > 0 and r["store_pages_wrong"] == 0
    assert r["max_abs_store_diff"] <= 1e-5
    assert r["pages_stored"] == r["pages_offloaded"] > 0
    assert r["releases_wrong"] == 0
    assert r["host_pages_used_at_end"] == 0 and r["device_pages_used_at_end"] == 0

    # Independently of the example's own checks: the directory holds exactly the pages put,
    # each one whole page of [layers, 2, page_size, kv_heads, head_dim] float32.
    store = LocalDirectoryStore(tmp_path, "tiny-llama-s0")
    try:
        keys = set(store.keys())
        assert len(keys) == r["stored_keys"] == r["prefill_pages_put"] + r["pages_offloaded"]
        page_nbytes = 2 * 2 * 8 * 2 * 64 * 4
        assert all(len(store.get(k) or b"") == page_nbytes for k in keys)  # verified whole
    finally:
        store.close()


def test_a_prompt_differing_in_its_first_page_shares_no_key() -> None:
    """Scenario: two prompts share every token but the first; the chain makes every key differ."""
    prompt = list(range(100, 132))
    other = [7, *prompt[1:]]
    keys = page_hashes(prompt, 8, namespace="tiny-llama-s0")
    others = page_hashes(other, 8, namespace="tiny-llama-s0")
    assert other[8:] == prompt[8:]
    assert not set(keys) & set(others)


@pytest.mark.parametrize(
    ("mutant", "caught_by"),
    [
        ("positions", "max_abs_logit_diff"),  # RoPE: the rest decoded from position 0
        ("layout", "misrestored_pages"),  # K and V swapped when a page is unpacked
    ],
)
def test_seeded_integration_bugs_fail_the_run(
    example: ModuleType, capsys: pytest.CaptureFixture[str], mutant: str, caught_by: str
) -> None:
    """Scenario: a runtime restores pages but gets positions or the page layout wrong;
    the comparison with a full recompute catches it and the example exits 1."""
    status, r = run(example, capsys, *SMALL, "--mutant", mutant)
    assert status == 1
    assert r["restored_pages"] > 0
    assert not r[caught_by] <= (1e-5 if caught_by == "max_abs_logit_diff" else 0)


def test_refuses_more_followups_than_requests(example: ModuleType) -> None:
    """Bad sizes stop at argument parsing, before a model is built."""
    with pytest.raises(SystemExit) as exc:
        example.parse_args(["--requests", "2", "--followups", "3"])
    assert exc.value.code == 2
