"""``kvlife simulate``: run the decode-runtime simulator and prove no page was lost or misfiled."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, replace
from typing import Any

from kvlife.sim.runtime import DTYPES, LAYOUTS, STORES, SimConfig, SimReport, run_simulation
from kvlife.store.mooncake import ENV_MASTER, ENV_METADATA

__all__ = ["register"]


def _pair(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH integers, got {text!r}") from None
    if not 0 < pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 0 < LOW <= HIGH, got {text!r}")
    return pair


def _world_size(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a world size is at least 1, got {value}")
    return value


def _delays(text: str) -> list[float]:
    try:
        delays = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D0,D1,... seconds, got {text!r}") from None
    if not all(d >= 0 for d in delays):
        raise argparse.ArgumentTypeError(f"copy delays are >= 0 seconds, got {text!r}")
    return delays


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a rate is in [0, 1], got {text}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``simulate`` to the ``kvlife`` command."""
    p = subparsers.add_parser(
        "simulate",
        help="run a simulated decode runtime on the CPU and verify every stored page",
        description=(
            "Decode requests through kvlife with real parts (torch KV pool, threaded copy "
            "engine, a directory or Mooncake store), then re-derive every stored page from its "
            "key and account for every device and host page. Exit 1 on any corruption, leak or "
            "violated invariant."
        ),
    )
    # Before the flags: one named after a SimConfig field defaults to the field's default.
    p.set_defaults(handler=_simulate, **asdict(SimConfig()))
    p.add_argument("--requests", type=int, help="requests to finish")
    p.add_argument("--concurrency", type=int, help="requests decoding at once")
    p.add_argument("--rid-pool", type=int, help="distinct rids (small: reuse)")
    p.add_argument("--prompt-pool", type=int, help="distinct prompts")
    p.add_argument("--page-size", type=int, help="tokens per page")
    p.add_argument("--stride", type=int, help="offload stride in tokens (default: a page)")
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int, help="KV heads")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--layout", choices=LAYOUTS, help="device KV pool layout")
    p.add_argument("--dtype", choices=sorted(DTYPES))
    p.add_argument("--host-pages", type=int, help="host pool size in pages")
    p.add_argument("--seed", type=int)
    p.add_argument(
        "--store",
        choices=STORES,
        help="the store tier: a directory, or a Mooncake cluster (--mooncake-master, ...)",
    )
    p.add_argument("--store-dir", help="store directory (default: a temporary one)")
    p.add_argument(
        "--mooncake-master",
        default=os.environ.get(ENV_MASTER),
        metavar="HOST:PORT",
        help=f"the Mooncake master (--store mooncake; default: ${ENV_MASTER})",
    )
    p.add_argument(
        "--mooncake-metadata",
        default=os.environ.get(ENV_METADATA),
        metavar="URL",
        help=f"the Mooncake metadata server, http://HOST:PORT/metadata (default: ${ENV_METADATA})",
    )
    p.add_argument("--copy-delay", type=float, help="seconds, +- jitter")
    p.add_argument("--copy-fail-rate", type=_rate)
    p.add_argument("--store-fail-rate", type=_rate)
    p.add_argument("--abort-rate", type=_rate, help="per request")
    p.add_argument("--retract-rate", type=_rate, help="per request")
    p.add_argument(
        "--return-rate",
        type=_rate,
        help="chance an admitted request is a conversation returning: its prefix is restored",
    )
    p.add_argument(
        "--restores",
        action=argparse.BooleanOptionalAction,
        help="load prefixes (returning conversations, resumed requests) instead of "
        "recomputing them (default: on)",
    )
    p.add_argument(
        "--keep-on-host",
        action=argparse.BooleanOptionalAction,
        help="written pages stay on the host tier as a cache (default: on; off with "
        "--world-size above 1, where restores come from the store)",
    )
    p.add_argument("--prompt-len", type=_pair, metavar="LOW,HIGH")
    p.add_argument("--output-len", type=_pair, metavar="LOW,HIGH")
    p.add_argument(
        "--world-size",
        type=_world_size,
        default=1,
        help="ranks of one tensor-parallel group: N processes in a gloo group that agree on "
        "acks and loads",
    )
    p.add_argument(
        "--agreement-timeout",
        type=float,
        default=60.0,
        help="seconds a rank waits for its peers in a collective before it fails (world size > 1)",
    )
    p.add_argument(
        "--rank-copy-delays",
        type=_delays,
        metavar="D0,D1,...",
        help="a copy delay per rank in seconds (e.g. one slow rank); default: --copy-delay",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, nothing else")


def _simulate(args: argparse.Namespace) -> int:
    cfg = SimConfig(**{name: getattr(args, name) for name in SimConfig.__dataclass_fields__})
    if args.world_size > 1 or args.rank_copy_delays is not None:  # N processes
        from kvlife.sim.distributed import run_distributed

        result = run_distributed(
            cfg, args.world_size, timeout=args.agreement_timeout, copy_delays=args.rank_copy_delays
        )
        if args.json:
            print(json.dumps(result))
        else:
            _print_ranks(cfg, result)
        return 0 if result["ok"] and result["ranks_agreed"] else 1
    cfg.check()  # before a temporary directory is made
    if cfg.store != "directory" or cfg.store_dir:
        return _simulate_one(cfg, args)
    # The temporary store is this command's, removed whatever ends the run (an error, a
    # stop signal raised as kvlife.cli.Stopped), not only when the simulation returns.
    store_dir = tempfile.mkdtemp(prefix="kvlife-sim-")
    try:
        return _simulate_one(replace(cfg, store_dir=store_dir), args)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)


