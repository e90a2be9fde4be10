"""A returning conversation's second turn on the decode side of a prefill/decode pair, three
ways, and kvlife's share of the decode step time with P/D on.

The pair of examples/pd_decode.py (vLLM's CPU build, NixlConnector on loopback, the
decode side with kvlife through MultiConnector, the tiny random Llama). Each
measurement is a fresh conversation: turn 1 (``--prompt`` tokens) is prefilled on
the prefill instance, pulled over NIXL and decoded (``--turn1``) on the
decode instance, which offloads its blocks to kvlife's host tier; then turn 2 (the
conversation so far and ``--new-tokens`` new ones) is served one of three ways:

- ``kvlife``: straight to the decode instance, vLLM's own prefix cache dropped (as
  other traffic would evict it): the earlier turn's blocks come from kvlife's tier,
  the decode side computes the new tokens;
- ``recompute``: straight to the decode instance with vLLM's prefix cache and
  kvlife's tier dropped: the decode side computes the whole prompt;
- ``remote``: a new remote prefill: the whole prompt prefilled on the prefill
  instance (its prefix cache dropped too), its KV pulled over NIXL.

The time to first token is measured inside the instances, from the request's
arrival to its first token: the decode side's for ``kvlife`` and ``recompute``;
for ``remote`` the prefill instance's time to its one token plus the decode side's
(which waits for the pull), without the proxy's own hops. The three run
interleaved, each round in another order, ``--rounds`` rounds: median, min, max.

kvlife's share: during turn 1 of ``--share-requests`` conversations at once (P/D
on: prompts pulled over NIXL, blocks stored to kvlife as they decode), the seconds
spent inside vLLM's calls into kvlife's manager and worker over the decode
engine's step time, per round; and the copy thread's seconds (it copies beside
the forward, off the step's path) over the same step time.

    python bench/pd_decode.py [--rounds 7]

Needs vLLM's CPU build and NIXL (docs/pd.md). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pd_decode as pd

VARIANTS = ("kvlife", "recompute", "remote")


def summary(values: list[float], scale: float = 1e3) -> dict[str, float]:
    return {
        "median": round(statistics.median(values) * scale, 3),
        "min": round(min(values) * scale, 3),
        "max": round(max(values) * scale, 3),
    }


class Bench:
    def __init__(self, args: argparse.Namespace, work: str) -> None:
        self.args = args
        self.rng = random.Random(0)
        self.n = 0
        models = pd.build_models(work)
        self.p = pd.Instance("prefill", "prefill", models["model"], work)
        self.d = pd.Instance("decode", "decode", models["model"], work, profile=True)

    def conversation(self) -> list[int]:
        return [self.rng.randrange(3, 1024) for _ in range(self.args.prompt)]

    def turn1(self, prompts: list[list[int]]) -> dict[str, dict[str, Any]]:
        reqs = []
        for prompt in prompts:
            self.n += 1
            reqs.append({"id": f"c{self.n}", "prompt": prompt, "max_tokens": self.args.turn1})
        kv = pd.prefill(self.p, reqs)
        out = self.d.call("generate", reqs=[{**r, "kv": kv[r["id"]]} for r in reqs])
        steps = out["step_seconds"]
        return {r["id"]: {**r, **out["results"][r["id"]], "steps": steps} for r in reqs}

    def second_turn(self, variant: str) -> tuple[float, int]:
        """One conversation, its second turn served as ``variant``: (TTFT s, cached)."""
        (first,) = self.turn1([self.conversation()]).values()
        new = [self.rng.randrange(3, 1024) for _ in range(self.args.new_tokens)]
        self.n += 1
        turn2 = {
            "id": f"c{self.n}",
            "prompt": first["prompt"] + first["tokens"] + new,
            "max_tokens": 2,
        }
        if variant == "remote":
            self.d.call("reset_prefix_cache")
            self.p.call("reset_prefix_cache")
            pre = self.p.call(
                "generate", reqs=[{**turn2, "max_tokens": 1, "kv": {"do_remote_decode": True}}]
            )["results"][turn2["id"]]
            got = self.d.call("generate", reqs=[{**turn2, "kv": pre["kv"]}])["results"]
            return pre["ttft"] + got[turn2["id"]]["ttft"], 0
        self.d.call("reset_prefix_cache", reset_connector=variant == "recompute")
        got = self.d.call("generate", reqs=[turn2])["results"][turn2["id"]]
        return got["ttft"], got["cached"]

    def share(self) -> dict[str, float]:
        """kvlife's share of the decode step time over turn 1 of several conversations."""
        self.d.call("reset_prefix_cache")
        self.d.call("kvlife_time")  # zero the counters
        done = self.turn1([self.conversation() for _ in range(self.args.share_requests)])
        steps = sum(next(iter(done.values()))["steps"])
        spent = self.d.call("kvlife_time")
        return {"calls": spent["calls"] / steps, "copies": spent["copies"] / steps, "steps": steps}

    def stop(self) -> dict[str, Any]:
        return {name: inst.stop() for name, inst in (("prefill", self.p), ("decode", self.d))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    # 240 + 40: turn 1's last full block (224-255) holds tokens the decode side decoded.
    parser.add_argument("--prompt", type=int, default=240, help="turn 1 prompt tokens")
    parser.add_argument("--turn1", type=int, default=40, help="tokens decoded in turn 1")
    parser.add_argument("--new-tokens", type=int, default=32, help="turn 2's new tokens")
    parser.add_argument("--share-requests", type=int, default=4)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="kvlife-pd-bench-")
    bench = Bench(args, work)
    try:
        for variant in VARIANTS:  # warm-up: the handshake, first allocations
            bench.second_turn(variant)
        bench.share()
        ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
        cached: dict[str, list[int]] = {v: [] for v in VARIANTS}
        shares: list[dict[str, float]] = []
        for r in range(args.rounds):
            order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]
            for variant in order:
                seconds, hit = bench.second_turn(variant)
                ttft[variant].append(seconds)
                cached[variant].append(hit)
            shares.append(bench.share())
        ends = bench.stop()
    finally:
        for inst in (bench.p, bench.d):
            inst.stop()
        shutil.rmtree(work, ignore_errors=True)
    turn2 = args.prompt + args.turn1 + args.new_tokens

    def per_round(a: str, b: str) -> float:
        return round(statistics.median(x / y for x, y in zip(ttft[a], ttft[b], strict=True)), 3)

    result: dict[str, Any] = {
        "bench": "pd_decode",
        "rounds": args.rounds,
        "turn2_prompt_tokens": turn2,
        "kvlife_cached_tokens": statistics.median(cached["kvlife"]),
        **{f"ttft_ms_{v}": summary(ttft[v]) for v in VARIANTS},
        "kvlife_vs_recompute_per_round": per_round("kvlife", "recompute"),
        "kvlife_vs_remote_per_round": per_round("kvlife", "remote"),
        "kvlife_calls_share_of_step_pct": summary([s["calls"] for s in shares], 100),
        "kvlife_copy_thread_vs_step_pct": summary([s["copies"] for s in shares], 100),
        "share_requests": args.share_requests,
        "exits": {k: v["returncode"] for k, v in ends.items()},
    }
    for v in VARIANTS:
        t = result[f"ttft_ms_{v}"]
        print(f"turn 2 ({turn2} tokens), {v:9s}: TTFT {t['median']} ms [{t['min']}, {t['max']}]")
    share = result["kvlife_calls_share_of_step_pct"]
    print(
        f"kvlife's calls: {share['median']}% of the decode step time "
        f"[{share['min']}, {share['max']}] (P/D on, {args.share_requests} conversations)"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
