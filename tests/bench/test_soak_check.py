"""The soak's checker on hand-made evidence: each invariant holds on a clean history and fails
on the violation it exists for (a checker that cannot fail proves nothing)."""

from __future__ import annotations

import dataclasses

from bench.harness.records import RequestRecord
from bench.soak import check
from bench.soak.check import Evidence, IdleState, LedgerRow, Shutdown
from bench.soak.faults import Fault, FaultKind
from bench.soak.load import Sent


def sent(
    index: int,
    *,
    tenant: str = "steady",
    at: float = 0.0,
    took: float = 1.0,
    error: str | None = None,
    status: int = 200,
    tokens: tuple[int, int] = (10, 5),
    ttft: float | None = 0.2,
    kind: str = "load",
) -> Sent:
    record = RequestRecord(index, tenant, False, None, max_tokens=8, expected_prompt_tokens=10)
    record.sent_s, record.elapsed_s, record.status = at, took, status
    record.request_id = f"req-{index}"
    record.error_type = error
    record.ttft_s = ttft
    if error is None:
        record.prompt_tokens, record.completion_tokens = tokens
    return Sent(tenant, kind, False, record, done=True)


def row(s: Sent, *, tokens: tuple[int, int] | None = None) -> LedgerRow:
    prompt, completion = tokens or (s.record.prompt_tokens or 0, s.record.completion_tokens or 0)
    return LedgerRow(
        s.record.request_id or "", s.record.request_id or "", "finished", prompt, completion,
        int(s.sent_s * 1e6),
    )  # fmt: skip


