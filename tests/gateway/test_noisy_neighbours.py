"""Noisy neighbours through the gateway and into the engine: bands reach a decode engine that
runs vLLM's priority scheduling with a small KV cache (the fake's ``kv_capacity_seqs``), so
interactive bursts preempt batch streams, which pause and resume intact; a batch backlog is
not starved by a steady interactive stream; tenants of one band share by weight; a lone batch
tenant uses the whole capacity. Every request ends completed or with an error its client saw.
"""

from __future__ import annotations

import asyncio
import csv
import io
import itertools
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from openai.types import CompletionUsage

from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from gateway.serving.gate import GateConfig
from tests.gateway.conftest import (
    ADMIN_KEY,
    MODEL,
    FakeStack,
    make_fake_stack,
    task_stacks,
    wait_until,
)

CAP = 4
"""The gateway's in-flight cap (one decode worker)."""
HEADROOM = 0.25
"""Interactive work may go this fraction past the cap (the gateway's default): one more."""
TOKEN_DELAY_S = 0.02
OUTPUT_TOKENS = 20
"""Words per answer; with EOS, 21 tokens: about 0.4 s of streaming."""
SCENARIO_LIMIT_S = 30.0
"""A hang guard, not a speed target (speed lives in bench/noisy_neighbours.py): the whole file
takes about 15 s alone. Twice in full-suite runs a backlog scenario ran past its limit; the
reports then showed every engine and the admission queue idle, but were read after the scenario
had been cancelled. ``_within`` now reads them before cancelling, so a next time says where the
requests were."""

T = TypeVar("T")


@dataclass
class Outcome:
    """What one client saw of one streamed request."""

    tenant: str
    prompt: str
    id: str = ""
    tokens: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    """When each token arrived (monotonic seconds)."""
    usage: CompletionUsage | None = None
    finish_reason: str | None = None
    status: int | None = None
    """HTTP status of a refusal (None: the stream was accepted)."""
    error: str | None = None
    ended_at: float = 0.0

    @property
    def completed(self) -> bool:
        return self.error is None and self.finish_reason is not None and self.usage is not None

    @property
    def longest_pause_s(self) -> float:
        """The longest wait between two of its tokens."""
        times = self.token_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


@asynccontextmanager
async def _stack(
    tmp_path: Path, *, kv_capacity_seqs: int = CAP, headroom: float = HEADROOM
) -> AsyncIterator[FakeStack]:
    """One decode engine under priority scheduling whose KV fits ``kv_capacity_seqs`` requests,
    behind a gateway that admits ``CAP`` at once (interactive: plus ``headroom``)."""
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        max_in_flight_per_worker=CAP,
        interactive_headroom=headroom,
        gate=GateConfig(engine_priority=True),
    )
    async with make_fake_stack(access=access, decode_idle_timeout_s=5) as stack:
        for engine in (*stack.prefills, *stack.decodes):
            engine.scheduling_policy = "priority"
        stack.decode.kv_capacity_seqs = kv_capacity_seqs
        stack.decode.token_delay_s = TOKEN_DELAY_S
        stack.decode.output_tokens = OUTPUT_TOKENS
        yield stack


async def _stream(
    client: openai.AsyncOpenAI, tenant: str, prompt: str, max_tokens: int = 2 * OUTPUT_TOKENS
) -> Outcome:
    """Stream one chat answer with its usage chunk; errors are recorded, not raised."""
    out = Outcome(tenant, prompt)
    try:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            out.id = chunk.id
            for choice in chunk.choices:
                if choice.delta.role is None and choice.delta.content is not None:
                    out.tokens.append(choice.delta.content)
                    out.token_times.append(time.monotonic())
                out.finish_reason = choice.finish_reason or out.finish_reason
            out.usage = chunk.usage or out.usage
    except openai.APIStatusError as exc:
        out.status, out.error = exc.status_code, str(exc)
    except openai.APIError as exc:  # an error event after the stream started, or a cut
        out.error = str(exc)
    out.ended_at = time.monotonic()
    return out


