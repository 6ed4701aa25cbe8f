"""``python -m bench.rollouts.rollback``: from a gate's failure to no candidate traffic on any
replica. Target (issue 21): p99 under 2 s.

Two gateways (``create_app`` served by uvicorn in this process, ``bench/rollouts/replicas.py``)
share one real Redis: the version registry, the traffic policies, the rollouts and the rollout
lease. Each deploys the baseline and the candidate on fake engines of its own; the candidate's
engines answer every request with a 500. Clients keep ``--clients`` non-streamed chat requests
in flight on each replica all along.

Each of ``--rollouts`` rollouts is started through replica A's admin API: one step at 50 % for
60 s, no quality check, one gate (``error_rate`` over 5 %, 20 requests a side), measured every
0.25 s. The lease holder's controller fails it as soon as its own replica has 20 requests on
each version, saves the decision and puts the baseline back at 100 % (in force there at once);
the other replica picks the policy up at its next poll of the policy revision. The rollback time
of a replica is the last moment a request of its was routed to the candidate, less the
``failed`` decision's time (``GET /admin/v1/rollouts/{id}``, ``decisions[].at``), floored at 0;
the rollout's is the slower replica's. Measured twice:

- *engine*: the first arrival of each request id at that replica's candidate engine (the gateway
  re-sends a failed request once; only the first arrival counts): when the gateway routed it;
- *client*: when the client sent a request the gateway answered with the candidate's name in
  ``x-tandem-model-version`` (an error response carries the header too): a few milliseconds
  earlier than the routing itself.

Then the load runs on for ``--settle-s`` (longer while a replica still routes to the candidate)
and the next rollout starts from the baseline at 100 %, where the failed one left it.

What to expect: on the deciding replica, the controller's pass that made the decision saves it
and puts the policy (a few Redis round trips: milliseconds); on the other replica, its next poll
of the policy revision, every 0.5 s: up to 0.5 s, about 0.25 s on average. The decision's time is
taken at the start of the controller's pass, so the figures include that pass's measurement.
Everything runs on one event loop (the gateways, engines and clients): the loop's lag while the
rollouts ran is printed too, as it adds to every figure.

    .venv/bin/python -m bench.rollouts.rollback [--rollouts 30] [--clients 8] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from bench.loop_lag import LoopLag
from bench.overhead.fake_vllm import Timing
from bench.rollouts.replicas import (
    ADMIN_KEY,
    ALIAS,
    NoRedisError,
    Replica,
    Replicas,
    check_redis,
    replicas,
)
from bench.rollouts.replicas import redis_server as local_redis
from bench.stats import percentile

ENGINE_TIMING = Timing(num_tokens=8, itl_s=0.010, ttft_s=0.030)
"""A baseline answer takes 0.1 s; the candidate's 500 is immediate."""
GATE = {"kind": "error_rate", "max_value": 0.05, "min_samples": 20}
STEP = {"weight": 50, "bake_s": 60}
INTERVAL_S = 0.25
FAIL_TIMEOUT_S = 60.0
"""A rollout not failed by then is reported as such (and aborted)."""
STILL_ROUTED_S = 30.0
"""Past this after the failure, a replica that still routes to the candidate is reported."""
QUIET_S = 1.0
"""Settled: no request routed to the candidate for this long."""
WARMUP_S = 2.0


@dataclass(frozen=True, slots=True)
class Sent:
    """One client request."""

    replica: str
    started_at: float
    """``time.time()`` when the client sent it."""
    version: str | None
    """``x-tandem-model-version`` of the answer (None: not there)."""
    status: int


