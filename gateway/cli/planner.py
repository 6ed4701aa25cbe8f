"""``tandem planner status [--json]``, ``tandem planner pause|resume [--reason TEXT]``: the
autoscaling planner of a gateway, over the admin API.

``status`` prints a table, one row per version and pool: the workers the planner last read
(serving, starting, draining), the size it wants, its limits, what its latest step decided and
why, and its last change of the pool (when, from and to; the actuator's refusal if it refused).
``--json`` prints the API's JSON (``GET /admin/v1/planner``). ``pause`` holds the planner's
changes (it still steps and reports) until ``resume``. Connection flags as ``tandem admin``.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from gateway.cli.admin import (
    add_connection_flags,
    add_log_level_flag,
    call_api,
    out,
    run_api_command,
    show_json,
)

_API = "/admin/v1/planner"
_LOG_WIDTH = 160
"""Columns of the table printed to a file or a pipe (a log does not wrap at 80; two reasons
and a time fit in 160 without wrapping a row)."""


def add_planner_parser(commands: Any) -> None:
    """Register ``tandem planner`` on the main parser's subcommands."""
    planner = commands.add_parser("planner", help="the autoscaling planner: what it wants, why")
    add_connection_flags(planner)
    cmds = planner.add_subparsers(dest="planner_command", required=True)
    status = cmds.add_parser("status", help="each version's pools: workers, wanted, decisions")
    status.add_argument("--json", action="store_true", help="the API's JSON instead")
    add_connection_flags(status, subcommand=True)
    add_log_level_flag(status)
    for verb, what in (
        ("pause", "hold the planner's changes (it still steps and reports)"),
        ("resume", "let the planner's changes go again"),
    ):
        command = cmds.add_parser(verb, help=what)
        command.add_argument("--reason", default="", help="why, for the audit log")
        add_connection_flags(command, subcommand=True)
        add_log_level_flag(command)


def run_planner(args: argparse.Namespace) -> int:
    """Run one ``tandem planner`` command; returns the exit code (1: the gateway refused or
    was not reached)."""
    return run_api_command(args, _dispatch)


def _dispatch(client: httpx.Client, args: argparse.Namespace) -> None:
    if args.planner_command in ("pause", "resume"):
        status = call_api(client, "POST", f"{_API}/{args.planner_command}", {"reason": args.reason})
        out.print(f"planner: {'paused' if status['paused'] else 'running'}")
        return
    status = call_api(client, "GET", _API)
    if args.json:
        show_json(status)
        return
    console = out
    if not out.is_terminal:
        console = Console(file=out.file, width=max(out.width, _LOG_WIDTH))
    for line in render(status):
        console.print(line)


def render(status: dict[str, Any]) -> list[str | Table]:
    """The status as lines and a table, for people."""
    if status["mode"] == "off":
        return ["planner: off (TANDEM_PLANNER=dry-run plans this gateway's pools and reports)"]
    targets = status["targets"]
    paused = (
        " (paused: changes nothing until `tandem planner resume`)" if status.get("paused") else ""
    )
    lines: list[str | Table] = [
        f"planner: {status['mode']}{paused}, every {status['interval_s']:g} s; targets TTFT "
        f"{targets['ttft_s']:g} s, ITL {targets['itl_s']:g} s, {targets['headroom']:.0%} of a "
        f"worker's profile (profile of {status['profile']})"
    ]
    lease = status.get("lease")
    if lease is not None and not lease["held"]:
        lines.append(
            f"this gateway ({lease['holder']}) does not hold the planner's lease: another "
            "gateway plans the pools; ask that one"
        )
        return lines
    if not status["versions"]:
        lines.append("no step yet: the first comes one interval after the gateway started")
        return lines
    table = Table(
        "version",
        "pool",
        "ready",
        "starting",
        "draining",
        "desired",
        "limits",
        "latest step",
        "last change",
    )
    failures = []
    for version in status["versions"]:
        for pool, figures in version["pools"].items():
            table.add_row(
                version["version"] if pool == "prefill" else "",
                pool,
                _count(figures["ready"]),
                _count(figures["starting"]),
                _count(figures.get("draining")),
                _count(figures["desired"]),
                f"{figures['min_replicas']}-{figures['max_replicas']}",
                _step(figures["last"]),
                _change(figures["decisions"]),
            )
        if version["error"]:
            failures.append(f"{version['version']}: the latest step failed: {version['error']}")
    return [*lines, table, *failures]


def _step(last: dict[str, Any] | None) -> str:
    """What the pool's latest step decided, and why."""
    if last is None:
        return "-"
    if last["current"] == last["desired"]:
        return f"holds: {last['reason']}"
    return f"{last['current']} -> {last['desired']}: {last['reason']}"


def _change(decisions: list[dict[str, Any]]) -> str:
    """The pool's latest change (newest first in ``decisions``), refused or not."""
    if not decisions:
        return "-"
    change = decisions[0]
    text = f"{_time(change['at'])} {change['current']} -> {change['desired']}"
    return f"{text} (refused: {change['error']})" if change["error"] else text


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def _time(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
