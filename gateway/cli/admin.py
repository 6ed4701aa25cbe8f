"""``tandem admin ...``: the admin API from a terminal.

tandem admin tenants list | create NAME [plan flags] | show T | update T [plan flags] | delete T
tandem admin keys issue T [--name N] | list T | revoke KEY_ID
tandem admin usage T

T is a tenant's name or id. The gateway is ``--url`` (default: TANDEM_HOST/TANDEM_PORT); the
admin key is ``--admin-key``, else ``TANDEM_ADMIN_KEY``, else the file ``tandem up`` wrote in the
state folder (``TANDEM_STATE_DIR``, default ``.tandem``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from gateway.assembly.admin_key import ADMIN_KEY_FILE
from gateway.assembly.settings import TandemSettings

out = Console()
err = Console(stderr=True)

_PLAN_FLAGS = ("tpm", "rpm", "max_concurrent", "max_prompt_tokens", "max_output_tokens")
_LOG_LEVELS = ("debug", "info", "warning", "error")


class AdminCliError(Exception):
    """Something the operator must fix; printed without a traceback."""


def add_connection_flags(parser: argparse.ArgumentParser, *, subcommand: bool = False) -> None:
    """``--url`` and ``--admin-key``: how an admin-API command reaches the gateway. Given on
    a group and on its ``subcommand``s, either place works: a subcommand's own flags default
    to nothing, so they never overwrite what was given before it."""
    default = argparse.SUPPRESS if subcommand else None
    parser.add_argument(
        "--url", default=default, help="gateway base URL (default http://TANDEM_HOST:TANDEM_PORT)"
    )
    parser.add_argument(
        "--admin-key", default=default, help="admin key (default TANDEM_ADMIN_KEY or the key file)"
    )


def add_log_level_flag(parser: argparse.ArgumentParser, default: str = "warning") -> None:
    """``--log-level``: what reaches standard error (standard output is the command's answer)."""
    parser.add_argument(
        "--log-level",
        choices=_LOG_LEVELS,
        default=default,
        help=f"log messages from this level up, on standard error (default {default})",
    )


def add_admin_parser(commands: Any) -> None:
    """Register ``tandem admin`` on the main parser's subcommands."""
    admin = commands.add_parser("admin", help="manage tenants, keys and quotas")
    add_connection_flags(admin)
    add_log_level_flag(admin)
    groups = admin.add_subparsers(dest="admin_group", required=True)

    tenants = groups.add_parser("tenants", help="tenants and their plans")
    tenant_cmds = tenants.add_subparsers(dest="admin_command", required=True)
    tenant_cmds.add_parser("list", help="every tenant")
    create = tenant_cmds.add_parser("create", help="create a tenant")
    create.add_argument("tenant", metavar="NAME")
    _plan_flags(create)
    for name, text in (("show", "one tenant"), ("delete", "delete a tenant and its keys")):
        tenant_cmds.add_parser(name, help=text).add_argument("tenant")
    update = tenant_cmds.add_parser("update", help="change a plan (omitted flags keep values)")
    update.add_argument("tenant")
    _plan_flags(update)

    keys = groups.add_parser("keys", help="API keys")
    key_cmds = keys.add_subparsers(dest="admin_command", required=True)
    issue = key_cmds.add_parser("issue", help="issue a key (its secret is shown once)")
    issue.add_argument("tenant")
    issue.add_argument("--name", default="default", help="a label for the key")
    key_cmds.add_parser("list", help="a tenant's keys").add_argument("tenant")
    key_cmds.add_parser("revoke", help="revoke a key").add_argument("key_id")

    usage = groups.add_parser("usage", help="a tenant's live usage and remaining quota")
    usage.add_argument("tenant")


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    for flag in _PLAN_FLAGS:
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=flag,
            type=_limit,
            metavar="N|unlimited",
            help=f"{flag.replace('_', ' ')} limit",
        )
    parser.add_argument("--weight", type=float, help="fair-share weight (default 1)")
    parser.add_argument("--band", choices=("interactive", "standard", "batch"))


def _limit(text: str) -> int | str:
    if text == "unlimited":
        return text
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("a limit is a positive integer or 'unlimited'")
    return value


def run_admin(args: argparse.Namespace) -> int:
    """Run one ``tandem admin`` command; returns the exit code."""
    return run_api_command(args, _dispatch)


def run_api_command(
    args: argparse.Namespace,
    dispatch: Callable[[httpx.Client, argparse.Namespace], None],
    timeout_s: float = 10.0,
) -> int:
    """Run ``dispatch`` with a client of the admin API (``--url``, ``--admin-key``); returns
    the exit code, with errors printed for the operator instead of a traceback."""
    try:
        settings = TandemSettings()
        url = args.url or f"http://{settings.host}:{settings.port}"
        with httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {admin_key_for(args, settings)}"},
            timeout=timeout_s,
        ) as client:
            dispatch(client, args)
        return 0
    except AdminCliError as exc:
        err.print(f"[red]error:[/] {exc}")
        return 1
    except httpx.HTTPError as exc:
        err.print(f"[red]error:[/] cannot reach the gateway ({exc}); is `tandem up` running?")
        return 1


