"""The soak's figures: requests, faults per kind with their recovery, errors by kind, and the
invariants (rich tables), plus a JSON form for machines."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import numpy as np
from rich.table import Table

from bench.soak.run import SoakResult


def requests_table(result: SoakResult) -> Table:
    table = Table(title=f"Requests over {result.seconds / 60:.1f} min (soak and shutdown)")
    for name in ("tenant", "kind", "sent", "ok", "errors by kind"):
        table.add_column(name, justify="left" if name in ("tenant", "kind") else "right")
    groups: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for sent in result.sent:
        groups[(sent.tenant, sent.kind)].append(sent)
    for (tenant, kind), group in sorted(groups.items()):
        errors = Counter(s.record.error_type for s in group if not s.record.ok)
        table.add_row(
            tenant, kind, str(len(group)), str(sum(s.record.ok for s in group)),
            ", ".join(f"{k} {n}" for k, n in errors.most_common()) or "-",
        )  # fmt: skip
    return table


def faults_table(result: SoakResult) -> Table:
    table = Table(title="Faults: recovery = injection -> first successful probe after it")
    for name in ("fault", "injected", "in flight at injection", "recovery p50 s", "p99 s",
                 "max s", "no recovery"):  # fmt: skip
        table.add_column(name, justify="left" if name == "fault" else "right")
    kinds: dict[str, list[Any]] = defaultdict(list)
    for fault in result.faults:
        kinds[fault.kind].append(fault)
    for kind, faults in kinds.items():
        times = [f.recovery_s for f in faults if f.recovery_s is not None]
        table.add_row(
            kind, str(len(faults)), str(sum(f.in_flight for f in faults)),
            *(_q(times, q) for q in (50, 99, 100)),
            str(sum(f.recovery_s is None for f in faults)),
        )  # fmt: skip
    return table


def checks_table(result: SoakResult) -> Table:
    table = Table(title="Invariants")
    for name in ("invariant", "held", "figures"):
        table.add_column(name)
    for check in result.checks:
        table.add_row(check.name, "yes" if check.ok else "NO", check.detail)
    return table


def to_json(result: SoakResult) -> dict[str, Any]:
    return {
        "minutes": result.spec.minutes,
        "seconds": round(result.seconds, 1),
        "ok": result.ok,
        "requests": len(result.sent),
        "errors": dict(Counter(s.record.error_type for s in result.sent if not s.record.ok)),
        "faults": [
            {
                "kind": str(f.kind),
                "at_s": round(f.at_s, 2),
                "ended_s": round(f.ended_s, 2),
                "recovery_s": None if f.recovery_s is None else round(f.recovery_s, 2),
                "in_flight": f.in_flight,
            }
            for f in result.faults
        ],
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in result.checks],
    }


def _q(values: list[float], q: float) -> str:
    return "-" if not values else f"{float(np.percentile(values, q)):.1f}"
