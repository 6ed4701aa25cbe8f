"""The ledger's schema, as numbered migrations applied in order, each in its own transaction.

The same DDL runs on SQLite and PostgreSQL (BIGINT, TEXT, BOOLEAN; times are integer Unix
microseconds, money integer micro-units, prices decimal strings), so both hold identical
values and exports do not depend on the backend. A migration is never edited once released:
schema changes are new entries. ``tandem_ledger_migrations`` records what was applied.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    statements: tuple[str, ...]


MIGRATIONS_TABLE = "tandem_ledger_migrations"

CREATE_MIGRATIONS_TABLE = f"""
CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE} (
    version INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    applied_at_us BIGINT NOT NULL
)"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "usage ledger, price cards, billing accounts, budget alerts, request log",
        (
            """CREATE TABLE tandem_usage (
                record_id TEXT PRIMARY KEY,
                request_id TEXT NOT NULL,
                tenant_id TEXT NOT NULL,
                key_id TEXT,
                model TEXT NOT NULL,
                model_version TEXT NOT NULL,
                deployment TEXT NOT NULL,
                endpoint TEXT NOT NULL,
                path TEXT,
                status TEXT NOT NULL,
                finish_reason TEXT,
                error_code TEXT,
                moderation_action TEXT,
                prompt_tokens BIGINT NOT NULL,
                completion_tokens BIGINT NOT NULL,
                cached_tokens BIGINT NOT NULL,
                ttft_us BIGINT,
                e2e_us BIGINT,
                started_at_us BIGINT NOT NULL,
                finished_at_us BIGINT NOT NULL,
                cost_micros BIGINT NOT NULL,
                price_effective_from_us BIGINT,
                currency TEXT NOT NULL
            )""",
            "CREATE INDEX tandem_usage_by_time ON tandem_usage (finished_at_us, record_id)",
            """CREATE INDEX tandem_usage_by_tenant
                ON tandem_usage (tenant_id, finished_at_us, record_id)""",
            """CREATE TABLE tandem_price_cards (
                model_version TEXT NOT NULL,
                effective_from_us BIGINT NOT NULL,
                input_per_1k TEXT NOT NULL,
                output_per_1k TEXT NOT NULL,
                cached_input_per_1k TEXT NOT NULL,
                currency TEXT NOT NULL,
                PRIMARY KEY (model_version, effective_from_us)
            )""",
            """CREATE TABLE tandem_billing_accounts (
                tenant_id TEXT PRIMARY KEY,
                monthly_budget_micros BIGINT,
                alert_thresholds_pct TEXT NOT NULL,
                request_log BOOLEAN NOT NULL,
                request_log_retention_s BIGINT NOT NULL,
                updated_at_us BIGINT NOT NULL
            )""",
            """CREATE TABLE tandem_budget_alerts (
                tenant_id TEXT NOT NULL,
                month TEXT NOT NULL,
                threshold_pct INTEGER NOT NULL,
                spend_micros BIGINT NOT NULL,
                budget_micros BIGINT NOT NULL,
                fired_at_us BIGINT NOT NULL,
                PRIMARY KEY (tenant_id, month, threshold_pct)
            )""",
            """CREATE TABLE tandem_request_log (
                record_id TEXT PRIMARY KEY,
                request_id TEXT NOT NULL,
                tenant_id TEXT NOT NULL,
                created_at_us BIGINT NOT NULL,
                expires_at_us BIGINT NOT NULL,
                prompt TEXT NOT NULL,
                output TEXT NOT NULL
            )""",
            """CREATE INDEX tandem_request_log_by_tenant
                ON tandem_request_log (tenant_id, created_at_us)""",
            "CREATE INDEX tandem_request_log_by_expiry ON tandem_request_log (expires_at_us)",
        ),
    ),
)
