"""The fault loop: one real fault at a time, each timed until the stack serves again.

Kinds, in the order one cycle injects them:

- ``redis-restart``: Redis stopped (SIGTERM, its append-only file written) and started again
  after 2 s. Quotas fail closed meanwhile: 503 ``store_unavailable``.
- ``postgres-restart``: the ledger's PostgreSQL stopped (fast shutdown) for 5 s; records wait
  in each gateway's spool and are written once it is back.
- ``gateway-kill``: SIGKILL of gateway process 1 while streams run; its clients see the
  connection cut, ``tandem up`` restarts it on the same sockets.
- ``decode-freeze``: the decode worker stopped (SIGSTOP) for 5 s and continued: a link that
  stops answering without closing, as a partition or a stalled host looks from the gateway.
- ``prefill-kill``: SIGKILL of the prefill worker while a long prompt is in its leg (the KV
  transfer's producer dies); the decode worker recomputes, or the client gets an error.
- ``decode-kill``: SIGKILL of the decode worker while streams run mid-answer.

A fault's recovery time is from its injection to the end of the first successful probe
request: probes are short and sequential, and start at the injection, so a fault the stack
serves through (a prefill worker's death: the decode worker recomputes) recovers at once. The
next fault waits for that recovery; each cycle starts with every worker healthy again, so a
killed prefill worker may still be restarting while the decode worker is killed (the two
restarts overlap instead of adding up), but no kill ever finds its worker already gone.
"""

from __future__ import annotations

import asyncio
import enum
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.soak.load import Load, probe_until_ok
from bench.soak.stack import SoakStack

RECOVERY_TIMEOUT_S = 300.0
"""A worker restart on this machine takes 1-3 minutes; past this the stack did not recover."""
REDIS_DOWN_S = 2.0
POSTGRES_DOWN_S = 5.0
FREEZE_S = 5.0
MOMENT_TIMEOUT_S = 30.0
"""How long a kill waits for its moment (a stream in flight) before striking anyway."""


class FaultKind(enum.StrEnum):
    REDIS_RESTART = "redis-restart"
    POSTGRES_RESTART = "postgres-restart"
    GATEWAY_KILL = "gateway-kill"
    DECODE_FREEZE = "decode-freeze"
    PREFILL_KILL = "prefill-kill"
    DECODE_KILL = "decode-kill"

    @property
    def kills_worker(self) -> bool:
        return self in (FaultKind.PREFILL_KILL, FaultKind.DECODE_KILL)


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    at_s: float
    """Injected, in seconds since the run's start."""
    ended_s: float
    """The fault itself was over (the server restarted, the worker continued); a kill's is
    its moment."""
    recovery_s: float | None
    """Injection -> the first successful probe after it; None: no recovery within the
    timeout."""
    in_flight: int
    """Load requests in flight when it was injected."""


async def run_faults(
    stack: SoakStack,
    load: Load,
    kinds: Sequence[FaultKind],
    until_s: float,
    gap_s: float,
) -> list[Fault]:
    """Inject ``kinds`` in turn, ``gap_s`` apart, cycling until ``until_s`` (seconds since the
    run's start) once every kind has run at least once."""
    faults: list[Fault] = []
    cycle = 0
    while True:
        await stack.wait_ready(RECOVERY_TIMEOUT_S)
        for kind in kinds:
            if cycle > 0 and load.now() >= until_s:
                return faults
            await asyncio.sleep(gap_s)
            faults.append(await _inject(stack, load, kind))
        cycle += 1
        if load.now() >= until_s:
            return faults


async def _inject(stack: SoakStack, load: Load, kind: FaultKind) -> Fault:
    workers = stack.worker_urls
    if kind is FaultKind.PREFILL_KILL:
        # Mid-transfer: a long prompt sent within the last second, still without a token.
        await _moment(load, lambda s: s.long_prompt and s.first_token_s is None, max_age_s=1.0)
    elif kind in (FaultKind.DECODE_KILL, FaultKind.GATEWAY_KILL):
        await _moment(load, lambda s: s.first_token_s is not None)  # mid-stream
    at_s = load.now()
    in_flight = sum(1 for s in load.sent if s.kind == "load" and not s.done)
    recovery = asyncio.create_task(probe_until_ok(load, at_s, RECOVERY_TIMEOUT_S))
    if kind is FaultKind.REDIS_RESTART:
        await stack.restart_redis(REDIS_DOWN_S)
    elif kind is FaultKind.POSTGRES_RESTART:
        await stack.restart_postgres(POSTGRES_DOWN_S)
    elif kind is FaultKind.GATEWAY_KILL:
        stack.kill_gateway_process(1)
    elif kind is FaultKind.DECODE_FREEZE:
        stack.signal_worker(workers["decode"], signal.SIGSTOP)
        try:
            await asyncio.sleep(FREEZE_S)
        finally:
            stack.signal_worker(workers["decode"], signal.SIGCONT)
    elif kind is FaultKind.PREFILL_KILL:
        stack.kill_worker(workers["prefill"])
    elif kind is FaultKind.DECODE_KILL:
        stack.kill_worker(workers["decode"])
    ended_s = load.now()
    return Fault(kind, at_s, ended_s, await recovery, in_flight)


async def _moment(load: Load, wanted: Callable[..., bool], max_age_s: float | None = None) -> None:
    """Until a load request in flight matches ``wanted`` (or ``MOMENT_TIMEOUT_S`` passed)."""
    deadline = load.now() + MOMENT_TIMEOUT_S
    while load.now() < deadline:
        now = load.now()
        for sent in reversed(load.sent):
            in_flight = sent.kind == "load" and not sent.done
            fresh = max_age_s is None or now - sent.sent_s <= max_age_s
            if in_flight and fresh and wanted(sent):
                return
        await asyncio.sleep(0.05)