def evidence(history: list[Sent], **changes: object) -> Evidence:
    drain = [sent(1000, kind="drain", at=100.0)]
    base = Evidence(
        sent=history + drain,
        faults=[],
        ledger=[row(s) for s in history + drain if s.record.status == 200],
        idle=IdleState(0, 0, {"decode": 0}, {"decode": 0.0}),
        kv_baseline={"decode": 0.0},
        rss_before={0: (10, 100 << 20)},
        rss_after={0: (10, 110 << 20)},
        shutdown=Shutdown(0, 5.0, 30, drain),
        tpm={},
        max_tokens={"steady": 8},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


HISTORY = [sent(i, at=float(i)) for i in range(5)]


def test_a_clean_history_holds_every_invariant() -> None:
    failed = [c for c in check.check_all(evidence(HISTORY)) if not c.ok]
    assert failed == []


def test_a_request_past_its_deadline_is_a_hang() -> None:
    hung = sent(9, error="timeout", status=200)
    assert not check.no_hang(evidence([*HISTORY, hung])).ok


def test_a_connection_error_is_clean_only_when_a_gateway_kill_cut_it() -> None:
    cut = sent(9, at=10.0, took=1.5, error="connection")
    kill = Fault(FaultKind.GATEWAY_KILL, at_s=11.0, ended_s=11.0, recovery_s=0.5, in_flight=1)
    assert check.clean_errors(evidence([*HISTORY, cut], faults=[kill])).ok
    assert not check.clean_errors(evidence([*HISTORY, cut])).ok
    # A body that was not an OpenAI error object is never clean.
    assert not check.clean_errors(evidence([*HISTORY, sent(8, error="http_500")])).ok


def test_the_ledger_must_hold_each_committed_request_once_and_nothing_else() -> None:
    ev = evidence(HISTORY)
    assert not check.ledger_exact(dataclasses.replace(ev, ledger=ev.ledger[1:])).ok  # lost
    assert not check.ledger_exact(dataclasses.replace(ev, ledger=[*ev.ledger, ev.ledger[0]])).ok
    phantom = LedgerRow("x", "req-unknown", "finished", 1, 1, 0)
    assert not check.ledger_exact(dataclasses.replace(ev, ledger=[*ev.ledger, phantom])).ok


def test_a_stream_the_queue_refused_after_its_commit_is_not_billed_and_no_other_is_let_off() -> (
    None
):
    ev = evidence(HISTORY)  # a row for each request of the history, none for these two
    # Committed (200, pings) while queued; then the queue's timeout was its one event.
    refused = sent(90, error="stream_error:overloaded")
    failed = sent(91, error="stream_error:engine_error")  # admitted, then failed: billed
    with_refused = check.ledger_exact(dataclasses.replace(ev, sent=[*ev.sent, refused]))
    assert with_refused.ok
    assert "refused by the queue after their commit (never admitted, not billed) 1" in (
        with_refused.detail
    )
    assert not check.ledger_exact(dataclasses.replace(ev, sent=[*ev.sent, failed])).ok


def test_charged_tokens_must_equal_what_the_client_was_told() -> None:
    ev = evidence(HISTORY)
    wrong = [row(HISTORY[0], tokens=(10, 6)), *ev.ledger[1:]]
    assert not check.charged_equals_metered(dataclasses.replace(ev, ledger=wrong)).ok


def test_a_tenant_over_its_bucket_breaks_the_quota_bound() -> None:
    # TPM 100, 15 tokens a request: over 44 s the bucket gives 100 + 73 (+ one request).
    within = [sent(i, tenant="capped", at=i * 4.0) for i in range(12)]  # 180
    over = [sent(i, tenant="capped", at=i * 1.0) for i in range(15)]  # 225 within 14 s
    limits = {"tpm": {"capped": 100}, "max_tokens": {"capped": 8, "steady": 8}}
    assert check.quotas_held(evidence(within, **limits)).ok
    assert not check.quotas_held(evidence(over, **limits)).ok


def test_the_refill_runs_to_the_last_reservation_not_the_last_start() -> None:
    # TPM 60 (a token a second), 11 tokens a request, one a second from 0 to 10 s: 121 tokens
    # against 60 + 10 refilled + 11 (one request). Had the last one reserved its quota just
    # before its first token, 2 s after its start, 2 more were refilled: still over. 50 s
    # after: within (the bucket gave 60 + 60 + 11).
    history = [sent(i, tenant="capped", at=float(i), tokens=(3, 8)) for i in range(11)]
    limits = {"tpm": {"capped": 60}, "max_tokens": {"capped": 8, "steady": 8}}
    ev = evidence(history, **limits)
    assert not check.quotas_held(ev).ok

    def last_reserved_by(ttft_us: int) -> Evidence:
        ledger = [
            dataclasses.replace(r, ttft_us=ttft_us) if r.request_id == "req-10" else r
            for r in ev.ledger
        ]
        return dataclasses.replace(ev, ledger=ledger)

    assert not check.quotas_held(last_reserved_by(2_000_000)).ok
    assert check.quotas_held(last_reserved_by(50_000_000)).ok


def test_leaks_and_growth_are_caught() -> None:
    held = IdleState(1, 0, {"decode": 0}, {"decode": 0.0})
    assert not check.nothing_leaked(evidence(HISTORY, idle=held)).ok
    kv = IdleState(0, 0, {"decode": 0}, {"decode": 0.2})
    assert not check.nothing_leaked(evidence(HISTORY, idle=kv)).ok
    grown = {0: (10, (100 << 20) + check.RSS_GROWTH_BOUND + 1)}
    assert not check.rss_bounded(evidence(HISTORY, rss_after=grown)).ok
    # A restarted process is reported, not compared.
    assert check.rss_bounded(evidence(HISTORY, rss_after={0: (11, 900 << 20)})).ok


def test_a_stream_on_a_killed_worker_must_end_within_the_bound() -> None:
    kill = Fault(FaultKind.DECODE_KILL, at_s=20.0, ended_s=20.0, recovery_s=60.0, in_flight=1)
    quick = sent(9, at=19.0, took=3.0, ttft=0.5, error="engine_error")
    slow = sent(9, at=19.0, took=check.WORKER_DEATH_BOUND_S + 2.0, ttft=0.5)
    assert check.worker_death_answered(evidence([*HISTORY, quick], faults=[kill])).ok
    assert not check.worker_death_answered(evidence([*HISTORY, slow], faults=[kill])).ok


def test_every_kind_must_be_injected_and_recovered() -> None:
    kinds = (FaultKind.REDIS_RESTART, FaultKind.DECODE_KILL)
    redis = Fault(FaultKind.REDIS_RESTART, 1.0, 3.0, 2.5, 3)
    assert not check.faults_recovered(evidence(HISTORY, faults=[redis], kinds=kinds)).ok
    stuck = Fault(FaultKind.DECODE_KILL, 9.0, 9.0, None, 3)
    assert not check.faults_recovered(evidence(HISTORY, faults=[redis, stuck], kinds=kinds)).ok


def test_shutdown_must_drain_bill_and_exit_zero() -> None:
    ev = evidence(HISTORY)
    killed = dataclasses.replace(ev.shutdown, exit_code=None)
    assert not check.graceful_shutdown(dataclasses.replace(ev, shutdown=killed)).ok
    unbilled = [r for r in ev.ledger if r.request_id != "req-1000"]
    assert not check.graceful_shutdown(dataclasses.replace(ev, ledger=unbilled)).ok
