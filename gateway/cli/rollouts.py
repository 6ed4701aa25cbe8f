"""``tandem rollout ...``: a candidate version brought to 100 % behind gates, over the admin API.

tandem rollout start ALIAS --baseline VERSION --candidate VERSION
        [--mode canary|ab|shadow_then_canary] [--steps 1,5,25,50] [--bake 5m] [--interval 30s]
        [--grace 10m] [--keep-baseline]
        [--gate KIND:key=value,...]... [--gates-file FILE] [--quality-prompts FILE | --no-quality]
        [--webhook URL --webhook-secret SECRET] [--spec FILE] [--reason TEXT] [--watch]
tandem rollout status [ID|ALIAS] [--watch] [--interval-s S] [--json]
tandem rollout pause|resume|promote|abort ID [--reason TEXT]
tandem rollout history [--alias NAME] [--limit N] [--json]
tandem rollout report ID [--out DIR]

Durations are seconds, or end in ``ms``, ``s``, ``m`` or ``h``. A gate is its kind and limits in
the API's units (seconds, shares of 1, USD per 1k tokens); a value may end in ``ms``, ``s`` or
``%``: ``ttft_p95:max_value=800ms,max_ratio=1.2``, ``error_rate:max_value=2%,min_samples=200``,
``busy_cost:max_ratio=1.5,dry_run``. Gates given (flags or file) are the only ones that run;
none given, the gateway's defaults do. ``--spec`` reads a whole spec (the JSON shape of
``rollouts/spec.py``, or the same in YAML); flags override its fields.

``status`` draws a screen for people; ``--json`` prints the API's JSON instead. ``history`` is
a table on a terminal and JSON otherwise (as ``tandem admin``'s lists). Exit codes: 0 done, and
for ``--watch`` the rollout succeeded; 1 the gateway refused or was not reached (one line on
standard error); 2 a usage error, and for ``--watch`` the rollout failed or was aborted (CI can
branch on it); 130 Ctrl-C stopped the watch (the rollout goes on). A paused rollout waits for a
person, and so does its watch. On a terminal the watch redraws in place; into a file or a pipe
(CI) each decision is a line on standard error, then the final screen. The report is written
just after the end: ``report`` right after a watch may have to be run again. Connection flags
as ``tandem admin``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console
from rich.live import Live

from gateway.cli.admin import (
    AdminCliError,
    add_connection_flags,
    add_log_level_flag,
    call_api,
    err,
    out,
    run_api_command,
    show_json,
)
from gateway.cli.rollout_screen import (
    decision_line,
    history_table,
    is_active,
    render,
    state_text,
    versions_text,
)
from rollouts.gates import Gate
from rollouts.machine import COMMANDS
from rollouts.quality import QualityCheck
from rollouts.spec import DEFAULT_BAKE_S, DEFAULT_STEP_WEIGHTS, Mode

_API = "/admin/v1/rollouts"
_EXIT_CODES = {"succeeded": 0, "failed": 2, "aborted": 2}
_START_WATCH_INTERVAL_S = 1.0
_LOG_WIDTH = 120
"""Columns of a screen printed to a file or a pipe (a CI log does not wrap at 80)."""

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "%": 0.01}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|%)?\s*$")
_GATE_KEYS = frozenset(f.name for f in dataclasses.fields(Gate))
_WHOLE_GATE_KEYS = frozenset({"min_samples", "failure_limit"})


def add_rollout_parser(commands: Any) -> None:
    """Register ``tandem rollout`` on the main parser's subcommands."""
    rollout = commands.add_parser("rollout", help="canary a version behind gates, then promote")
    add_connection_flags(rollout)
    cmds = rollout.add_subparsers(dest="rollout_command", required=True)

    start = cmds.add_parser("start", help="start a rollout of a deployed candidate")
    start.add_argument("alias", metavar="ALIAS")
    start.add_argument("--baseline", metavar="VERSION", help="the version serving now")
    start.add_argument("--candidate", metavar="VERSION", help="the version rolled out")
    start.add_argument("--mode", choices=[mode.value for mode in Mode])
    start.add_argument(
        "--steps",
        type=_weights,
        metavar="W,W,...",
        help="the candidate's percent at each step (default 1,5,25,50; then 100)",
    )
    start.add_argument("--bake", type=duration, help=f"each step's (default {DEFAULT_BAKE_S:g}s)")
    start.add_argument("--interval", type=duration, dest="interval_s", help="between measurements")
    start.add_argument("--grace", type=duration, dest="grace_s", help="baseline kept after 100 %%")
    start.add_argument("--keep-baseline", action="store_true", help="not drained after grace")
    start.add_argument(
        "--gate",
        type=gate_arg,
        action="append",
        default=[],
        dest="gates",
        metavar="KIND:KEY=VALUE,...",
        help="a gate (repeatable; replaces the file's gate of the same kind)",
    )
    start.add_argument("--gates-file", type=_gates_file, metavar="FILE", help="JSON/YAML list")
    quality = start.add_mutually_exclusive_group()
    quality.add_argument("--quality-prompts", type=_prompts_file, metavar="FILE", help="golden set")
    quality.add_argument("--no-quality", action="store_true", help="skip the golden prompts")
    start.add_argument("--webhook", metavar="URL", help="where the rollout's events are posted")
    start.add_argument("--webhook-secret", metavar="SECRET", help="the webhook's signing secret")
    start.add_argument("--spec", type=_spec_file, metavar="FILE", help="a whole spec, JSON/YAML")
    start.add_argument("--reason", help="why, for the audit log")
    start.add_argument("--watch", action="store_true", help="then follow it (see exit codes)")

    status = cmds.add_parser("status", help="a rollout's screen (no argument: every active one)")
    status.add_argument("target", nargs="?", metavar="ID|ALIAS")
    status.add_argument("--watch", action="store_true", help="redraw until it is finished")
    status.add_argument("--interval-s", type=_positive, default=1.0, help="redraw interval")
    status.add_argument("--json", action="store_true", help="the API's JSON instead")

    steering = []
    for action in COMMANDS:
        command = cmds.add_parser(action, help=f"{action} a rollout")
        command.add_argument("rollout_id", metavar="ID")
        command.add_argument("--reason", default="", help="why, for the audit log")
        steering.append(command)

    history = cmds.add_parser("history", help="finished rollouts, newest first")
    history.add_argument("--alias")
    history.add_argument("--limit", type=int, default=20)
    history.add_argument("--json", action="store_true", help="the API's JSON instead")

    report = cmds.add_parser("report", help="download a finished rollout's report")
    report.add_argument("rollout_id", metavar="ID")
    report.add_argument("--out", type=Path, help="folder (default ./rollout-<ID>)")

    for parser in (start, status, *steering, history, report):
        add_connection_flags(parser, subcommand=True)
        add_log_level_flag(parser)