def _simulate_one(cfg: SimConfig, args: argparse.Namespace) -> int:
    """One process: simulate ``cfg`` and print its report."""
    if args.json or not sys.stdout.isatty():
        report = run_simulation(cfg)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        columns: list[Any] = [BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress("[progress.description]{task.description}", *columns) as bar:
            task = bar.add_task("decoding", total=cfg.requests)
            report = run_simulation(cfg, progress=lambda n: bar.advance(task, n))
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        _print_summary(cfg, report)
    return 0 if report.ok else 1


def _print_ranks(cfg: SimConfig, result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    per_rank = result["per_rank"]
    table = Table(title=f"kvlife simulate, {result['world_size']} ranks (seed {cfg.seed})")
    table.add_column("figure")
    for r in per_rank:
        table.add_column(f"rank {r['rank']}", justify="right")
    shown = (
        "ok requests lifecycles_released chunks_offloaded pages_verified corrupted_pages "
        "host_pool_exhausted copy_failures store_failures stored_keys stored_keys_digest "
        "releases release_digest elapsed_s"
    )
    for key in shown.split():
        table.add_row(key, *(_cell(r.get(key, "-")) for r in per_rank))
    console = Console()
    console.print(table)
    for r in per_rank:
        if "error" in r:
            console.print(f"[red]rank {r['rank']}:[/] {r['error']}")
    if result["ok"] and result["ranks_agreed"]:
        console.print("[bold green]OK[/]: every rank verified; stores and releases identical")
    else:
        console.print("[bold red]FAILED[/]: ranks_agreed=" + str(result["ranks_agreed"]))


def _print_summary(cfg: SimConfig, report: SimReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvlife simulate (seed {cfg.seed}, {cfg.layout}, {cfg.dtype})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in report.as_dict().items():
        if key in ("violations", "ok"):
            continue
        bad = key in SimReport.FAILURES and value
        table.add_row(key, f"[bold red]{_cell(value)}[/]" if bad else _cell(value))
    console = Console()
    console.print(table)
    for line in report.violations[:20]:
        console.print(f"[red]violation:[/] {line}")
    verdict = "[bold green]OK[/]: every stored page verified, nothing leaked"
    console.print(verdict if report.ok else "[bold red]FAILED[/]: see the figures in red")


def _cell(value: object) -> str:
    """A figure as the summary tables show it."""
    return f"{value:.3f}" if isinstance(value, float) else str(value)