@dataclass
class Load:
    """``clients`` requests in flight on each replica, each answer noted in ``sent``."""

    stack: Replicas
    api_key: str
    clients: int
    sent: list[Sent] = field(default_factory=list)
    transport_errors: int = 0
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _sessions: list[aiohttp.ClientSession] = field(default_factory=list)

    async def start(self) -> None:
        for replica in self.stack.replicas:
            session = aiohttp.ClientSession(
                base_url=replica.base_url,
                headers={"Authorization": f"Bearer {self.api_key}"},
                timeout=aiohttp.ClientTimeout(total=30),
            )
            self._sessions.append(session)
            self._tasks += [
                asyncio.create_task(self._client(replica, session, i), name=f"bench-client-{i}")
                for i in range(self.clients)
            ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for session in self._sessions:
            await session.close()

    def last_on(self, replica: str, version: str, since: float) -> float | None:
        """When the latest request sent to ``replica`` since ``since`` and named ``version``
        was sent."""
        return max(
            (
                s.started_at
                for s in self.sent
                if s.replica == replica and s.version == version and s.started_at >= since
            ),
            default=None,
        )

    async def _client(self, replica: Replica, session: aiohttp.ClientSession, i: int) -> None:
        n = 0
        while True:
            n += 1
            body = {
                "model": ALIAS,
                "messages": [{"role": "user", "content": f"client {i} request {n}"}],
                "max_tokens": 8,
            }
            started_at = time.time()
            try:
                async with session.post("/v1/chat/completions", json=body) as response:
                    await response.read()
                    version = response.headers.get("x-tandem-model-version")
                    self.sent.append(Sent(replica.name, started_at, version, response.status))
            except (aiohttp.ClientError, TimeoutError):
                self.transport_errors += 1
                await asyncio.sleep(0.1)


@dataclass(frozen=True, slots=True)
class RolloutResult:
    """One rollout's figures (seconds)."""

    rollout_id: str
    status: str
    decided_by: str | None
    """The replica holding the lease when the rollout failed."""
    to_failure_s: float | None
    """From the admin call to the ``failed`` decision."""
    engine_s: dict[str, float | None] = field(default_factory=dict)
    """Replica -> rollback time seen by its candidate engine (None: no candidate request)."""
    client_s: dict[str, float | None] = field(default_factory=dict)
    """Replica -> rollback time seen by its clients."""
    still_routed: tuple[str, ...] = ()
    """Replicas still routing to the candidate ``STILL_ROUTED_S`` after the failure."""

    @staticmethod
    def slowest(by_replica: dict[str, float | None]) -> float | None:
        values = [value for value in by_replica.values() if value is not None]
        return max(values) if values else None


@contextlib.asynccontextmanager
async def admin(replica: Replica) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(
        base_url=replica.base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    ) as client:
        yield client


async def tenant_key(client: httpx.AsyncClient) -> str:
    """A tenant with limits far above the load, and a fresh key of it."""
    plan = {"name": "bench-rollback", "tpm": 10**12, "rpm": 10**9, "max_concurrent": 10**6}
    created = await client.post("/admin/v1/tenants", json=plan)
    if created.status_code not in (201, 409):
        raise RuntimeError(f"creating the tenant: {created.status_code} {created.text}")
    issued = await client.post("/admin/v1/tenants/bench-rollback/keys", json={})
    if issued.status_code != 201:
        raise RuntimeError(f"issuing a key: {issued.status_code} {issued.text}")
    return str(issued.json()["key"])


async def one_rollout(
    stack: Replicas, load: Load, client: httpx.AsyncClient, index: int, settle_s: float
) -> RolloutResult:
    """Start one rollout through ``client`` (replica A's admin API), wait for its failure and
    for the traffic to settle; its figures."""
    body = {
        "alias": ALIAS,
        "baseline": stack.baseline,
        "candidate": stack.candidate,
        "steps": [STEP],
        "gates": [GATE],
        "interval_s": INTERVAL_S,
        "quality": {"enabled": False},
        "reason": f"bench rollback {index}",
    }
    started_at = time.time()
    created = await client.post("/admin/v1/rollouts", json=body)
    if created.status_code != 201:
        raise RuntimeError(f"starting rollout {index}: {created.status_code} {created.text}")
    rollout_id = str(created.json()["id"])
    shown = await _until_ended(client, rollout_id)
    failed = [d for d in shown["decisions"] if d["event"] == "failed"]
    if shown["status"] != "failed" or not failed:
        return RolloutResult(rollout_id, str(shown["status"]), None, None)
    decided_by = await stack.lease_holder()
    failed_at = float(failed[0]["at"])
    still = await _settle(stack, load, started_at, failed_at, settle_s)
    engine_s: dict[str, float | None] = {}
    client_s: dict[str, float | None] = {}
    for replica in stack.replicas:
        last_routed = replica.candidate.last_arrival(started_at)
        last_sent = load.last_on(replica.name, stack.candidate, started_at)
        engine_s[replica.name] = None if last_routed is None else max(0.0, last_routed - failed_at)
        client_s[replica.name] = None if last_sent is None else max(0.0, last_sent - failed_at)
    return RolloutResult(
        rollout_id, "failed", decided_by, failed_at - started_at, engine_s, client_s, still
    )


async def _until_ended(client: httpx.AsyncClient, rollout_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + FAIL_TIMEOUT_S
    while True:
        shown: dict[str, Any] = (await client.get(f"/admin/v1/rollouts/{rollout_id}")).json()
        if shown["status"] not in ("running", "paused"):
            return shown
        if time.monotonic() > deadline:
            await client.post(f"/admin/v1/rollouts/{rollout_id}/abort", json={"reason": "bench"})
            return shown
        await asyncio.sleep(0.05)


async def _settle(
    stack: Replicas, load: Load, started_at: float, failed_at: float, settle_s: float
) -> tuple[str, ...]:
    """Wait ``settle_s`` after the failure, and on while a replica routed a request to the
    candidate in the last ``QUIET_S`` (up to ``STILL_ROUTED_S``); the replicas still doing so."""
    while True:
        now = time.time()
        recent = tuple(
            replica.name
            for replica in stack.replicas
            if (replica.candidate.last_arrival(started_at) or 0.0) > now - QUIET_S
        )
        if now >= failed_at + settle_s and not recent:
            return ()
        if now >= failed_at + STILL_ROUTED_S:
            return recent
        await asyncio.sleep(0.1)


def _figures(values: Sequence[float]) -> str:
    if not values:
        return "no figures"
    return (
        f"p50 {percentile(list(values), 50):.3f}  p90 {percentile(list(values), 90):.3f}  "
        f"p99 {percentile(list(values), 99):.3f}  max {max(values):.3f} s  (n={len(values)})"
    )


def report(results: Sequence[RolloutResult], lags_s: Sequence[float], names: Sequence[str]) -> None:
    """The per-rollout lines were printed as they came; the summary."""
    done = [r for r in results if r.status == "failed"]
    print(f"\n{len(done)} of {len(results)} rollouts failed and were rolled back.")
    others = [r for r in results if r.status != "failed"]
    if others:
        print(f"  not failed: {', '.join(f'{r.rollout_id} {r.status}' for r in others)}")
    still = [r for r in done if r.still_routed]
    if still:
        print(
            f"  STILL ROUTED to the candidate {STILL_ROUTED_S:.0f} s after the failure: "
            + ", ".join(f"{r.rollout_id} on {', '.join(r.still_routed)}" for r in still)
        )
    deciders = {name: sum(r.decided_by == name for r in done) for name in names}
    print("  decided by: " + ", ".join(f"{name} {count}" for name, count in deciders.items()))
    never = {name: sum(r.engine_s.get(name) is None for r in done) for name in names}
    if any(never.values()):
        print(
            "  no request routed to the candidate at all: "
            + ", ".join(f"{name} in {count}" for name, count in never.items() if count)
            + " (the failure came before that replica's policy poll saw the canary step: those "
            "rollouts' figures are the other replica's)"
        )
    for how in ("engine", "client"):
        seen = [(r, r.engine_s if how == "engine" else r.client_s) for r in done]
        slowest = [v for _, by in seen if (v := RolloutResult.slowest(by)) is not None]
        deciding = [
            v for r, by in seen if r.decided_by is not None
            and (v := by.get(r.decided_by)) is not None
        ]  # fmt: skip
        other = [
            v for r, by in seen for name, v in by.items()
            if name != r.decided_by and v is not None
        ]  # fmt: skip
        print(f"\nrollback time ({how} side), failure decision -> last request to the candidate:")
        print(f"  all replicas (the rollout's): {_figures(slowest)}")
        print(f"  the deciding replica:         {_figures(deciding)}")
        print(f"  the other replica:            {_figures(other)}")
    to_failure = [r.to_failure_s for r in done if r.to_failure_s is not None]
    print(f"\nrollout start -> failed decision: {_figures(to_failure)}")
    if lags_s:
        print(
            f"event loop lag (10 ms sleeps): p50 {1000 * percentile(list(lags_s), 50):.1f}  "
            f"p99 {1000 * percentile(list(lags_s), 99):.1f}  max {1000 * max(lags_s):.1f} ms"
        )
    print(
        "expected: the deciding replica within its pass (save + put: Redis round trips); the "
        "other at its next policy poll (every 0.5 s: up to 0.5 s, about 0.25 s on average); "
        "target p99 < 2 s"
    )


async def run(redis_url: str, num_rollouts: int, clients: int, settle_s: float) -> int:
    async with replicas(redis_url, timing=ENGINE_TIMING) as stack:
        for replica in stack.replicas:
            replica.candidate.failing = True
        names = [replica.name for replica in stack.replicas]
        holder = await stack.lease_holder()
        print(
            f"replicas {', '.join(f'{r.name} {r.base_url}' for r in stack.replicas)} on "
            f"{redis_url}; lease held by {holder}; {clients} clients per replica; "
            f"baseline {stack.baseline}, candidate {stack.candidate} (fails every request)"
        )
        results: list[RolloutResult] = []
        lag = LoopLag()
        async with admin(stack.replicas[0]) as client:
            load = Load(stack, await tenant_key(client), clients)
            await load.start()
            try:
                await asyncio.sleep(WARMUP_S)
                lag.start()
                for index in range(num_rollouts):
                    result = await one_rollout(stack, load, client, index, settle_s)
                    results.append(result)
                    _print_one(index, result)
            finally:
                await lag.aclose()
                await load.aclose()
        served = sum(1 for s in load.sent if s.status == 200)
        print(
            f"\nclient requests: {len(load.sent)} ({served} answered 200, "
            f"{len(load.sent) - served} errors, {load.transport_errors} transport errors)"
        )
        report(results, lag.lags_s, names)
        return 0 if all(r.status == "failed" and not r.still_routed for r in results) else 1


def _print_one(index: int, result: RolloutResult) -> None:
    if result.status != "failed":
        print(f"{index:3d} {result.rollout_id}: {result.status}, not failed")
        return

    def text(by_replica: dict[str, float | None]) -> str:
        return " ".join(f"{k} {'-' if v is None else f'{v:.3f}'}" for k, v in by_replica.items())

    print(
        f"{index:3d} {result.rollout_id}: decided by {result.decided_by}, failed "
        f"{result.to_failure_s:.2f} s after start; rollback engine [{text(result.engine_s)}] "
        f"client [{text(result.client_s)}] s"
        + (f"; STILL ROUTED on {', '.join(result.still_routed)}" if result.still_routed else "")
    )
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollouts.rollback",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--rollouts", type=int, default=30, help="rollouts to fail (R)")
    parser.add_argument("--clients", type=int, default=8, help="requests in flight per replica")
    parser.add_argument(
        "--redis-url",
        help="a Redis database of its own (default: start redis-server from PATH on a free port)",
    )
    parser.add_argument(
        "--settle-s", type=float, default=3.0, help="load after each failure before the next"
    )
    args = parser.parse_args(argv)
    if args.rollouts < 1 or args.clients < 1:
        parser.error("--rollouts and --clients must be at least 1")
    # Every request to the broken candidate logs a warning or two; the controller's log stays.
    # Restored after: the smoke test runs this in pytest's process.
    tandem_log = logging.getLogger("tandem")
    level = tandem_log.level
    tandem_log.setLevel(logging.ERROR)
    try:
        if args.redis_url:
            check_redis(args.redis_url)
            return asyncio.run(run(args.redis_url, args.rollouts, args.clients, args.settle_s))
        with local_redis() as url:
            return asyncio.run(run(url, args.rollouts, args.clients, args.settle_s))
    except NoRedisError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        tandem_log.setLevel(level)


if __name__ == "__main__":
    raise SystemExit(main())
