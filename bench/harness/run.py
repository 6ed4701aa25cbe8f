"""One benchmark run end to end: plan the requests from the seed, send them, summarise."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from bench.harness.arrivals import LoadShape
from bench.harness.client import TokenCount
from bench.harness.dataset import LengthDistribution, Prompt, chat_prompts, synthetic_prompts
from bench.harness.records import RequestRecord
from bench.harness.result import RunResult
from bench.harness.runner import execute
from bench.harness.summary import Slos, summarize, summarize_by_tenant
from bench.harness.workload import PlannedRequest, Target, TenantSpec, assign_tenants


class DatasetKind(enum.StrEnum):
    SYNTHETIC = "synthetic"
    """Prompts of sampled token lengths from natural text (optionally with shared prefixes)."""
    CHAT = "chat"
    """The realistic chat prompts shipped in ``bench/harness/data``."""


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    kind: DatasetKind = DatasetKind.SYNTHETIC
    input_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution.parse("fixed:256")
    )
    output_len: LengthDistribution = field(
        default_factory=lambda: LengthDistribution.parse("fixed:64")
    )
    shared_prefix_tokens: int = 0
    prefix_groups: int = 1

    def prompts(
        self, tokenizer: Tokenizer, rng: np.random.Generator, n: int, tenant: TenantSpec
    ) -> list[Prompt]:
        output_len = tenant.output_len or self.output_len
        if self.kind is DatasetKind.CHAT:
            return chat_prompts(tokenizer, rng, n, output_len)
        return synthetic_prompts(
            tokenizer,
            rng,
            n,
            tenant.input_len or self.input_len,
            output_len,
            shared_prefix_tokens=self.shared_prefix_tokens,
            prefix_groups=self.prefix_groups,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "input_len": self.input_len.describe(),
            "output_len": self.output_len.describe(),
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "prefix_groups": self.prefix_groups,
        }


@dataclass(frozen=True, slots=True)
class RunConfig:
    target: Target
    shape: LoadShape
    num_requests: int = 100
    warmup_requests: int = 0
    seed: int = 0
    dataset: DatasetSpec = field(default_factory=DatasetSpec)
    tenants: tuple[TenantSpec, ...] = (TenantSpec("default"),)
    slos: Slos = field(default_factory=Slos)
    slo_attainment: float = 0.9
    """Share of requests that must meet the SLOs for a sweep point to pass."""
    check_token_counts: bool = True
    """Flag usage far from the re-tokenised streamed text as malformed."""
    label: str = "run"

    def with_shape(self, shape: LoadShape, label: str) -> RunConfig:
        return dataclasses.replace(self, shape=shape, label=label)

    def to_dict(self) -> dict[str, Any]:
        target = self.target
        return {
            "target": {
                "base_url": target.base_url,
                "url": target.url,
                "model": target.model,
                "api": str(target.api),
                "ignore_eos": target.ignore_eos,
                "timeout_s": target.timeout_s,
                "extra_body": target.extra_body,
            },
            "shape": self.shape.to_dict(),
            "shape_description": self.shape.describe(),
            "num_requests": self.num_requests,
            "warmup_requests": self.warmup_requests,
            "seed": self.seed,
            "dataset": self.dataset.to_dict(),
            "tenants": [t.to_dict() for t in self.tenants],
            "slos": self.slos.to_dict(),
            "slo_attainment": self.slo_attainment,
            "check_token_counts": self.check_token_counts,
        }


@dataclass(frozen=True, slots=True)
class Plan:
    warmup: list[PlannedRequest]
    measured: list[PlannedRequest]


def build_plan(config: RunConfig, tokenizer: Tokenizer) -> Plan:
    """Every request of the run, fixed by the seed before anything is sent.

    Independent random streams for tenants, each tenant's prompts and the arrivals, so changing
    one (say, another tenant's length distribution) does not reshuffle the others.
    """
    tenants = list(config.tenants)
    streams = np.random.SeedSequence(config.seed).spawn(3 + len(tenants))
    picks_rng, warmup_rng, arrivals_rng = (np.random.default_rng(s) for s in streams[:3])
    total = config.warmup_requests + config.num_requests
    assigned = assign_tenants(tenants, total, picks_rng)
    prompts_by_tenant: dict[str, list[Prompt]] = {}
    for tenant, stream in zip(tenants, streams[3:], strict=True):
        count = sum(1 for t in assigned if t is tenant)
        prompts = config.dataset.prompts(tokenizer, np.random.default_rng(stream), count, tenant)
        prompts_by_tenant[tenant.name] = prompts[::-1]  # popped from the end, in order
    warmup_offsets = config.shape.offsets(config.warmup_requests, warmup_rng)
    offsets = config.shape.offsets(config.num_requests, arrivals_rng)
    planned = [
        PlannedRequest(
            index=i,
            tenant=tenant,
            prompt=prompts_by_tenant[tenant.name].pop(),
            warmup=i < config.warmup_requests,
            scheduled_s=(
                warmup_offsets[i]
                if i < config.warmup_requests
                else offsets[i - config.warmup_requests]
            ),
        )
        for i, tenant in enumerate(assigned)
    ]
    return Plan(planned[: config.warmup_requests], planned[config.warmup_requests :])


def token_counter(tokenizer: Tokenizer) -> TokenCount:
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


async def run_benchmark(
    config: RunConfig,
    tokenizer: Tokenizer,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Warm up (results kept in the records, flagged, excluded from every figure), then measure."""
    plan = build_plan(config, tokenizer)
    count = token_counter(tokenizer) if config.check_token_counts else None
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    concurrency = config.shape.max_concurrency
    warmup = await execute(
        config.target, plan.warmup, max_concurrency=concurrency, count_tokens=count, on_done=on_done
    )
    measured = await execute(
        config.target,
        plan.measured,
        max_concurrency=concurrency,
        count_tokens=count,
        on_done=on_done,
    )
    summary = summarize(measured, config.slos)
    return RunResult(
        label=config.label,
        config=config.to_dict(),
        summary=summary,
        tenants=summarize_by_tenant(measured, config.slos, summary.duration_s),
        records=warmup + measured,
        started_at=started_at,
    )