def _threads_report() -> str:
    """Where the event loop's worker threads are (store calls, CLI calls run there): a
    request stuck before admission may be waiting for one."""
    loop = asyncio.get_running_loop()
    executor = getattr(loop, "_default_executor", None)
    if executor is None:
        return "; no default executor"
    frames = sys._current_frames()
    stacks = []
    for thread in list(executor._threads):
        frame = frames.get(thread.ident or -1)
        where = traceback.format_stack(frame)[-3:] if frame is not None else ["(gone)"]
        stacks.append(f"{thread.name}:\n" + "".join(where))
    queued = executor._work_queue.qsize()
    return f"; executor: {len(stacks)} threads, {queued} calls queued\n" + "\n".join(stacks)


async def _within(awaitable: Awaitable[T], what: str, stack: FakeStack | None = None) -> T:
    """``awaitable``'s result; past the limit, an assertion naming where requests were stuck.
    The report is taken before ``awaitable`` is cancelled (``wait_for`` would cancel it first,
    and its requests would have left the gateway, the queue and the engines by then)."""
    future = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({future}, timeout=SCENARIO_LIMIT_S)
    if not done:
        where = ""
        if stack is not None:
            text = (await stack.admin.get("/metrics")).text
            gauges = [line for line in text.splitlines() if line.startswith("tandem_admission_")]
            engines = {
                f"{e.role}-{i}": (e.stats.num_running, e.stats.num_waiting)
                for pool in (stack.prefills, stack.decodes)
                for i, e in enumerate(pool)
            }
            where = f"; engines (running, waiting): {engines}; gateway: {gauges}"
            where += _threads_report()
        where += "\ntasks:\n" + task_stacks()
        future.cancel()
        await asyncio.wait({future})
        raise AssertionError(f"{what} did not finish within {SCENARIO_LIMIT_S} s{where}")
    return future.result()


async def _ledger(stack: FakeStack) -> dict[str, dict[str, str]]:
    """The billed requests by request id (the export flushes the ledger first)."""
    today = datetime.now(UTC).date()
    period = {"from": str(today - timedelta(days=1)), "to": str(today + timedelta(days=2))}
    response = await stack.admin.get(
        "/admin/v1/billing/export", params={**period, "kind": "requests", "format": "csv"}
    )
    assert response.status_code == 200, response.text
    rows = list(csv.DictReader(io.StringIO(response.text)))
    by_id = {row["request_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a request was billed twice"
    return by_id


async def _assert_none_lost(stack: FakeStack, outcomes: list[Outcome]) -> None:
    """Every request completed (none failed: zero 5xx, no error event), its final usage is the
    tokens it streamed, and the ledger charged exactly those once."""
    failed = [(o.prompt, o.status, o.error) for o in outcomes if not o.completed]
    assert not [f for f in failed if f[1] is not None and f[1] >= 500], failed
    assert not failed, failed
    ledger = await _ledger(stack)
    for o in outcomes:
        assert o.usage is not None
        assert o.usage.completion_tokens == len(o.tokens), o.prompt
        row = ledger[o.id.removeprefix("chatcmpl-")]
        assert row["status"] == "completed"
        assert int(row["completion_tokens"]) == o.usage.completion_tokens
        assert int(row["prompt_tokens"]) == o.usage.prompt_tokens
    assert stack.decode.stats.num_running == stack.decode.stats.num_waiting == 0


async def test_an_interactive_storm_preempts_batch_streams_which_finish_intact(
    tmp_path: Path,
) -> None:
    async with _stack(tmp_path) as stack:
        bulk = stack.client_for(await stack.new_tenant("bulk", band="batch"))
        chat = stack.client_for(await stack.new_tenant("chat", band="interactive"))

        async def batch_worker(w: int) -> list[Outcome]:
            return [await _stream(bulk, "bulk", f"bulk job {w}-{k}") for k in range(3)]

        async def bursts() -> list[Outcome]:
            await wait_until(lambda: stack.decode.stats.num_running == CAP)  # batch fills it
            outcomes: list[Outcome] = []
            for b in range(3):  # each burst alone is past the engine's KV capacity
                burst = [_stream(chat, "chat", f"chat question {b}-{i}") for i in range(CAP)]
                outcomes += await asyncio.gather(*burst)
            return outcomes

        async def scenario() -> tuple[list[list[Outcome]], list[Outcome]]:
            workers = asyncio.gather(*(batch_worker(w) for w in range(CAP)))
            return await asyncio.gather(workers, bursts())

        batch_runs, interactive = await _within(scenario(), "the storm", stack)
        batch = [o for run in batch_runs for o in run]
        decode = stack.decode
        preemptions = decode.stats.num_preemptions
        assert preemptions > 0
        # The same requests again, with no interactive work about: none is preempted.
        decode.token_delay_s = 0
        async with bulk, chat:
            again = await asyncio.gather(*(_stream(bulk, "bulk", o.prompt) for o in batch))
        assert decode.stats.num_preemptions == preemptions
        alone = {o.prompt: o for o in again}
        async with httpx.AsyncClient() as http:
            engine_metrics = (await http.get(f"{decode.base_url}/metrics")).text
        counter = f'vllm:num_preemptions_total{{engine="0",model_name="{MODEL}"}}'
        assert f"{counter} {float(decode.stats.num_preemptions)}" in engine_metrics
        # Only batch work was preempted: every preempted request ranked below all interactive.
        records = [r for r in decode.stats.requests if "priority" in r["body"]]
        preempted = [r for r in records if r["num_preemptions"]]
        interactive_priority = max(r["body"]["priority"] for r in records if _is_chat(r))
        assert preempted and all(not _is_chat(r) for r in preempted)
        assert min(r["body"]["priority"] for r in preempted) > interactive_priority
        # The clients saw it as a pause (a preempted stream waits out an interactive answer)...
        assert max(o.longest_pause_s for o in batch) > 5 * TOKEN_DELAY_S
        # ...and so does the operator: the worker's preemptions and the batch band's pauses.
        async with httpx.AsyncClient() as http:
            gateway_metrics = (await http.get(f"{stack.base_url}/metrics")).text
        assert (
            f'tandem_worker_preemptions_total{{worker="decode-ext-0",role="decode"}} '
            f"{float(preemptions)}" in gateway_metrics
        )
        pauses = _histogram_sum(gateway_metrics, "tandem_stream_longest_pause_seconds", "batch")
        assert pauses >= max(o.longest_pause_s for o in batch) - 0.05
        # ...and each batch stream, preempted or not, says exactly what it says served alone.
        for o in batch:
            assert o.completed, (o.prompt, o.error)
            assert o.tokens == alone[o.prompt].tokens, o.prompt
            assert o.usage == alone[o.prompt].usage
        await _assert_none_lost(stack, batch + interactive + list(alone.values()))


def _histogram_sum(metrics: str, name: str, band: str) -> float:
    prefix = f'{name}_sum{{band="{band}"}} '
    [line] = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))


