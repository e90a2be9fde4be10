"""A real transformers decoder through kvlife: restored KV gives the logits of a full recompute.

The harness here drives ``examples/transformers_decode.py``'s runtime (its model, device
pages, manager calls and restore) with continuous batching, a small rid pool, a prefill
side that puts each prompt's whole pages, and later requests that continue, partly share
or impersonate earlier conversations. Every request's logits are compared with one
forward pass over its whole sequence that never saw a cache; every restored and every
stored page with the KV of that pass. Two seeded integration bugs (``--mutant``) must
fail the run. Skipped when the optional ``hf`` extra (transformers) is not installed.

At any size, as a script: ``python tests/test_transformers_decode.py [--json] [sizes]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import pytest

from kvlife import Ticket
from kvlife.hashing import page_hashes
from kvlife.store.directory import LocalDirectoryStore

pytest.importorskip("transformers")

import torch
import transformers
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--requests", "4", "--followups", "3", "--max-new-extra", "4", "--layers", "2"]
TOLERANCE = 1e-5  # float32: restored KV must give the logits of a full recompute


def _load_example() -> ModuleType:
    """The example script as a module (examples/ is not a package)."""
    path = ROOT / "examples" / "transformers_decode.py"
    spec = importlib.util.spec_from_file_location("transformers_decode_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ex = _load_example()


# ----------------------------------------------------------------------------- requests


@dataclass(eq=False)
class Case(ex.Request):  # type: ignore[misc,name-defined]
    """A request with what the checks need to know about it."""

    name: str = ""
    kind: str = "fresh"  # fresh | followup | partial | impostor
    arrival: int = 0
    parent: Case | None = None
    logits: list[torch.Tensor] = field(default_factory=list)  # one per output token
    expected_pages: int = 0  # leading prompt pages someone put before this request came
    restored_rows: torch.Tensor | None = None
    put_keys: dict[str, int] = field(default_factory=dict)  # key -> page index
    done: bool = False
    releases: int = 0
    released_pages: list[int] = field(default_factory=list)

    @property
    def outputs(self) -> int:
        """Tokens generated so far."""
        return len(self.tokens) - len(self.prompt)


def workload(args: argparse.Namespace) -> list[Case]:
    """Fresh requests, then follow-ups, partial follow-ups and impostors of some of them."""
    rng = random.Random(args.seed)
    p = args.page_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.vocab) for _ in range(n)]

    def new_tokens() -> int:
        return rng.randint(args.stride + p, args.stride + p + args.max_new_extra)

    fresh = [
        Case(tokens(rng.randint(2 * p, 4 * p + p // 2)), new_tokens(), name=f"q{i}", arrival=i // 2)
        for i in range(args.requests)
    ]
    later: list[Case] = []
    for i, parent in enumerate(fresh[: args.followups]):
        # prompt = parent's prompt and output + new tokens; built when the parent is done.
        kind = ("followup", "partial", "impostor")[i % 3]
        later.append(Case([], new_tokens(), name=f"{parent.name}.{kind}", kind=kind, parent=parent))
    return fresh + later


def followup_prompt(req: Case, rng: random.Random, vocab: int, page_size: int) -> list[int]:
    """The prompt of a later request, from its parent's final tokens."""
    assert req.parent is not None
    history = list(req.parent.tokens)
    extra = [rng.randrange(vocab) for _ in range(rng.randint(1, page_size + 3))]
    if req.kind == "partial":  # shares whole pages, then diverges in the middle of a page
        cut = (len(history) // page_size - 1) * page_size + page_size // 2
        return history[:cut] + extra
    if req.kind == "impostor":  # every token but the first is shared
        return [(history[0] + 1) % vocab, *history[1:], *extra]
    return history + extra


def expected_restore(prompt: list[int], put_prefixes: set[tuple[int, ...]], page_size: int) -> int:
    """Leading whole pages whose token prefix was put (the last prompt token is computed)."""
    n = 0
    while n < (len(prompt) - 1) // page_size and (
        tuple(prompt[: (n + 1) * page_size]) in put_prefixes
    ):
        n += 1
    return n


