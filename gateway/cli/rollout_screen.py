"""The screens of ``tandem rollout``: ``status``'s (header, gate table, last decisions) and
``history``'s table. Pure renderings of the admin API's rollout JSON (``rollouts/record.py``'s
``Rollout.public_dict``): nothing here talks to the gateway."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from rollouts.gates import GateKind
from rollouts.spec import SHADOW_PHASE_KINDS

_NUM_DECISIONS_SHOWN = 5
_LATENCY = frozenset({GateKind.TTFT_P95, GateKind.ITL_P95})
_COSTS = frozenset({GateKind.BUSY_COST, GateKind.PROVISIONED_COST})

_STYLES = {
    word: style
    for style, words in (
        ("cyan", "running"),
        ("green", "succeeded pass quality_passed step_passed promoted"),
        ("yellow", "paused inconclusive step_extended"),
        ("red", "failed aborted fail rolled_back"),
        ("magenta", "error metrics_error"),
        ("dim", "waiting"),
    )
    for word in words.split()
}
"""Statuses, verdicts and decision events, coloured alike."""
_ENDINGS = frozenset({"succeeded", "failed", "aborted"})


def is_active(rollout: Mapping[str, Any]) -> bool:
    return rollout["status"] in ("running", "paused")


def render(rollout: Mapping[str, Any], now: float | None = None) -> RenderableType:
    """``status``'s screen: the header, the gate table, the last decisions."""
    now = time.time() if now is None else now
    parts: list[RenderableType] = [_header(rollout, now)]
    gates, as_of = _gate_rows(rollout)
    if gates:
        table = Table(
            "gate", "verdict", "candidate", "baseline", "limit", "samples", "p", title=as_of
        )
        for row in gates:
            table.add_row(*row)
        parts.append(table)
    elif rollout["phase"] in ("quality", "shadow", "canary"):
        parts.append(Text("no gate measured yet", style="dim"))
    decisions = rollout["decisions"][-_NUM_DECISIONS_SHOWN:]
    if decisions:
        table = Table("time (UTC)", "event", "weight", "detail", title="last decisions")
        for decision in decisions:
            table.add_row(
                _time(decision["at"]),
                Text(decision["event"], style=_STYLES.get(decision["event"], "")),
                f"{decision['weight']:g} %",
                Text(decision["detail"]),
            )
        parts.append(table)
    return Group(*parts)


def _header(rollout: Mapping[str, Any], now: float) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    status = rollout["status"]
    grid.add_row("rollout", Text(f"{rollout['id']}  ({rollout['alias']})"))
    grid.add_row("versions", Text(f"{versions_text(rollout)}, {rollout['spec']['mode']}"))
    started = f"{_time(rollout['created_at'])} by {rollout['created_by']}"
    grid.add_row("started", Text(started + (f": {rollout['reason']}" if rollout["reason"] else "")))
    grid.add_row(
        "status",
        Text.assemble((status, _STYLES.get(status, "")), f", phase {rollout['phase']}"),
    )
    weight = f"{rollout['weight']:g} % on the candidate"
    step = rollout.get("step")
    if step is not None:
        weight += f", step {step['index'] + 1}/{step['of']}"
    grid.add_row("weight", weight)
    ends_at = rollout.get("phase_ends_at")
    if ends_at is not None and is_active(rollout):
        left = ends_at - now
        text = f"{_duration_text(left)} left" if left > 0 else "over, the last measurement due"
        if rollout.get("extensions"):
            text += f" (bake extended {rollout['extensions']}x)"
        grid.add_row("phase", text)
    if rollout.get("consecutive_errors"):
        grid.add_row("errors", f"metric source failed {rollout['consecutive_errors']}x in a row")
    if rollout.get("paused_reason"):
        grid.add_row("paused", Text(rollout["paused_reason"], style="yellow"))
    quality = rollout.get("quality")
    if quality is not None:
        said = f"{quality['outcome']}, {quality['agreement']:.0%} agreed"
        said += f" (min {quality['min_agreement']:.0%})"
        grid.add_row("quality", Text(said, style=_STYLES.get(quality["outcome"], "")))
    return grid


