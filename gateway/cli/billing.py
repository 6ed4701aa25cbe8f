"""``tandem billing ...``: exports, prices, budgets and measured cost from a terminal.

tandem billing export --from D --to D [--tenant T] [--kind requests|daily|invoice]
                      [--format csv|jsonl|cloudevents] [--out FILE]
tandem billing prices list | set VERSION --input P --output P [--cached P] [--from TIME]
tandem billing budget T [--monthly AMOUNT|unlimited] [--alerts 50,80,100]
                        [--request-log on|off] [--retention-days N]
tandem billing cost

Every command goes through the admin API (``--url``, ``--admin-key`` as for ``tandem admin``),
so it reads what the gateway's ledger holds, including records not yet flushed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx

from gateway.cli.admin import (
    AdminCliError,
    add_connection_flags,
    add_log_level_flag,
    call_api,
    err,
    run_api_command,
    show_json,
)


def add_billing_parser(commands: Any) -> None:
    """Register ``tandem billing`` on the main parser's subcommands."""
    billing = commands.add_parser("billing", help="usage exports, prices, budgets, cost")
    add_connection_flags(billing)
    add_log_level_flag(billing)
    groups = billing.add_subparsers(dest="billing_command", required=True)

    export = groups.add_parser("export", help="per-request rows, daily summaries or invoices")
    export.add_argument("--from", dest="start", required=True, help="YYYY-MM-DD or RFC 3339, UTC")
    export.add_argument("--to", dest="end", required=True, help="exclusive end, same forms")
    export.add_argument("--tenant", help="one tenant (name or id); default all")
    export.add_argument("--kind", choices=("requests", "daily", "invoice"), default="requests")
    export.add_argument("--format", choices=("csv", "jsonl", "cloudevents"), default="csv")
    export.add_argument("--out", type=Path, help="file to write (default standard output)")

    prices = groups.add_parser("prices", help="price cards per model version")
    price_cmds = prices.add_subparsers(dest="prices_command", required=True)
    price_cmds.add_parser("list", help="every card")
    add = price_cmds.add_parser("set", help="add a card (it never changes past records)")
    add.add_argument("model_version")
    add.add_argument("--input", required=True, help="price per 1k uncached prompt tokens")
    add.add_argument("--output", required=True, help="price per 1k completion tokens")
    add.add_argument("--cached", help="price per 1k cached prompt tokens (default --input)")
    add.add_argument("--from", dest="effective_from", help="RFC 3339 start (default now)")

    budget = groups.add_parser("budget", help="show or set a tenant's budget and request log")
    budget.add_argument("tenant")
    budget.add_argument("--monthly", help="spend limit per UTC month, or 'unlimited'")
    budget.add_argument("--alerts", help="alert levels in percent, e.g. 50,80,100")
    budget.add_argument("--request-log", choices=("on", "off"), help="keep scrubbed prompts")
    budget.add_argument("--retention-days", type=float, help="how long kept prompts live")

    groups.add_parser("cost", help="measured cost per 1k tokens vs what was charged")


def run_billing(args: argparse.Namespace) -> int:
    """Run one ``tandem billing`` command; returns the exit code."""
    return run_api_command(args, _dispatch, timeout_s=60.0)  # exports of a month take a while


def _dispatch(client: httpx.Client, args: argparse.Namespace) -> None:
    command = args.billing_command
    if command == "export":
        _export(client, args)
    elif command == "prices" and args.prices_command == "list":
        show_json(call_api(client, "GET", "/admin/v1/billing/prices"))
    elif command == "prices":
        card: dict[str, Any] = {
            "model_version": args.model_version,
            "input_per_1k": args.input,
            "output_per_1k": args.output,
        }
        if args.cached is not None:
            card["cached_input_per_1k"] = args.cached
        if args.effective_from is not None:
            card["effective_from"] = args.effective_from
        show_json(call_api(client, "POST", "/admin/v1/billing/prices", card))
    elif command == "budget":
        path = f"/admin/v1/tenants/{args.tenant}/billing"
        changes = _budget_changes(args)
        show_json(
            call_api(client, "PATCH", path, changes) if changes else call_api(client, "GET", path)
        )
    elif command == "cost":
        show_json(call_api(client, "GET", "/admin/v1/billing/cost"))


def _export(client: httpx.Client, args: argparse.Namespace) -> None:
    params = {"from": args.start, "to": args.end, "kind": args.kind, "format": args.format}
    if args.tenant:
        params["tenant"] = args.tenant
    with client.stream("GET", "/admin/v1/billing/export", params=params) as response:
        if response.is_error:
            response.read()
            message = (response.json().get("error") or {}).get("message", response.text)
            raise AdminCliError(f"{response.status_code}: {message}")
        sink = args.out.open("wb") if args.out else sys.stdout.buffer
        try:
            for chunk in response.iter_bytes():
                sink.write(chunk)
        finally:
            if args.out:
                sink.close()
            else:
                sink.flush()
    if args.out:
        err.print(f"wrote {args.out}")


def _budget_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if args.monthly is not None:
        changes["monthly_budget"] = None if args.monthly == "unlimited" else args.monthly
    if args.alerts is not None:
        try:
            changes["alert_thresholds_pct"] = [int(p) for p in args.alerts.split(",") if p]
        except ValueError as exc:
            raise AdminCliError("--alerts takes percentages, e.g. 50,80,100") from exc
    if args.request_log is not None:
        changes["request_log"] = args.request_log == "on"
    if args.retention_days is not None:
        changes["request_log_retention_s"] = round(args.retention_days * 86_400)
    return changes