# ----------------------------------------------------------------------------- the harness


class Harness(ex.Runtime):  # type: ignore[misc,name-defined]
    """The example's runtime, plus a prefill side, the workload's admission rules, the
    records the checks read, NaN poison on released device pages, and the seeded bugs."""

    def __init__(self, args: argparse.Namespace, model: Any, root: str) -> None:
        super().__init__(
            model, root, page_size=args.page_size, stride=args.stride,
            device_pages=args.device_pages, host_pages=args.host_pages,
            max_batch=args.max_batch, seed=args.seed,
        )  # fmt: skip
        self.args = args
        self.layers: int = model.config.num_hidden_layers
        # The prefill side is another writer on the same directory (its own results).
        self.prefill_store = LocalDirectoryStore(root, self.namespace)
        self.rng = random.Random(args.seed + 1)
        self.rid_uses: dict[str, int] = {}
        self.put_prefixes: set[tuple[int, ...]] = set()  # token prefixes anyone put in the store
        self.used_before: set[int] = set()
        self.device_page_reuses = 0  # allocations of a page another request held before
        self.prefill_pages = 0
        self.prefill_store_failures = 0
        self.impostor_shared_pages = 0
        self.deadline = time.monotonic() + args.time_limit

    def admissible(self, req: Case) -> bool:
        """A later request arrives once its parent is done and the parent's pages are stored."""
        if time.monotonic() > self.deadline:
            raise RuntimeError(f"no progress within {self.args.time_limit} s")
        self.prefill_store_failures += sum(not r.ok for r in self.prefill_store.poll())
        p, parent = self.page_size, req.parent
        if parent is None:
            ready, prompt_len = req.arrival <= self.steps, len(req.prompt)
        else:
            ready = parent.done and all(self.store.contains(k) for k in parent.put_keys)
            prompt_len = len(parent.tokens) + p + 3  # an upper bound before it is built
        return ready and len(self.free_pages) >= -(-(prompt_len + req.max_new) // p)

    def admit(self, req: Case) -> None:
        p = self.page_size
        if req.parent is not None:
            req.prompt = followup_prompt(req, self.rng, self.args.vocab, p)
        prompt = req.prompt
        keys = page_hashes(prompt[: len(prompt) // p * p], p, namespace=self.namespace)
        req.expected_pages = expected_restore(prompt, self.put_prefixes, p)
        if req.kind == "impostor":  # pages with the parent's tokens whose keys are not stored
            assert req.parent is not None
            self.impostor_shared_pages += sum(
                prompt[i * p : (i + 1) * p] == req.parent.tokens[i * p : (i + 1) * p]
                and not self.store.contains(key)
                for i, key in enumerate(keys)
            )
        super().admit(req)
        self.rid_uses[req.rid] = self.rid_uses.get(req.rid, 0) + 1
        self.device_page_reuses += sum(d in self.used_before for d in req.page_table)
        self.used_before.update(req.page_table)
        if req.restored:  # what the model read, for the check: the device pages after the restore
            req.restored_rows = torch.stack(
                [self.layout.read_page(d) for d in req.page_table[: req.restored]]
            )
        self.prefill_side_store(req, keys)

    def prefill_side_store(self, req: Case, keys: list[str]) -> None:
        """What a prefill server does: put the prompt's whole pages not yet stored."""
        p = self.page_size
        todo = [i for i, key in enumerate(keys) if not self.prefill_store.contains(key)]
        for i, key in enumerate(keys):
            req.put_keys[key] = i
            self.put_prefixes.add(tuple(req.prompt[: (i + 1) * p]))
        if not todo:
            return
        rows = torch.empty((len(todo), self.layout.page_numel), dtype=torch.float32)
        self.layout.gather(self.layout.page_index([req.page_table[i] for i in todo]), rows)
        self.prefill_store.put(req.name, [keys[i] for i in todo], rows)
        self.prefill_pages += len(todo)

    def read_prefix(self, keys: Sequence[str]) -> torch.Tensor:
        rows: torch.Tensor = super().read_prefix(keys)
        if self.args.mutant == "layout" and len(rows):  # a page-layout mistake: K and V swapped
            rows = rows.view(len(rows), self.layers, 2, -1).flip(2).reshape(len(rows), -1)
        return rows

    def compute(self, req: Case, start: int) -> torch.Tensor:
        if self.args.mutant == "positions" and len(req.tokens) == len(req.prompt):
            # RoPE mistake: the rest of a restored prompt decoded from position 0.
            forward = ex.forward
            with mock.patch.object(ex, "forward", lambda m, t, _s, c: forward(m, t, 0, c)):
                logits: torch.Tensor = super().compute(req, start)
        else:
            logits = super().compute(req, start)
        req.logits.append(logits.clone())
        if req.outputs >= req.max_new:
            req.done = True  # the loop finishes it in this step, before the next admission
        return logits

    def offload(self, req: Case) -> Ticket | None:
        """Submit what is due; remember which token prefixes went to the store."""
        ticket: Ticket | None = super().offload(req)
        if ticket is None:
            return None
        p = self.page_size
        first = req.record.prefill_len // p + ticket[3]  # first_page counts after prefill
        for j, key in enumerate(ticket[2]):
            page = first + j
            req.put_keys[key] = page
            self.put_prefixes.add(tuple(req.tokens[: (page + 1) * p]))
        return ticket

    def release(self, req: Case, device_pages: Sequence[int]) -> None:
        """Count the release; poison the pages with NaN: a copy that read them later would show."""
        req.releases += 1
        req.released_pages = list(device_pages)
        p = self.page_size
        slots = torch.tensor([d * p + i for d in device_pages for i in range(p)])
        for buffer in self.layout.buffers():
            buffer.index_fill_(0, slots, float("nan"))
        super().release(req, device_pages)

    def drain(self) -> None:
        """Every copy and store write done, the decode side's and the prefill side's."""
        self.manager.close()
        self.prefill_store_failures += sum(not r.ok for r in self.prefill_store.drain())

    def close(self) -> None:
        super().close()
        self.prefill_store.close()


# ----------------------------------------------------------------------------- checking


def reference_page(cache: Any, layers: int, page: int, page_size: int) -> torch.Tensor:
    """Page ``page`` as a flat host page ``[layers, 2, page_size, kv_heads, head_dim]``."""
    lo, hi = page * page_size, (page + 1) * page_size
    parts = []
    for layer in range(layers):
        keys, values = ex.layer_kv(cache, layer)
        parts.append(keys[0, :, lo:hi].permute(1, 0, 2).reshape(-1))
        parts.append(values[0, :, lo:hi].permute(1, 0, 2).reshape(-1))
    return torch.cat(parts)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference; NaN anywhere gives NaN (so it never passes a check)."""
    return float((a - b).abs().max())


def worst(a: float, b: float) -> float:
    """The larger of two differences; NaN wins (it never passes a check)."""
    return b if b != b or not a >= b else a


def within(value: float) -> bool:
    """True when ``value`` <= TOLERANCE (False for NaN)."""
    return value <= TOLERANCE


@dataclass
class Check:
    """Figures from comparing the served run with full recomputes."""

    max_abs_logit_diff: float = 0.0
    max_abs_logit_diff_restored: float = 0.0
    logits_compared: int = 0
    restored_pages: int = 0
    restored_decode_pages: int = 0
    expected_restored_pages: int = 0
    misrestored_pages: int = 0
    impostor_restored_pages: int = 0
    store_pages_checked: int = 0
    store_pages_wrong: int = 0
    max_abs_store_diff: float = 0.0
    releases_wrong: int = 0


def check(runtime: Harness, requests: list[Case]) -> Check:
    """Recompute every request from scratch and compare logits, restored pages and stored pages."""
    c = Check()
    p = runtime.page_size
    for req in requests:
        c.releases_wrong += req.releases != 1 or req.released_pages != req.page_table
        cache = DynamicCache()
        ref = ex.forward(runtime.model, req.tokens[:-1], 0, cache)  # no cache, no offload
        first = len(req.prompt) - 1
        for j, served in enumerate(req.logits):
            diff = max_diff(served, ref[first + j])
            c.max_abs_logit_diff = worst(c.max_abs_logit_diff, diff)
            if req.restored:
                c.max_abs_logit_diff_restored = worst(c.max_abs_logit_diff_restored, diff)
            c.logits_compared += 1
        c.restored_pages += req.restored
        c.expected_restored_pages += req.expected_pages
        if req.kind == "impostor":
            c.impostor_restored_pages += req.restored
        for i in range(req.restored):
            assert req.restored_rows is not None
            # Restored pages form a leading run, as do the expected ones: page i belongs
            # to this prompt only if every prefix up to it was put before the request came.
            right = i < req.expected_pages and within(
                max_diff(req.restored_rows[i], reference_page(cache, runtime.layers, i, p))
            )
            c.misrestored_pages += not right
            parent = req.parent
            if parent is not None and i >= len(parent.prompt) // p:
                c.restored_decode_pages += 1  # offloaded by the parent's decode
        for key, page in req.put_keys.items():
            if (page + 1) * p > len(req.tokens) - 1:
                continue
            data = runtime.store.get(key)
            c.store_pages_checked += 1
            if data is None:
                c.store_pages_wrong += 1
                continue
            stored = torch.frombuffer(bytearray(data), dtype=torch.float32)
            diff = max_diff(stored, reference_page(cache, runtime.layers, page, p))
            c.max_abs_store_diff = worst(c.max_abs_store_diff, diff)
            c.store_pages_wrong += not within(diff)
    return c


# ----------------------------------------------------------------------------- a run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Sizes and switches."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=6, help="fresh requests")
    ap.add_argument("--followups", type=int, default=4, help="later requests on earlier ones")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=8, help="tokens per page")
    ap.add_argument("--stride", type=int, default=16, help="decode offload stride in tokens")
    ap.add_argument("--max-new-extra", type=int, default=16, help="output length spread")
    ap.add_argument("--max-batch", type=int, default=3, help="running requests (= rid pool)")
    ap.add_argument("--device-pages", type=int, default=96)
    ap.add_argument("--host-pages", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", default=None, help="store root (default: a temporary directory)")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds before giving up")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument(
        "--mutant",
        choices=["positions", "layout"],
        default=None,
        help="seed an integration bug the checks must catch: restored prefix decoded from "
        "position 0, or restored pages with K and V swapped (exit status 1 expected)",
    )
    args = ap.parse_args(argv)
    if args.followups > args.requests:
        ap.error("--followups must not exceed --requests")
    args.vocab = 512  # the example's model
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Serve, recompute, compare; exit 1 when a page misrestored or logits differ."""
    args = parse_args(argv)
    torch.set_num_threads(2)
    began = time.perf_counter()
    model = ex.build_model(args.layers, args.seed)
    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="kvlife-hf-") as tmp:
        runtime = Harness(args, model, args.store or tmp)
        try:
            runtime.run(requests)
            runtime.drain()
            served = time.perf_counter() - began
            c = check(runtime, requests)
            metrics = runtime.manager.metrics()
            stored_keys = len(list(runtime.store.keys()))
        finally:
            runtime.close()
    report: dict[str, Any] = {
        "requests": len(requests),
        "followups": sum(r.parent is not None and r.kind != "impostor" for r in requests),
        "impostors": sum(r.kind == "impostor" for r in requests),
        "steps": runtime.steps,
        "tokens_generated": sum(r.outputs for r in requests),
        "restored_pages": c.restored_pages,
        "restored_decode_pages": c.restored_decode_pages,
        "expected_restored_pages": c.expected_restored_pages,
        "missed_pages": c.expected_restored_pages - c.restored_pages,
        "misrestored_pages": c.misrestored_pages,
        "impostor_restored_pages": c.impostor_restored_pages,
        "impostor_shared_pages": runtime.impostor_shared_pages,
        "fresh_restored_pages": sum(r.restored for r in requests if r.parent is None),
        "max_abs_logit_diff": c.max_abs_logit_diff,
        "max_abs_logit_diff_restored": c.max_abs_logit_diff_restored,
        "logits_compared": c.logits_compared,
        "store_pages_checked": c.store_pages_checked,
        "store_pages_wrong": c.store_pages_wrong,
        "max_abs_store_diff": c.max_abs_store_diff,
        "stored_keys": stored_keys,
        "prefill_pages_put": runtime.prefill_pages,
        "chunks_submitted": metrics.chunks_submitted,
        "pages_offloaded": metrics.pages_offloaded,
        "pages_stored": metrics.pages_stored,
        "copy_failures": metrics.copy_failures,
        "store_failures": metrics.store_failures,
        "prefill_store_failures": runtime.prefill_store_failures,
        "releases_wrong": c.releases_wrong,
        "rid_reuses": sum(n - 1 for n in runtime.rid_uses.values()),
        "device_page_reuses": runtime.device_page_reuses,
        "host_pages_used_at_end": runtime.host.num_used,
        "device_pages_used_at_end": args.device_pages - len(runtime.free_pages),
        "transformers": transformers.__version__,
        "seconds_serving": round(served, 2),
    }
    failures = []
    if (
        report["misrestored_pages"]
        or report["impostor_restored_pages"]
        or report["fresh_restored_pages"]
    ):
        failures.append("pages restored that do not belong to the prompt")
    if not within(c.max_abs_logit_diff):
        failures.append(f"logits differ by {c.max_abs_logit_diff} > {TOLERANCE}")
    if report["store_pages_wrong"]:
        failures.append("stored pages missing or wrong")
    if (
        report["releases_wrong"]
        or report["host_pages_used_at_end"]
        or report["device_pages_used_at_end"]
    ):
        failures.append("device or host pages not given back exactly once")
    if report["followups"] and not report["restored_decode_pages"]:
        failures.append("no page offloaded by decode was ever restored")
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
        print("OK" if not failures else "FAILED: " + "; ".join(failures))
    return 1 if failures else 0


# ----------------------------------------------------------------------------- the tests


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    """Run the harness with ``--json``; its exit status and its JSON line."""
    status = main([*argv, "--json"])
    lines = capsys.readouterr().out.strip().splitlines()
    return status, json.loads(lines[-1])


def test_restored_prefixes_decode_to_the_logits_of_a_full_recompute(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Scenario: fresh requests decode with continuous batching and reused rids; their prompt
    pages (prefill side) and decode pages (kvlife) reach the store; follow-ups restore them."""
    status, r = run(capsys, *SMALL, "--store", str(tmp_path))
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

    # Independently of the harness's own checks: the directory holds exactly the pages put,
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
    capsys: pytest.CaptureFixture[str], mutant: str, caught_by: str
) -> None:
    """Scenario: a runtime restores pages but gets positions or the page layout wrong;
    the comparison with a full recompute catches it and the run exits 1."""
    status, r = run(capsys, *SMALL, "--mutant", mutant)
    assert status == 1
    assert r["restored_pages"] > 0
    assert not r[caught_by] <= (1e-5 if caught_by == "max_abs_logit_diff" else 0)


def test_refuses_more_followups_than_requests() -> None:
    """Bad sizes stop at argument parsing, before a model is built."""
    with pytest.raises(SystemExit) as exc:
        parse_args(["--requests", "2", "--followups", "3"])
    assert exc.value.code == 2


if __name__ == "__main__":
    sys.exit(main())