def run_rollout(args: argparse.Namespace) -> int:
    """Run one ``tandem rollout`` command; returns the exit code (see the module docstring)."""
    code = 0

    def dispatch(client: httpx.Client, args: argparse.Namespace) -> None:
        nonlocal code
        code = _dispatch(client, args)

    return run_api_command(args, dispatch) or code


def _dispatch(client: httpx.Client, args: argparse.Namespace) -> int:
    command = args.rollout_command
    if command == "start":
        rollout = call_api(client, "POST", _API, spec_body(args))
        err.print(
            f"started {rollout['id']}: {versions_text(rollout)}", markup=False, highlight=False
        )
        if args.watch:
            return _watch(client, rollout, _START_WATCH_INTERVAL_S, as_json=False)
        show_json(rollout)
    elif command == "status":
        return _status(client, args)
    elif command in COMMANDS:
        body = {"reason": args.reason}
        rollout = call_api(client, "POST", f"{_API}/{args.rollout_id}/{command}", body)
        show_json(rollout)
        said = (
            f"{command} applied: {state_text(rollout)}"
            if rollout.get("command", {}).get("applied")
            else f"{command} queued: the gateway holding the rollout lease applies it next"
        )
        err.print(f"{rollout['id']}: {said}", markup=False, highlight=False)
    elif command == "history":
        params: dict[str, Any] = {"active": "false", "limit": args.limit}
        if args.alias:
            params["alias"] = args.alias
        listed = call_api(client, "GET", str(httpx.URL(_API, params=params)))
        if args.json or not out.is_terminal:
            show_json(listed)  # piped or captured: JSON for scripts, as `tandem admin` lists
        else:
            out.print(history_table(listed["data"]))
    elif command == "report":
        for path in _download_report(client, args.rollout_id, args.out):
            out.print(str(path), markup=False, highlight=False, soft_wrap=True)
    return 0