def admin_key_for(args: argparse.Namespace, settings: TandemSettings) -> str:
    if args.admin_key:
        return str(args.admin_key)
    if settings.admin_key is not None:
        return settings.admin_key.get_secret_value()
    path = settings.state_dir / ADMIN_KEY_FILE
    if path.is_file():
        return path.read_text().strip()
    raise AdminCliError(
        f"no admin key: pass --admin-key, set TANDEM_ADMIN_KEY, or run from the folder where "
        f"`tandem up` keeps {path}"
    )


def _dispatch(client: httpx.Client, args: argparse.Namespace) -> None:
    group, command = args.admin_group, getattr(args, "admin_command", None)
    if group == "usage":
        show_json(call_api(client, "GET", f"/admin/v1/tenants/{args.tenant}/usage"))
    elif group == "tenants" and command == "list":
        _table(
            call_api(client, "GET", "/admin/v1/tenants")["data"],
            ("name", "id", "band", "weight", *_PLAN_FLAGS),
            lambda t: (t["name"], t["tenant_id"], *_plan_cells(t["plan"])),
        )
    elif group == "tenants" and command == "create":
        show_json(
            call_api(client, "POST", "/admin/v1/tenants", {"name": args.tenant, **_plan(args)})
        )
    elif group == "tenants" and command == "show":
        show_json(call_api(client, "GET", f"/admin/v1/tenants/{args.tenant}"))
    elif group == "tenants" and command == "update":
        show_json(call_api(client, "PATCH", f"/admin/v1/tenants/{args.tenant}", _plan(args)))
    elif group == "tenants" and command == "delete":
        show_json(call_api(client, "DELETE", f"/admin/v1/tenants/{args.tenant}"))
    elif group == "keys" and command == "issue":
        issued = call_api(
            client, "POST", f"/admin/v1/tenants/{args.tenant}/keys", {"name": args.name}
        )
        show_issued_key(out, issued)
        err.print("[yellow]The key is shown this once; it is stored only as a hash.[/]")
    elif group == "keys" and command == "list":
        _table(
            call_api(client, "GET", f"/admin/v1/tenants/{args.tenant}/keys")["data"],
            ("id", "name", "prefix", "created", "last used", "revoked"),
            lambda k: (
                k["key_id"], k["name"], k["display_prefix"], _time(k["created_at"]),
                _time(k.get("last_used_at")), _time(k.get("revoked_at")),
            ),
        )  # fmt: skip
    elif group == "keys" and command == "revoke":
        show_json(call_api(client, "POST", f"/admin/v1/keys/{args.key_id}/revoke"))


def _plan(args: argparse.Namespace) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for flag in _PLAN_FLAGS:
        value = getattr(args, flag)
        if value is not None:
            plan[flag] = None if value == "unlimited" else value
    if args.weight is not None:
        plan["weight"] = args.weight
    if args.band is not None:
        plan["band"] = args.band
    return plan


def call_api(
    client: httpx.Client, method: str, path: str, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    response = client.request(method, path, json=body)
    payload: dict[str, Any] = response.json() if response.content else {}
    if response.is_error:
        error = payload.get("error") or {}
        raise AdminCliError(f"{response.status_code}: {error.get('message', response.text)}")
    return payload


def show_json(payload: dict[str, Any]) -> None:
    out.print_json(json.dumps(payload))


def show_issued_key(console: Console, issued: dict[str, Any]) -> None:
    """A freshly issued key, the secret first: on a terminal ``key (shown once): tdm-...``
    then the key's other fields; otherwise the JSON, with ``key`` as its first field.

    ``display_prefix`` also starts with ``tdm-``: shown first, it was taken for the key.
    """
    ordered = {"key": issued["key"], **{k: v for k, v in issued.items() if k != "key"}}
    if not console.is_terminal:
        console.print_json(json.dumps(ordered))
        return
    lines = [
        f"key (shown once): {issued['key']}",
        f"key id: {issued['key_id']}",
        f"tenant id: {issued['tenant_id']}",
        f"name: {issued['name']}",
        f"listed by `keys list` as: {issued['display_prefix']}...",
    ]
    # soft_wrap: a narrow terminal must not break the key across lines (copying it would fail).
    console.print("\n".join(lines), markup=False, highlight=False, soft_wrap=True)


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...], cells: Any) -> None:
    if not out.is_terminal:
        # Piped or captured: JSON for scripts, not a table cut to 80 columns.
        show_json({"object": "list", "data": rows})
        return
    table = Table(*columns)
    for row in rows:
        table.add_row(*(str(cell) for cell in cells(row)))
    out.print(table)


def _plan_cells(plan: dict[str, Any]) -> tuple[str, ...]:
    limits = tuple("-" if plan.get(flag) is None else str(plan[flag]) for flag in _PLAN_FLAGS)
    return (plan["band"], f"{plan['weight']:g}", *limits)


def _time(value: float | None) -> str:
    if value is None:
        return "-"
    return dt.datetime.fromtimestamp(value, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
