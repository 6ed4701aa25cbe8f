"""``tandem model ...``, ``tandem traffic ...`` and ``tandem audit``: versions over the admin API.

tandem model register SOURCE --alias NAME [--dtype D] [--defaults JSON] [--engine-arg FLAG]...
                     [--note TEXT] [--reason TEXT]
tandem model list [--alias NAME] | show VERSION | delete VERSION [--reason TEXT]
tandem model deploy VERSION [--prefill-workers N] [--decode-workers N] [--decode-url URL]...
                   [--engine-arg FLAG]... [--cost-per-hour PRICE]
tandem model undeploy VERSION [--reason TEXT]
tandem model figures VERSION [--window-s S]
tandem traffic set ALIAS --split VERSION=WEIGHT... [--sticky] [--pin TENANT[/KEY_ID]=VERSION]...
                   [--shadow VERSION=PERCENT] [--shadow-max-in-flight N] [--no-direct-access]
                   [--reason TEXT]
tandem traffic show [ALIAS] | delete ALIAS
tandem audit [--alias NAME] [--since ISO|UNIX] [--until ISO|UNIX] [--limit N]

SOURCE is a GGUF file or Hugging Face folder on the gateway's host, or ``bundled``. VERSION is a
version's name (``alias@8hex``), id or id prefix. Connection flags as ``tandem admin``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

import httpx

from gateway.cli.admin import (
    AdminCliError,
    add_connection_flags,
    add_log_level_flag,
    call_api,
    run_api_command,
    show_json,
)

_REGISTER_TIMEOUT_S = 900.0  # a first conversion of a large GGUF, or a worker's boot (deploy)


def add_model_commands(model_commands: Any) -> None:
    """``register``, ``list``, ``show``, ``delete``, ``deploy``, ``undeploy``, ``figures``
    under ``tandem model`` (``prepare`` is the gateway CLI's own)."""
    register = model_commands.add_parser("register", help="record a model source as a version")
    register.add_argument("source", help="GGUF file, HF folder, or 'bundled'")
    register.add_argument("--alias", required=True, help="the model name clients send")
    register.add_argument("--dtype", help="worker dtype (default: the gateway's TANDEM_DTYPE)")
    register.add_argument(
        "--defaults",
        type=_json_object,
        default={},
        help="generation defaults as JSON, e.g. '{\"temperature\": 0.2}'",
    )
    register.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        dest="engine_args",
        metavar="FLAG",
        help="a vLLM flag for its workers (repeatable)",
    )
    register.add_argument("--note", default="")
    _reason(register)
    listing = model_commands.add_parser("list", help="registered versions")
    listing.add_argument("--alias")
    show = model_commands.add_parser("show", help="one version")
    show.add_argument("version")
    delete = model_commands.add_parser("delete", help="remove an unused version")
    delete.add_argument("version")
    _reason(delete)
    deploy = model_commands.add_parser("deploy", help="start workers for a version")
    deploy.add_argument("version")
    deploy.add_argument("--prefill-workers", type=int, default=0)
    deploy.add_argument("--decode-workers", type=int, default=1)
    deploy.add_argument("--prefill-url", action="append", default=[], dest="prefill_urls")
    deploy.add_argument("--decode-url", action="append", default=[], dest="decode_urls")
    deploy.add_argument("--served-as", help="the model name external workers serve")
    deploy.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        dest="engine_args",
        metavar="FLAG",
        help="a vLLM flag for its workers that does not change outputs, e.g. --max-num-seqs=4",
    )
    deploy.add_argument(
        "--cost-per-hour",
        help="what each of its workers costs per hour (other hardware than the default price)",
    )
    _reason(deploy)
    undeploy = model_commands.add_parser("undeploy", help="drain and stop a version's workers")
    undeploy.add_argument("version")
    _reason(undeploy)
    figures = model_commands.add_parser("figures", help="a version's sliding-window figures")
    figures.add_argument("version")
    figures.add_argument("--window-s", type=float, default=300.0)
    for parser in (register, listing, show, delete, deploy, undeploy, figures):
        add_connection_flags(parser, subcommand=True)
        add_log_level_flag(parser)


def add_traffic_parsers(commands: Any) -> None:
    """``tandem traffic`` and ``tandem audit``."""
    traffic = commands.add_parser("traffic", help="traffic policies per alias")
    add_connection_flags(traffic)
    cmds = traffic.add_subparsers(dest="traffic_command", required=True)
    put = cmds.add_parser("set", help="set an alias's policy")
    put.add_argument("alias")
    put.add_argument(
        "--split",
        action="append",
        required=True,
        metavar="VERSION=WEIGHT",
        help="a version and its percent (repeat; they sum to 100)",
    )
    put.add_argument(
        "--sticky",
        action="store_true",
        help="the same user/session keeps its version while weights stay",
    )
    put.add_argument("--pin", action="append", default=[], metavar="TENANT[/KEY_ID]=VERSION")
    put.add_argument("--shadow", metavar="VERSION=PERCENT")
    put.add_argument("--shadow-max-in-flight", type=int, default=4)
    put.add_argument(
        "--no-direct-access",
        action="store_true",
        help="clients may not name a version of the alias directly",
    )
    _reason(put)
    show = cmds.add_parser("show", help="one policy, or all")
    show.add_argument("alias", nargs="?")
    delete = cmds.add_parser("delete", help="drop a policy")
    delete.add_argument("alias")
    _reason(delete)
    for parser in (put, show, delete):
        add_connection_flags(parser, subcommand=True)
        add_log_level_flag(parser)

    audit = commands.add_parser("audit", help="who changed versions, deployments and policies")
    add_connection_flags(audit)
    add_log_level_flag(audit)
    audit.add_argument("--alias")
    audit.add_argument("--since", type=_time_arg, help="ISO time or Unix seconds")
    audit.add_argument("--until", type=_time_arg, help="ISO time or Unix seconds")
    audit.add_argument("--limit", type=int, default=1000)


