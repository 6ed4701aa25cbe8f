"""A run's result: its configuration, summaries (overall and per tenant) and every record.

Saved as one JSON file (the full record of the run, what ``tandem bench compare`` and the plots
read) and optionally a CSV of the per-request records.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.harness.records import RequestRecord
from bench.harness.summary import Summary

FORMAT = "tandem-bench/1"
CSV_COLUMNS = (
    "index",
    "tenant",
    "warmup",
    "scheduled_s",
    "sent_s",
    "status",
    "error_type",
    "ttft_ms",
    "ttft_content_ms",
    "tpot_ms",
    "max_itl_ms",
    "e2e_ms",
    "queue_ms",
    "prompt_tokens",
    "completion_tokens",
    "max_tokens",
    "content_chunks",
    "finish_reason",
    "request_id",
    "error",
)


@dataclass(slots=True)
class RunResult:
    label: str
    config: dict[str, Any]
    summary: Summary
    tenants: dict[str, Summary]
    records: list[RequestRecord]
    started_at: str
    """UTC, ISO 8601."""
    sweep: list[dict[str, Any]] = field(default_factory=list)
    """For a sweep: one entry per rate (``rate``, ``summary``, ``meets_slos``); else empty."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "label": self.label,
            "started_at": self.started_at,
            "config": self.config,
            "summary": self.summary.to_dict(),
            "tenants": {name: s.to_dict() for name, s in self.tenants.items()},
            "sweep": self.sweep,
            "records": [r.to_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunResult:
        if raw.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} result (format {raw.get('format')!r})")
        return cls(
            label=raw["label"],
            config=raw["config"],
            summary=Summary.from_dict(raw["summary"]),
            tenants={k: Summary.from_dict(v) for k, v in raw["tenants"].items()},
            records=[RequestRecord.from_dict(r) for r in raw["records"]],
            started_at=raw["started_at"],
            sweep=raw.get("sweep", []),
        )

    def save_json(self, path: Path) -> None:
        path.write_bytes(orjson.dumps(self.to_dict(), option=orjson.OPT_INDENT_2))

    @classmethod
    def load_json(cls, path: Path) -> RunResult:
        try:
            raw = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{path} is not a tandem bench result (not a JSON object)")
        try:
            return cls.from_dict(raw)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from exc
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path} is not a complete tandem bench result: {exc!r}") from exc

    def save_csv(self, path: Path) -> None:
        with path.open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            for record in self.records:
                writer.writerow(csv_row(record))


def csv_row(record: RequestRecord) -> dict[str, Any]:
    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else round(seconds * 1000, 3)

    return {
        "index": record.index,
        "tenant": record.tenant,
        "warmup": record.warmup,
        "scheduled_s": record.scheduled_s,
        "sent_s": round(record.sent_s, 6),
        "status": record.status,
        "error_type": record.error_type,
        "ttft_ms": ms(record.ttft_s),
        "ttft_content_ms": ms(record.ttft_content_s),
        "tpot_ms": ms(record.tpot_s),
        "max_itl_ms": ms(record.max_itl_s),
        "e2e_ms": ms(record.e2e_s),
        "queue_ms": record.queue_ms,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "max_tokens": record.max_tokens,
        "content_chunks": record.content_chunks,
        "finish_reason": record.finish_reason,
        "request_id": record.request_id,
        "error": record.error,
    }
