"""The soak's load: closed-loop clients per tenant, and a probe that times recovery.

Every request is a streamed chat through ``bench.harness.client.send``, which checks the stream
on the way (SSE framing, ``[DONE]``, a finish reason, usage that matches what streamed) and
never raises for what the server does: each one becomes a ``RequestRecord`` with its outcome.
Clients keep going through every fault; what they saw is the checker's input.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.harness.client import send
from bench.harness.dataset import Prompt
from bench.harness.records import RequestRecord
from bench.harness.workload import PlannedRequest, Target, TenantSpec

SHORT = "Name three colours of the rainbow, then count to five."
LONG = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 40
"""Long enough for the decider to split it across the prefill and decode workers."""


@dataclass(frozen=True, slots=True)
class SoakTenant:
    name: str
    plan: dict[str, Any]
    clients: int
    long_prompts: bool
    """Long prompts go through the prefill worker and a KV transfer; short ones run colocated."""
    max_tokens: int


TENANTS = (
    SoakTenant("steady", {"weight": 1}, clients=2, long_prompts=False, max_tokens=24),
    SoakTenant("heavy", {"weight": 2}, clients=2, long_prompts=True, max_tokens=16),
    # A tight TPM (about 10 of its requests a minute), so quota refusals are part of the mix
    # and the checker has a bound to hold.
    SoakTenant("capped", {"tpm": 600}, clients=1, long_prompts=False, max_tokens=32),
)
PROBE = SoakTenant("probe", {}, clients=1, long_prompts=False, max_tokens=4)


@dataclass(slots=True)
class Sent:
    """One request as the soak saw it; times are seconds since the run's start."""

    tenant: str
    kind: str
    """``load``, ``probe`` or ``drain`` (the streams open at the graceful shutdown)."""
    long_prompt: bool
    record: RequestRecord
    done: bool = False

    @property
    def sent_s(self) -> float:
        return self.record.sent_s

    @property
    def ended_s(self) -> float:
        return self.record.sent_s + self.record.elapsed_s

    @property
    def first_token_s(self) -> float | None:
        ttft = self.record.ttft_s
        return None if ttft is None else self.record.sent_s + ttft


@dataclass
class Load:
    """The clients of every tenant, started and stopped together; ``sent`` holds every
    request (finished or not) in the order it was sent."""

    target: Target
    keys: dict[str, str]
    run_start: float
    sent: list[Sent] = field(default_factory=list)
    _session: aiohttp.ClientSession | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _stopping: asyncio.Event = field(default_factory=asyncio.Event)
    _index: Iterator[int] = field(default_factory=itertools.count)

    def now(self) -> float:
        return time.perf_counter() - self.run_start

    async def __aenter__(self) -> Load:
        # No connection limit: every client's stream runs at once, as separate callers' would.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        if self._session is not None:
            await self._session.close()

    def start(self, tenants: tuple[SoakTenant, ...]) -> None:
        for tenant in tenants:
            for _ in range(tenant.clients):
                self._tasks.append(asyncio.create_task(self._client(tenant)))

    async def stop(self) -> None:
        """Clients finish the request they are in, then stop."""
        self._stopping.set()
        tasks, self._tasks = self._tasks, []
        await asyncio.gather(*tasks)

    async def one(self, tenant: SoakTenant, kind: str) -> Sent:
        """Send one request of ``tenant`` now and wait for its end."""
        assert self._session is not None
        index = next(self._index)
        text = LONG if tenant.long_prompts else SHORT
        prompt = Prompt(text=text, tokens=len(text) // 4, output_tokens=tenant.max_tokens)
        spec = TenantSpec(tenant.name, api_key=self.keys[tenant.name])
        planned = PlannedRequest(index, spec, prompt, warmup=False, scheduled_s=None)
        record = RequestRecord(
            index, tenant.name, warmup=False, scheduled_s=None,
            max_tokens=tenant.max_tokens, expected_prompt_tokens=prompt.tokens,
        )  # fmt: skip
        sent = Sent(tenant.name, kind, tenant.long_prompts, record)
        self.sent.append(sent)
        await send(self._session, self.target, planned, record, self.run_start)
        sent.done = True
        return sent

    async def _client(self, tenant: SoakTenant) -> None:
        while not self._stopping.is_set():
            sent = await self.one(tenant, "load")
            if not sent.record.ok:
                # A refused or failed request is retried after a pause, as a client with
                # backoff would: no tight loop against a stack that is down.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 1.0)


async def probe_until_ok(load: Load, since_s: float, timeout_s: float) -> float | None:
    """Seconds from ``since_s`` to the end of the first successful probe sent after it; None
    if none succeeded within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sent = await load.one(PROBE, "probe")
        if sent.record.ok:
            return sent.ended_s - since_s
        await asyncio.sleep(0.5)
    return None