def _is_chat(record: dict[str, Any]) -> bool:
    return "chat question" in str(record["body"]["messages"])


@pytest.mark.parametrize("headroom", [0.0, HEADROOM], ids=["no-headroom", "headroom"])
async def test_a_batch_backlog_is_served_while_interactive_traffic_never_stops(
    tmp_path: Path, headroom: float
) -> None:
    async with _stack(tmp_path, headroom=headroom) as stack:
        bulk = stack.client_for(await stack.new_tenant("bulk", band="batch"))
        chat = stack.client_for(await stack.new_tenant("chat", band="interactive"))
        stop = asyncio.Event()

        async def interactive_worker(w: int) -> list[Outcome]:
            outcomes: list[Outcome] = []
            while not stop.is_set():
                prompt = f"chat {w}-{len(outcomes)}"
                outcomes.append(await _stream(chat, "chat", prompt, max_tokens=8))
            return outcomes

        # More interactive clients than the cap and its headroom: their queue never empties,
        # so with strict bands the batch backlog would wait for as long as they keep sending.
        load = asyncio.gather(*(interactive_worker(w) for w in range(2 * CAP)))
        await wait_until(lambda: stack.decode.stats.num_running == CAP)
        backlog = asyncio.ensure_future(
            asyncio.gather(*(_stream(bulk, "bulk", f"bulk job {k}") for k in range(3)))
        )
        bound_s = 5.0  # unloaded, the backlog takes under 0.5 s; here about 2 s
        served_in_time, _ = await asyncio.wait({backlog}, timeout=bound_s)
        stop.set()  # only now: the whole backlog ran against a steady interactive stream
        interactive = [o for run in await _within(load, "the interactive load", stack) for o in run]
        batch = await _within(backlog, "the backlog, once the interactive load stopped", stack)
        assert served_in_time, (
            f"the batch backlog starved: it did not finish within {bound_s} s while "
            f"{len(interactive)} interactive requests were served"
        )
        assert len(interactive) > 10  # and the interactive tenant was served meanwhile
        await _assert_none_lost(stack, batch + interactive)