def spec_body(args: argparse.Namespace) -> dict[str, Any]:
    """The ``POST /admin/v1/rollouts`` body: ``--spec``'s fields, overridden by the flags."""
    body: dict[str, Any] = dict(args.spec or {})
    body["alias"] = args.alias
    for name in ("baseline", "candidate", "mode", "interval_s", "grace_s"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.steps is not None:
        bake_s = DEFAULT_BAKE_S if args.bake is None else args.bake
        body["steps"] = [{"weight": weight, "bake_s": bake_s} for weight in args.steps]
    elif args.bake is not None:
        steps = body.get("steps")
        if not isinstance(steps, list):
            steps = [{"weight": weight} for weight in DEFAULT_STEP_WEIGHTS]
        # A malformed step is sent as it is: the gateway's answer names the field.
        body["steps"] = [
            {**step, "bake_s": args.bake} if isinstance(step, dict) else step for step in steps
        ]
    if args.keep_baseline:
        body["drain_baseline"] = False
    gates = args.gates_file if args.gates_file is not None else body.get("gates")
    if args.gates:
        replaced = {gate["kind"] for gate in args.gates}
        kept = [g for g in gates or [] if not (isinstance(g, dict) and g.get("kind") in replaced)]
        gates = [*kept, *args.gates]
    if gates is not None:
        body["gates"] = gates
    quality = body.get("quality")
    quality = dict(quality) if isinstance(quality, dict) else {}
    if args.no_quality:
        body["quality"] = {**quality, "enabled": False}
    elif args.quality_prompts is not None:
        body["quality"] = {**quality, "prompts": args.quality_prompts}
    if (args.webhook is None) != (args.webhook_secret is None):
        raise AdminCliError("--webhook and --webhook-secret go together: give both")
    if args.webhook is not None:
        body["webhook"] = {"url": args.webhook, "secret": args.webhook_secret}
    if args.reason is not None:
        body["reason"] = args.reason
    for name in ("baseline", "candidate"):
        if not body.get(name):
            raise AdminCliError(f"--{name} VERSION is required (or a --spec file naming it)")
    return body


def _status(client: httpx.Client, args: argparse.Namespace) -> int:
    if args.target is None:
        if args.watch:
            raise AdminCliError("--watch follows one rollout: give its ID or alias")
        listed = call_api(client, "GET", f"{_API}?active=true")
        if args.json:
            show_json(listed)
        elif not listed["data"]:
            out.print("no active rollout (finished ones: `tandem rollout history`)", markup=False)
        for rollout in [] if args.json else listed["data"]:
            _print_screen(rollout)
        return 0
    rollout = _resolve(client, args.target)
    if args.watch:
        return _watch(client, rollout, args.interval_s, as_json=args.json)
    if args.json:
        show_json(rollout)
    else:
        _print_screen(rollout)
    return 0


def _resolve(client: httpx.Client, target: str) -> dict[str, Any]:
    """The rollout ``target`` names: an id, else an alias's active rollout, else its latest."""
    response = client.get(f"{_API}/{target}")
    if response.status_code != 404:
        _raise_for_error(response)
        found: dict[str, Any] = response.json()
        return found
    for active in (True, False):
        params: dict[str, Any] = {"alias": target, "limit": 1}
        if active:
            params["active"] = "true"
        listed = call_api(client, "GET", str(httpx.URL(_API, params=params)))["data"]
        if listed:
            return dict(listed[0])
    raise AdminCliError(f"no rollout {target!r}: neither a rollout id nor an alias rolled out")


def _watch(client: httpx.Client, rollout: dict[str, Any], interval_s: float, as_json: bool) -> int:
    """Follow ``rollout`` until it is finished; its exit code. A terminal gets the screen
    redrawn in place; a file or a pipe gets each decision as a line on standard error as it
    comes, then the final screen."""
    try:
        if out.is_terminal and not as_json:
            with Live(render(rollout), console=out, auto_refresh=False) as live:
                while is_active(rollout):
                    time.sleep(interval_s)
                    rollout = call_api(client, "GET", f"{_API}/{rollout['id']}")
                    live.update(render(rollout), refresh=True)
        else:
            num_logged = 0
            while True:
                if not as_json:
                    for decision in rollout["decisions"][num_logged:]:
                        err.print(decision_line(decision), markup=False, highlight=False)
                    num_logged = len(rollout["decisions"])
                if not is_active(rollout):
                    break
                time.sleep(interval_s)
                rollout = call_api(client, "GET", f"{_API}/{rollout['id']}")
            if as_json:
                show_json(rollout)
            else:
                _print_screen(rollout)
    except KeyboardInterrupt:
        err.print(
            f"stopped watching; {rollout['id']} goes on (`tandem rollout status {rollout['id']}`)",
            markup=False,
            highlight=False,
        )
        return 130
    return _EXIT_CODES.get(rollout["status"], 1)


def _download_report(client: httpx.Client, rollout_id: str, folder: Path | None) -> list[Path]:
    rollout = call_api(client, "GET", f"{_API}/{rollout_id}")
    names: list[str] = rollout["report"]
    if not names:
        when = (
            "is written when it ends"
            if is_active(rollout)
            # The controller writes it just after saving the end (the charts take a moment).
            else "is not written yet (try again shortly), or this gateway keeps no reports"
        )
        raise AdminCliError(f"{rollout_id} is {rollout['status']}: its report {when}")
    folder = folder or Path(f"rollout-{rollout['id']}")
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in names:
        if Path(name).name != name:  # "(not written: why)": the gateway could not write it
            raise AdminCliError(f"the report of {rollout_id}: {name}")
        response = client.get(f"{_API}/{rollout_id}/report/{name}")
        _raise_for_error(response)
        path = folder / name
        path.write_bytes(response.content)
        paths.append(path)
    return paths


def _raise_for_error(response: httpx.Response) -> None:
    """The error in ``call_api``'s words: ``404: No rollout 'x'.``"""
    if response.is_error:
        try:
            message = (response.json().get("error") or {}).get("message", response.text)
        except ValueError:
            message = response.text
        raise AdminCliError(f"{response.status_code}: {message}")


def _print_screen(rollout: Mapping[str, Any]) -> None:
    console = out
    if not out.is_terminal:  # a file or a pipe: as wide as a log line may be
        console = Console(file=out.file, width=max(out.width, _LOG_WIDTH))
    console.print(render(rollout))


def duration(text: str) -> float:
    """Seconds from ``90``, ``1.5s``, ``500ms``, ``5m``, ``1h``."""
    match = _QUANTITY.match(text)
    if match is None or match.group(2) == "%":
        raise argparse.ArgumentTypeError(f"{text!r}: seconds, or a number ending in ms, s, m or h")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def gate_arg(text: str) -> dict[str, Any]:
    """``KIND:key=value,...`` as the API's gate object, checked as the gateway will."""
    kind, _, rest = text.partition(":")
    gate: dict[str, Any] = {"kind": kind.strip()}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in _GATE_KEYS or key == "kind":
            known = ", ".join(sorted(_GATE_KEYS - {"kind"}))
            raise argparse.ArgumentTypeError(f"{text!r}: unknown key {key!r}; known: {known}")
        if key == "dry_run":
            if sep and value.strip().lower() not in ("true", "false"):
                raise argparse.ArgumentTypeError(f"{text!r}: dry_run is true or false")
            gate[key] = not sep or value.strip().lower() == "true"
        elif not sep:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {key}=VALUE")
        else:
            gate[key] = _gate_value(text, key, value)
    try:
        Gate.from_dict(gate)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return gate


def _gate_value(text: str, key: str, value: str) -> float | int:
    if key in _WHOLE_GATE_KEYS:
        if not value.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: {key} is a whole number")
        return int(value)
    match = _QUANTITY.match(value)
    if match is None or match.group(2) in ("m", "h"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: {key} is a number, which may end in ms, s or %"
        )
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _weights(text: str) -> list[float]:
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: percents separated by commas") from None
    return weights


def _positive(text: str) -> float:
    value = duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: more than 0 seconds")
    return value


def _spec_file(text: str) -> dict[str, Any]:
    data = _read_file(text)
    if not isinstance(data, dict):
        raise argparse.ArgumentTypeError(f"{text}: a spec is an object (rollouts/spec.py)")
    return data


def _gates_file(text: str) -> list[Any]:
    gates = _listed_file(text, "gates")
    for i, gate in enumerate(gates):
        try:
            Gate.from_dict(gate)
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"{text}: gates[{i}]: {exc}") from None
    return gates


def _prompts_file(text: str) -> list[Any]:
    prompts = _listed_file(text, "prompts")  # the shipped golden_prompts.json reads as well
    try:
        QualityCheck.from_dict({"prompts": prompts})
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc}") from None
    return prompts


def _listed_file(text: str, key: str) -> list[Any]:
    data = _read_file(text)
    items = data.get(key) if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise argparse.ArgumentTypeError(f'{text}: a list of {key}, or {{"{key}": [...]}}')
    return items


def _read_file(text: str) -> Any:
    path = Path(text)
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            return yaml.safe_load(raw)
        return json.loads(raw)
    except (ValueError, yaml.YAMLError) as exc:
        raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
