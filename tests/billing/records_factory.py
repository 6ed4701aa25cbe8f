"""Realistic ``UsageRecord``s for billing tests, from a fixed seed.

Four days around a month boundary (2026-10-30 .. 2026-11-02 UTC), four tenants (one anonymous),
four model versions: one whose price changes mid-range, one cheap, one priced in EUR only from
the second day (so earlier requests are unpriced and one tenant has two currencies), and one
never priced. Statuses, cached tokens, idempotent record ids and records exactly on and just
before midnight all occur. Costs come from a real ``PriceBook``, as the ledger writer's do.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from billing.prices import PriceBook, PriceCard
from billing.records import RequestStatus, UsageRecord, idempotent_record_id, to_unix_us

DAY_US = 86_400_000_000
HOUR_US = 3_600_000_000
T0 = to_unix_us(datetime(2026, 10, 30, tzinfo=UTC))
"""Midnight UTC starting the records' four days; the month changes at ``T0 + 2 * DAY_US``."""
NOVEMBER_US = T0 + 2 * DAY_US

TENANTS = ("acme", "globex", "initech", "anonymous")
MODELS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # (model, model_version, deployments)
    ("llama-3.1-8b", "llama-3.1-8b@a1", ("llama-stable", "llama-canary")),
    ("smollm2-360m", "smollm2-360m@b2", ("smol",)),
    ("qwen2.5-7b", "qwen2.5-7b@c3", ("qwen",)),
    ("mistral-7b", "mistral-7b@d4", ("mistral",)),  # no price card: always unpriced
)

PRICE_BOOK = PriceBook(
    [
        PriceCard(
            "llama-3.1-8b@a1",
            T0 - DAY_US,
            Decimal("0.00015"),
            Decimal("0.0006"),
            Decimal("0.000075"),
        ),
        # A price change in the middle of a day: that day's llama requests have two cards.
        PriceCard(
            "llama-3.1-8b@a1",
            NOVEMBER_US + 12 * HOUR_US,
            Decimal("0.0002"),
            Decimal("0.0008"),
            Decimal("0.0001"),
        ),
        PriceCard(
            "smollm2-360m@b2",
            T0 - DAY_US,
            Decimal("0.00002"),
            Decimal("0.00004"),
            Decimal("0.00001"),
        ),
        PriceCard(
            "qwen2.5-7b@c3",
            T0 + DAY_US,
            Decimal("0.0001"),
            Decimal("0.0003"),
            Decimal("0.00005"),
            currency="EUR",
        ),
    ]
)

DEFAULT_CURRENCY = "USD"
"""The currency of records no card priced (the ledger writer's default)."""


def make_record(**overrides: Any) -> UsageRecord:
    """One completed, priced-looking record; ``overrides`` replace any field."""
    values: dict[str, Any] = {
        "record_id": "req-0001",
        "request_id": "chatcmpl-0001",
        "tenant_id": "acme",
        "key_id": "key-acme-1",
        "model": "llama-3.1-8b",
        "model_version": "llama-3.1-8b@a1",
        "deployment": "llama-stable",
        "endpoint": "chat",
        "path": "disaggregated",
        "status": RequestStatus.COMPLETED,
        "finish_reason": "stop",
        "error_code": None,
        "moderation_action": None,
        "prompt_tokens": 1000,
        "completion_tokens": 200,
        "cached_tokens": 400,
        "ttft_us": 120_000,
        "e2e_us": 2_000_000,
        "started_at_us": T0 + HOUR_US - 2_000_000,
        "finished_at_us": T0 + HOUR_US,
        "cost_micros": 240,
        "price_effective_from_us": T0 - DAY_US,
        "currency": "USD",
    }
    values.update(overrides)
    return UsageRecord(**values)


def make_records(count: int = 400, seed: int = 20261030) -> list[UsageRecord]:
    """``count`` records in store order ((finished_at_us, record_id)); the same for a seed."""
    rng = random.Random(seed)
    records = []
    # Every 25th record ends exactly at, or 1 us before, a midnight (one of them the month's).
    boundaries = [T0 + day * DAY_US + offset for day in (1, 2, 3) for offset in (0, -1)]
    for index in range(count):
        tenant_id = rng.choice(TENANTS)
        model, model_version, deployments = rng.choice(MODELS)
        status = rng.choices(list(RequestStatus), weights=(85, 8, 7))[0]
        prompt_tokens = rng.randint(1, 4000)
        cached_tokens = rng.choice((0, 0, rng.randint(0, prompt_tokens)))
        reached_worker = status is not RequestStatus.FAILED or rng.random() < 0.5
        completion_tokens = rng.randint(0, 1200) if reached_worker else 0
        if index % 25 == 0:
            finished_at_us = boundaries[(index // 25) % len(boundaries)]
        else:
            finished_at_us = T0 + rng.randrange(4 * DAY_US)
        e2e_us = rng.randint(50_000, 30_000_000)
        card = PRICE_BOOK.card_for(model_version, finished_at_us)
        endpoint = rng.choice(("chat", "chat", "completions"))
        record_id = (
            idempotent_record_id(tenant_id, endpoint, f"idem-key-{index}")
            if index % 7 == 0
            else f"req-{index:05d}"
        )
        records.append(
            UsageRecord(
                record_id=record_id,
                request_id=f"chatcmpl-{rng.getrandbits(64):016x}",
                tenant_id=tenant_id,
                key_id=None if tenant_id == "anonymous" else f"key-{tenant_id}-{rng.randint(1, 3)}",
                model=model,
                model_version=model_version,
                deployment=rng.choice(deployments),
                endpoint=endpoint,
                path=rng.choice(("disaggregated", "colocated", "fallback"))
                if reached_worker
                else None,
                status=status,
                finish_reason=rng.choice(("stop", "length"))
                if status is RequestStatus.COMPLETED
                else None,
                error_code="engine_error" if status is RequestStatus.FAILED else None,
                moderation_action=rng.choice((None, None, None, "flag", "redact")),
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=cached_tokens,
                ttft_us=rng.randint(20_000, 900_000) if reached_worker else None,
                e2e_us=e2e_us,
                started_at_us=finished_at_us - e2e_us,
                finished_at_us=finished_at_us,
                cost_micros=(
                    card.cost_micros(prompt_tokens, completion_tokens, cached_tokens) if card else 0
                ),
                price_effective_from_us=card.effective_from_us if card else None,
                currency=card.currency if card else DEFAULT_CURRENCY,
            )
        )
    records.sort(key=lambda record: (record.finished_at_us, record.record_id))
    return records