async def test_interactive_tenants_share_by_weight(tmp_path: Path) -> None:
    async with _stack(tmp_path) as stack:
        weights = {"light-a": 1.0, "light-b": 1.0, "heavy": 2.0}
        clients = {
            name: stack.client_for(await stack.new_tenant(name, band="interactive", weight=w))
            for name, w in weights.items()
        }
        window_s = 3.0
        start = time.monotonic()

        async def worker(name: str, w: int) -> list[Outcome]:
            outcomes: list[Outcome] = []
            while time.monotonic() - start < window_s:
                prompt = f"{name} asks {w}-{len(outcomes)}"
                outcomes.append(await _stream(clients[name], name, prompt, max_tokens=6))
            return outcomes

        # Each tenant alone could fill the cap and its headroom: all three stay backlogged.
        runs = await _within(
            asyncio.gather(*(worker(name, w) for name in weights for w in range(CAP + 2))),
            "the three tenants' load",
            stack,
        )
        outcomes = [o for run in runs for o in run]
        for client in clients.values():
            await client.close()
        # Tokens served per tenant in the window, once all three were backlogged.
        settled = start + 0.5
        served = {
            name: sum(
                settled < t < start + window_s
                for o in outcomes
                if o.tenant == name
                for t in o.token_times
            )
            for name in weights
        }
        total = sum(served.values())
        assert min(served.values()) > 0.1 * total, served  # nobody starved
        share = {name: served[name] / total for name in weights}
        assert 0.40 < share["heavy"] < 0.60, share  # weight 2 of 4: half
        for light in ("light-a", "light-b"):
            assert 0.18 < share[light] < 0.32, share  # weight 1 of 4: a quarter
        await _assert_none_lost(stack, outcomes)


async def test_a_lone_batch_tenant_uses_the_whole_capacity(tmp_path: Path) -> None:
    async with _stack(tmp_path) as stack:
        bulk = stack.client_for(await stack.new_tenant("bulk", band="batch"))
        decode = stack.decode
        outstanding = 0
        samples: list[tuple[int, int, int]] = []  # (client outstanding, running, waiting)

        async def one(k: int) -> Outcome:
            nonlocal outstanding
            outstanding += 1
            try:
                return await _stream(bulk, "bulk", f"bulk job {k}")
            finally:
                outstanding -= 1

        async def sample() -> None:
            while True:
                samples.append((outstanding, decode.stats.num_running, decode.stats.num_waiting))
                await asyncio.sleep(0.005)

        sampler = asyncio.create_task(sample())
        try:
            batch = await _within(
                asyncio.gather(*(one(k) for k in range(2 * CAP))), "the batch tenant's load", stack
            )
        finally:
            sampler.cancel()
        await bulk.close()

        # Batch work reaches the cap, never the interactive headroom past it, and the engine
        # runs all of it: nothing waits there, nothing is preempted.
        assert max(running for _, running, _ in samples) == CAP
        assert max(waiting for _, _, waiting in samples) == 0
        assert decode.stats.num_preemptions == 0
        # While more than the cap was outstanding, the engine stayed (about) full: a slot that
        # freed went to the next queued request at once.
        busy = [running for outstanding_, running, _ in samples if outstanding_ > CAP]
        assert busy and sum(busy) / len(busy) > 0.75 * CAP, busy
        # The first CAP were admitted without queueing; the rest waited for a slot.
        text = (await stack.admin.get("/metrics")).text
        assert _bucket(text, "tandem_queue_wait_seconds", 'band="batch",le="0.01"') >= CAP
        assert _bucket(text, "tandem_queue_wait_seconds", 'band="batch",le="+Inf"') == 2 * CAP
        await _assert_none_lost(stack, batch)


def _bucket(metrics: str, name: str, labels: str) -> float:
    [line] = [ln for ln in metrics.splitlines() if ln.startswith(f"{name}_bucket{{{labels}}}")]
    return float(line.split()[-1])
