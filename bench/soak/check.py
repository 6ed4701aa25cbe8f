"""The soak's invariants, checked over what the clients saw, the ledger and the idle stack.

Each check is a pure function of the evidence (``Evidence``) returning a ``Check``: its name,
whether it held, and the figures behind it. Nothing here talks to the stack.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.soak.faults import Fault, FaultKind
from bench.soak.load import Sent

WORKER_DEATH_BOUND_S = 10.0
"""A request on a worker that died is answered (a fallback's first token, or an error) within
this, never after vLLM's own NIXL timeouts (120-480 s)."""
GATEWAY_CUT_WINDOW_S = 5.0
"""A connection error counts as the gateway kill's only if it ended this soon after it."""
RSS_GROWTH_BOUND = 64 * 1024 * 1024
"""A gateway process may grow this much over the run (caches fill; a leak grows past it)."""

REFUSED_AFTER_COMMIT = "stream_error:overloaded"
"""How a client sees a stream the admission queue refused after it committed: one still
queued a heartbeat interval after it arrived commits (200, then pings), and the queue's timeout
is then its one error event. Only admission raises ``overloaded``; a request it refused was never
admitted, so it is not billed (``docs/ARCHITECTURE.md``, "Streams")."""
CLIENT_FAULTS = ("timeout", "malformed", "connection")
"""Outcomes that are not a clean, OpenAI-shaped error (``connection`` is allowed only for
streams cut by a gateway kill)."""


@dataclass(frozen=True, slots=True)
class LedgerRow:
    record_id: str
    request_id: str
    status: str
    prompt_tokens: int
    completion_tokens: int
    started_at_us: int
    ttft_us: int | None = None
    e2e_us: int = 0

    @property
    def reserved_by_us(self) -> int:
        """When its quota had been reserved at the latest: before its first token (its end,
        without one). Its start is the earliest: the gateway receives, then reserves."""
        return self.started_at_us + (self.ttft_us if self.ttft_us is not None else self.e2e_us)


@dataclass(frozen=True, slots=True)
class IdleState:
    """The stack once the load stopped and every worker is healthy."""

    admission_in_flight: float
    admission_queued: float
    worker_running: dict[str, float]
    worker_kv_usage: dict[str, float]


@dataclass(frozen=True, slots=True)
class Shutdown:
    exit_code: int | None
    seconds: float
    grace_s: float
    streams: list[Sent]


@dataclass
class Evidence:
    sent: list[Sent]
    faults: list[Fault]
    ledger: list[LedgerRow]
    idle: IdleState
    kv_baseline: dict[str, float]
    """Each worker's KV-cache usage on the warm, idle stack before the load."""
    rss_before: dict[int, tuple[int, int]]
    rss_after: dict[int, tuple[int, int]]
    shutdown: Shutdown
    tpm: dict[str, int]
    """The tenants with a TPM limit, and it."""
    max_tokens: dict[str, int]
    kinds: Sequence[FaultKind] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str


def check_all(evidence: Evidence) -> list[Check]:
    return [
        no_hang(evidence),
        clean_errors(evidence),
        ledger_exact(evidence),
        charged_equals_metered(evidence),
        quotas_held(evidence),
        nothing_leaked(evidence),
        rss_bounded(evidence),
        worker_death_answered(evidence),
        faults_recovered(evidence),
        graceful_shutdown(evidence),
    ]


def no_hang(ev: Evidence) -> Check:
    unfinished = [s for s in ev.sent if not s.done]
    timeouts = [s for s in ev.sent if s.record.error_type == "timeout"]
    return Check(
        "no request hung",
        not unfinished and not timeouts,
        f"{len(ev.sent)} requests; {len(timeouts)} past their deadline; {len(unfinished)} never "
        "ended",
    )


def clean_errors(ev: Evidence) -> Check:
    unclean = [s for s in ev.sent if _unclean(s, ev.faults)]
    kinds = Counter(s.record.error_type for s in ev.sent if not s.record.ok)
    examples = "; ".join(
        f"{s.tenant}#{s.record.index} {s.record.error_type}: {(s.record.error or '')[:120]}"
        for s in unclean[:3]
    )
    return Check(
        "every error clean (OpenAI-shaped, or a stream cut by a gateway kill)",
        not unclean,
        f"errors by kind {dict(kinds.most_common())}; unclean {len(unclean)}"
        + (f": {examples}" if examples else ""),
    )


def _unclean(sent: Sent, faults: list[Fault]) -> bool:
    kind = sent.record.error_type
    if kind is None:
        return False
    if kind == "connection":
        return not any(_cut_by(sent, f) for f in faults if f.kind is FaultKind.GATEWAY_KILL)
    # ``http_<status>``: the body was not an OpenAI error object.
    return kind in CLIENT_FAULTS or kind.startswith("http_")


def _cut_by(sent: Sent, fault: Fault) -> bool:
    """``sent`` lost its connection when ``fault`` (a gateway kill) struck."""
    return (
        sent.record.error_type == "connection"
        and sent.sent_s <= fault.at_s <= sent.ended_s <= fault.at_s + GATEWAY_CUT_WINDOW_S
    )


def ledger_exact(ev: Evidence) -> Check:
    """Every committed request is in the ledger exactly once, and nothing else is."""
    counts = Counter(row.request_id for row in ev.ledger)
    doubled = [rid for rid, n in counts.items() if n > 1]
    by_id = {s.record.request_id: s for s in ev.sent if s.record.request_id}
    phantom = [rid for rid in counts if rid not in by_id]
    cut = {
        id(s)
        for s in ev.sent
        if any(_cut_by(s, f) for f in ev.faults if f.kind is FaultKind.GATEWAY_KILL)
    }
    refused = {id(s) for s in ev.sent if s.record.error_type == REFUSED_AFTER_COMMIT}
    committed = [
        s for s in ev.sent if s.record.status == 200 and id(s) not in cut and id(s) not in refused
    ]
    missing = [s for s in committed if s.record.request_id not in counts]
    cut_committed = sum(1 for s in ev.sent if id(s) in cut and s.record.status == 200)
    return Check(
        "ledger exact: every committed request once, no other row",
        not doubled and not phantom and not missing,
        f"{len(ev.ledger)} rows; {len(committed)} committed requests; missing {len(missing)}; "
        f"doubled {len(doubled)}; rows of no request {len(phantom)}; streams cut by a gateway "
        f"kill (never billed: the process died with them) {cut_committed}; streams refused "
        f"by the queue after their commit (never admitted, not billed) {len(refused)}"
        + (f"; e.g. missing {missing[0].record.request_id}" if missing else ""),
    )


def charged_equals_metered(ev: Evidence) -> Check:
    """For every request that finished, the ledger's tokens are the usage its client got."""
    rows = {row.request_id: row for row in ev.ledger}
    charged: dict[str, int] = defaultdict(int)
    metered: dict[str, int] = defaultdict(int)
    wrong = []
    for sent in ev.sent:
        record = sent.record
        if not record.ok or record.prompt_tokens is None or record.completion_tokens is None:
            continue
        row = rows.get(record.request_id or "")
        metered[sent.tenant] += record.prompt_tokens + record.completion_tokens
        if row is None:
            continue  # ledger_exact reports it
        charged[sent.tenant] += row.prompt_tokens + row.completion_tokens
        if (row.prompt_tokens, row.completion_tokens) != (
            record.prompt_tokens,
            record.completion_tokens,
        ):
            wrong.append(record.request_id)
    per_tenant = ", ".join(f"{t} {charged[t]}/{metered[t]}" for t in sorted(metered))
    return Check(
        "charged tokens equal metered, per tenant",
        not wrong and charged == metered,
        f"charged/metered tokens: {per_tenant}; requests with other counts {len(wrong)}",
    )


def quotas_held(ev: Evidence) -> Check:
    """A tenant's tokens stay within its token bucket (capacity = TPM, refilled at TPM a
    minute; quota is reserved once a request is received): over any 60 s of arrivals at most two
    minutes' worth, and over the run one minute's plus the refill from the first request's
    start to the last reservation of a request that used tokens (``LedgerRow.reserved_by_us``:
    a request under load may reserve a while after it started); plus one request, whose
    reservation is an estimate reconciled on the engine's count."""
    tenant_of = {s.record.request_id: s.tenant for s in ev.sent if s.record.request_id}
    details, ok = [], True
    for tenant, tpm in ev.tpm.items():
        served = [row for row in ev.ledger if tenant_of.get(row.request_id) == tenant]
        rows = sorted(
            (row.started_at_us, row.prompt_tokens + row.completion_tokens) for row in served
        )
        if not rows:
            details.append(f"{tenant}: no request served")
            ok = False
            continue
        one_request = max(tokens for _, tokens in rows)
        # Never before the last start (the bound read no less before); past it only for the
        # reservation of a request that used tokens: one that used nothing adds nothing.
        end_us = max(
            rows[-1][0],
            *(r.reserved_by_us for r in served if r.prompt_tokens + r.completion_tokens),
        )
        minutes = (end_us - rows[0][0]) / 60e6
        total = sum(tokens for _, tokens in rows)
        run_bound = tpm * (1 + minutes) + one_request
        window = _busiest_minute(rows)
        window_bound = 2 * tpm + one_request
        ok = ok and total <= run_bound and window <= window_bound
        refused = sum(
            1
            for s in ev.sent
            if s.tenant == tenant and s.record.error_type == "rate_limit_exceeded"
        )
        details.append(
            f"{tenant} (TPM {tpm}): busiest 60 s {window} tokens (bound {window_bound}), "
            f"{total} over {minutes:.1f} min (bound {run_bound:.0f}); {refused} refused (429)"
        )
    return Check("every tenant within its quota bound", ok, "; ".join(details) or "no TPM")


def _busiest_minute(rows: list[tuple[int, int]]) -> int:
    """The most tokens of requests that arrived within one 60 s window (rows sorted by
    arrival, in µs)."""
    busiest = total = 0
    first = 0
    for arrived, tokens in rows:
        total += tokens
        while rows[first][0] <= arrived - 60_000_000:
            total -= rows[first][1]
            first += 1
        busiest = max(busiest, total)
    return busiest


def nothing_leaked(ev: Evidence) -> Check:
    idle = ev.idle
    leaked = (
        idle.admission_in_flight != 0
        or idle.admission_queued != 0
        or any(v != 0 for v in idle.worker_running.values())
        or any(v > ev.kv_baseline.get(role, 0.0) for role, v in idle.worker_kv_usage.items())
    )
    return Check(
        "no admission slot or KV block leaked",
        not leaked,
        f"admission in flight {idle.admission_in_flight:g}, queued {idle.admission_queued:g}; "
        f"worker requests running {idle.worker_running}; KV usage {idle.worker_kv_usage} "
        f"(before the load {ev.kv_baseline})",
    )


def rss_bounded(ev: Evidence) -> Check:
    parts, ok = [], True
    for index, (pid, before) in sorted(ev.rss_before.items()):
        after = ev.rss_after.get(index)
        if after is None or after[0] != pid:
            parts.append(f"process {index}: restarted (pid {pid} gone), not compared")
            continue
        growth = after[1] - before
        ok = ok and growth <= RSS_GROWTH_BOUND
        parts.append(f"process {index}: {before / 2**20:.0f} -> {after[1] / 2**20:.0f} MiB")
    return Check(
        f"gateway RSS growth under {RSS_GROWTH_BOUND // 2**20} MiB",
        ok and bool(parts),
        "; ".join(parts) or "no gateway process measured",
    )


def worker_death_answered(ev: Evidence) -> Check:
    """Requests on a worker that died get a token or an error within the bound: those in
    mid-stream at the kill, and those admitted before it (queue time known) that had no token
    yet."""
    worst: dict[str, float] = {}
    late = []
    for fault in ev.faults:
        if not fault.kind.kills_worker:
            continue
        for sent in ev.sent:
            if sent.kind != "load" or not (sent.sent_s <= fault.at_s <= sent.ended_s):
                continue
            first = sent.first_token_s
            if first is not None and first <= fault.at_s:
                answered = sent.ended_s  # mid-stream: the stream must end
            elif _admitted_before(sent, fault.at_s):
                answered = first if first is not None else sent.ended_s
            else:
                continue  # still queued in the gateway at the kill: the queue's own deadline
            waited = answered - fault.at_s
            worst[fault.kind] = max(worst.get(fault.kind, 0.0), waited)
            if waited > WORKER_DEATH_BOUND_S:
                late.append(f"{fault.kind}: {sent.tenant}#{sent.record.index} {waited:.1f} s")
    detail = ", ".join(f"{k} worst {v:.1f} s" for k, v in sorted(worst.items()))
    return Check(
        f"a worker's death answered within {WORKER_DEATH_BOUND_S:g} s",
        not late,
        (detail or "no request in flight at a worker kill")
        + (f"; late: {late[:3]}" if late else ""),
    )


def _admitted_before(sent: Sent, at_s: float) -> bool:
    queue_ms = sent.record.queue_ms
    return queue_ms is not None and sent.sent_s + queue_ms / 1000 <= at_s


def faults_recovered(ev: Evidence) -> Check:
    injected = {f.kind for f in ev.faults}
    missing = [k for k in ev.kinds if k not in injected]
    stuck = [f.kind for f in ev.faults if f.recovery_s is None]
    return Check(
        "every fault kind injected and recovered from",
        not missing and not stuck,
        f"injected {dict(Counter(str(f.kind) for f in ev.faults))}; never injected "
        f"{[str(k) for k in missing]}; no recovery {[str(k) for k in stuck]}",
    )


def graceful_shutdown(ev: Evidence) -> Check:
    sd = ev.shutdown
    rows = {row.request_id for row in ev.ledger}
    failed = [s for s in sd.streams if not s.record.ok]
    unbilled = [s for s in sd.streams if s.record.request_id not in rows]
    in_time = sd.seconds <= sd.grace_s + 30
    return Check(
        "SIGTERM drains open streams, flushes the ledger and exits 0",
        sd.exit_code == 0 and in_time and bool(sd.streams) and not failed and not unbilled,
        f"exit code {sd.exit_code} after {sd.seconds:.1f} s; {len(sd.streams)} open streams, "
        f"{len(failed)} failed, {len(unbilled)} not in the ledger",
    )