def _gate_rows(rollout: Mapping[str, Any]) -> tuple[list[tuple[RenderableType, ...]], str]:
    """One row per gate: its latest measurement in the phase, else (a finished or just
    started phase) the latest a decision recorded; gates of the phase not measured yet wait."""
    latest = {m["gate"]["kind"]: m for m in rollout.get("history") or []}
    as_of = "gates"
    if not latest:
        for decision in reversed(rollout["decisions"]):
            if decision.get("measurements"):
                latest = {m["gate"]["kind"]: m for m in decision["measurements"]}
                as_of = f"gates at {decision['event']}, {_time(decision['at'])}"
                break
    rows = []
    waiting = is_active(rollout) and rollout["phase"] in ("shadow", "canary")
    spec_gates = {gate["kind"]: gate for gate in rollout["spec"].get("gates") or []}
    for kind in [*spec_gates, *(k for k in latest if k not in spec_gates)]:
        if kind in latest:
            rows.append(_measured_row(latest[kind]))
        elif waiting and _judges_phase(kind, rollout["phase"]):
            gate = spec_gates[kind]
            rows.append((kind, Text("waiting", style="dim"), "-", "-", _limit(gate), "-", "-"))
    return rows, as_of


def _judges_phase(kind: str, phase: str) -> bool:
    if phase == "shadow":
        return kind in SHADOW_PHASE_KINDS
    return kind != GateKind.SHADOW_AGREEMENT


def _measured_row(measurement: Mapping[str, Any]) -> tuple[RenderableType, ...]:
    gate = measurement["gate"]
    kind = GateKind(gate["kind"])
    ours, theirs = measurement["candidate_value"], measurement["baseline_value"]
    candidate = _value(kind, ours)
    if kind is GateKind.OUTPUT_LENGTH_DRIFT and ours is not None and theirs:
        candidate += f" ({ours / theirs - 1:+.1%})"
    samples = str(measurement["num_samples"])
    if kind is not GateKind.SHADOW_AGREEMENT:
        samples += f"/{measurement['baseline_samples']}"
    p_value = measurement["p_value"]
    verdict = measurement["verdict"]
    return (
        kind.value,
        Text(verdict, style=_STYLES.get(verdict, "")),
        candidate,
        _value(kind, theirs),
        _limit(gate),
        f"{samples} (min {gate['min_samples']})",
        "-" if p_value is None else f"{p_value:.2g}",
    )


def _value(kind: GateKind, value: float | None) -> str:
    """A figure in its kind's unit: ms, %, $/1k, tokens."""
    if value is None:
        return "-"
    if kind in _LATENCY:
        return f"{value * 1000:.1f} ms" if value < 0.01 else f"{value * 1000:.0f} ms"
    if kind in _COSTS:
        return f"${value:.6f}/1k"
    if kind is GateKind.OUTPUT_LENGTH_DRIFT:
        return f"{value:.1f} tok"
    return f"{value:.1%}" if kind is not GateKind.SHADOW_AGREEMENT else f"{value:.0%}"


def _limit(gate: Mapping[str, Any]) -> str:
    kind = GateKind(gate["kind"])
    parts = []
    if gate.get("max_value") is not None:
        value = gate["max_value"]
        if kind is GateKind.SHADOW_AGREEMENT:
            parts.append(f">= {value:.0%}")
        elif kind is GateKind.OUTPUT_LENGTH_DRIFT:
            parts.append(f"drift <= {value:.0%}")
        else:
            parts.append(f"<= {_value(kind, value)}")
    if gate.get("max_ratio") is not None:
        parts.append(f"<= x{gate['max_ratio']:g} baseline")
    text = ", ".join(parts)
    return f"{text} (dry run)" if gate.get("dry_run") else text


def history_table(rollouts: Sequence[Mapping[str, Any]]) -> Table:
    """``history``'s table: one finished rollout a row, with the decision that ended it."""
    table = Table("id", "alias", "candidate", "status", "started", "ended", "final decision")
    for rollout in rollouts:
        decisions = rollout["decisions"]
        final = next((d for d in reversed(decisions) if d["event"] in _ENDINGS), None)
        final = final or (decisions[-1] if decisions else None)
        status = rollout["status"]
        table.add_row(
            rollout["id"],
            rollout["alias"],
            rollout["spec"]["candidate"],
            Text(status, style=_STYLES.get(status, "")),
            _time(rollout["created_at"]),
            _time(None if final is None else final["at"]),
            Text("-" if final is None else f"{final['event']}: {final['detail']}"),
        )
    return table


def versions_text(rollout: Mapping[str, Any]) -> str:
    return f"{rollout['spec']['baseline']} -> {rollout['spec']['candidate']}"


def state_text(rollout: Mapping[str, Any]) -> str:
    return f"{rollout['status']}, phase {rollout['phase']}, {rollout['weight']:g} %"


def decision_line(decision: Mapping[str, Any]) -> str:
    return (
        f"{_time(decision['at'])}  {decision['event']}  {decision['weight']:g} %  "
        f"{decision['detail']}"
    )


def _time(value: float | None) -> str:
    if value is None:
        return "-"
    return dt.datetime.fromtimestamp(value, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _duration_text(seconds: float) -> str:
    whole = int(seconds + 0.5)
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


# Flag values ---------------------------------------------------------------------------------