def run_model(args: argparse.Namespace) -> int:
    return run_api_command(args, _dispatch_model, timeout_s=_REGISTER_TIMEOUT_S)


def run_traffic(args: argparse.Namespace) -> int:
    return run_api_command(args, _dispatch_traffic)


def run_audit(args: argparse.Namespace) -> int:
    return run_api_command(args, _dispatch_audit)


def _dispatch_model(client: httpx.Client, args: argparse.Namespace) -> None:
    command = args.model_command
    if command == "register":
        body = {
            "source": args.source,
            "alias": args.alias,
            "dtype": args.dtype,
            "defaults": args.defaults,
            "engine_args": args.engine_args,
            "note": args.note,
            "reason": args.reason,
        }
        show_json(call_api(client, "POST", "/admin/v1/models", body))
    elif command == "list":
        params = f"?alias={args.alias}" if args.alias else ""
        show_json(call_api(client, "GET", f"/admin/v1/models{params}"))
    elif command == "show":
        show_json(call_api(client, "GET", f"/admin/v1/models/{args.version}"))
    elif command == "delete":
        show_json(
            call_api(client, "DELETE", _with_reason(f"/admin/v1/models/{args.version}", args))
        )
    elif command == "deploy":
        body = {
            "version": args.version,
            "prefill_workers": args.prefill_workers,
            "decode_workers": args.decode_workers,
            "prefill_urls": args.prefill_urls,
            "decode_urls": args.decode_urls,
            "served_as": args.served_as,
            "cost_per_hour": args.cost_per_hour,
            "engine_args": args.engine_args,
            "reason": args.reason,
        }
        show_json(call_api(client, "POST", "/admin/v1/deployments", body))
    elif command == "undeploy":
        path = _with_reason(f"/admin/v1/deployments/{args.version}", args)
        show_json(call_api(client, "DELETE", path))
    elif command == "figures":
        path = f"/admin/v1/versions/{args.version}/figures?window_s={args.window_s}"
        show_json(call_api(client, "GET", path))


def _dispatch_traffic(client: httpx.Client, args: argparse.Namespace) -> None:
    command = args.traffic_command
    if command == "set":
        show_json(call_api(client, "PUT", f"/admin/v1/traffic/{args.alias}", policy_body(args)))
    elif command == "show":
        path = f"/admin/v1/traffic/{args.alias}" if args.alias else "/admin/v1/traffic"
        show_json(call_api(client, "GET", path))
    elif command == "delete":
        show_json(call_api(client, "DELETE", _with_reason(f"/admin/v1/traffic/{args.alias}", args)))


def _dispatch_audit(client: httpx.Client, args: argparse.Namespace) -> None:
    params = {"alias": args.alias, "since": args.since, "until": args.until, "limit": args.limit}
    response = client.get(
        "/admin/v1/audit", params={k: v for k, v in params.items() if v is not None}
    )
    if response.is_error:
        raise AdminCliError(f"{response.status_code}: {response.text}")
    show_json(response.json())


def policy_body(args: argparse.Namespace) -> dict[str, Any]:
    """The admin API's policy JSON for ``tandem traffic set``'s flags."""
    body: dict[str, Any] = {
        "split": [
            {"version": version, "weight": _number(weight, "--split")}
            for version, weight in (_pair(item, "--split") for item in args.split)
        ],
        "sticky": args.sticky,
        "direct_access": not args.no_direct_access,
        "reason": args.reason,
    }
    pins = []
    for item in args.pin:
        who, version = _pair(item, "--pin")
        tenant, _, key = who.partition("/")
        pins.append({"tenant": tenant, "key": key or None, "version": version})
    if pins:
        body["pins"] = pins
    if args.shadow:
        version, percent = _pair(args.shadow, "--shadow")
        body["shadow"] = {
            "version": version,
            "percent": _number(percent, "--shadow"),
            "max_in_flight": args.shadow_max_in_flight,
        }
    return body


def _pair(item: str, flag: str) -> tuple[str, str]:
    left, sep, right = item.rpartition("=")
    if not sep or not left or not right:
        raise AdminCliError(f"{flag} {item!r}: expected NAME=VALUE")
    return left, right


def _number(text: str, flag: str) -> float | int:
    try:
        value = float(text)
    except ValueError as exc:
        raise AdminCliError(f"{flag}: {text!r} is not a number") from exc
    return int(value) if value.is_integer() else value


def _reason(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", default="", help="why, for the audit log")


def _with_reason(path: str, args: argparse.Namespace) -> str:
    return str(httpx.URL(path, params={"reason": args.reason})) if args.reason else path


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object, e.g. '{\"temperature\": 0.2}'")
    return value


def _time_arg(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: an ISO time or Unix seconds") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()
