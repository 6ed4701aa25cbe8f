"""One request's way through admission: plan checks, quota reservation, the fair queue.

    estimate -> plan limits (400) -> reserve RPM + TPM + concurrency (429) -> fair queue (503)
    -> Admission (headers, output charges) -> settle(used tokens): reconcile, free the slot

Everything taken is given back exactly once: in ``Admission.settle`` or, if the request never
got an ``Admission``, before ``admit`` raises.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass

from admission.admitter import AdmissionSlot, Admitter
from admission.headers import ratelimit_headers
from admission.plans import Plan, QuotaLimits
from admission.quota import (
    Denial,
    LimitKind,
    QuotaSnapshot,
    QuotaStore,
    Reservation,
    StoreUnavailable,
)
from admission.tenants import Tenant
from core.errors import (
    InvalidRequestError,
    QuotaExhaustedError,
    RateLimitError,
    StoreUnavailableError,
)
from core.messages import Usage
from core.prompt import TokenEstimate

log = logging.getLogger("tandem.admission")

MAX_CLIENT_RETRY_S = 120.0
"""The OpenAI SDKs wait at most this long before a retry; longer waits are told not to retry."""


class StoreFailurePolicy(enum.StrEnum):
    """What happens to requests while the quota store cannot be reached."""

    OPEN = "open"
    """Admit without quota checks: availability first; usage in the outage is not counted."""
    CLOSED = "closed"
    """Refuse with 503 until the store is back: quotas first."""


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    """Admission settings that are not per tenant."""

    store_failure: StoreFailurePolicy = StoreFailurePolicy.OPEN
    """Fail open or closed while the quota store is down."""
    store_retry_after_s: float = 2.0
    """Retry hint on the 503s sent while the store is down and the policy is closed."""
    hold_s: float = 900.0
    """Lifetime of a concurrency hold: slots of a gateway that died free themselves after it."""


class Admission:
    """An admitted request's reservation and queue slot, held until ``settle``."""

    def __init__(
        self,
        controller: AdmissionController,
        tenant: Tenant,
        estimate: TokenEstimate,
        reservation: Reservation | None,
        slot: AdmissionSlot,
    ) -> None:
        self.tenant = tenant
        self.estimate = estimate
        self._controller = controller
        self._reservation = reservation
        self._slot = slot
        self._settled = False

    @property
    def queue_wait_s(self) -> float:
        """Time spent in the fair queue."""
        return self._slot.queue_wait_s

    @property
    def fair_position(self) -> int:
        """The tenant's place in its band when admitted (0 = nobody active in the band is less
        served): the engine priority's offset within the band."""
        return self._slot.fair_position

    def headers(self) -> dict[str, str]:
        """``x-ratelimit-*`` as of the reservation (none when the store was bypassed)."""
        return ratelimit_headers(self._reservation.snapshot) if self._reservation else {}

    def charge_output(self, num_tokens: int) -> None:
        """Output tokens as they stream: VTC's output charge."""
        self._slot.charge_output(num_tokens)

    @property
    def settled(self) -> bool:
        return self._settled

    async def settle(self, used_tokens: int, *, ran: bool = True) -> None:
        """Free the queue slot and reconcile the reservation with what was really used
        (``ran=False``: no engine saw the request, so its request unit comes back too).

        Idempotent. Runs to the end (``reconcile_to_the_end``), so a client that leaves
        mid-settle cannot leave the reservation half done; a store outage is logged, the tokens
        stay charged and the hold expires.
        """
        if self._settled:
            return
        self._settled = True
        self._slot.release()
        if self._reservation is not None:
            await self._controller.reconcile_to_the_end(
                self._reservation, self.tenant.plan, used_tokens, ran=ran
            )


class AdmissionController:
    """Plan checks, quota reservations and the fair queue, for every request."""

    def __init__(
        self,
        quotas: QuotaStore,
        admitter: Admitter,
        config: ControllerConfig,
        on_store_error: Callable[[str], None] = lambda operation: None,
    ) -> None:
        self._quotas = quotas
        self._admitter = admitter
        self._config = config
        self._on_store_error = on_store_error

    async def admit(
        self,
        tenant: Tenant,
        estimate: TokenEstimate,
        deadline: float | None,
        on_reserved: Callable[[dict[str, str]], None] | None = None,
    ) -> Admission:
        """Admit a request or raise the error its client gets (400, 429 or 503).

        ``on_reserved`` hears the rate-limit headers once the quota is reserved, before the
        wait in the queue (none when the plan is unlimited or the store was bypassed)."""
        plan = tenant.plan
        check_plan_limits(plan, estimate)
        reservation = await self._reserve_to_the_end(tenant, estimate)
        if on_reserved is not None:
            on_reserved(ratelimit_headers(reservation.snapshot) if reservation else {})
        try:
            slot = await self._admitter.admit(
                tenant.tenant_id, plan.weight, plan.band, estimate.prompt_tokens, deadline
            )
        except BaseException:
            # Shed, deadline or client gone while queued: nothing ran, so nothing is owed.
            if reservation is not None:
                await self.reconcile_to_the_end(reservation, plan, 0, ran=False)
            raise
        return Admission(self, tenant, estimate, reservation, slot)

    async def reconcile(
        self, reservation: Reservation, plan: Plan, used_tokens: int, *, ran: bool = True
    ) -> None:
        """Settle one reservation; a store outage is logged, never raised."""
        try:
            await self._quotas.reconcile(reservation, QuotaLimits.of(plan), used_tokens, ran=ran)
        except StoreUnavailable as exc:
            self._on_store_error("reconcile")
            log.warning(
                "quota store unavailable: reservation %s of tenant %s stays charged (%s)",
                reservation.reservation_id, reservation.tenant_id, exc,
            )  # fmt: skip

    async def reconcile_to_the_end(
        self, reservation: Reservation, plan: Plan, used_tokens: int, *, ran: bool = True
    ) -> None:
        """``reconcile``, which a cancellation (the client left) does not cut short: shielded,
        unless the store answers at once (as for the reservation: nothing can cut a call that
        never suspends, and the shield's task was a hop and a task every request)."""
        reconciling = self.reconcile(reservation, plan, used_tokens, ran=ran)
        if self._quotas.answers_at_once:
            await reconciling
        else:
            await asyncio.shield(reconciling)

    async def forget(self, tenant_id: str) -> None:
        """Drop a deleted tenant's counters (raises ``StoreUnavailable``)."""
        await self._quotas.forget(tenant_id)

    def num_queued(self, tenant_id: str) -> int:
        """The tenant's requests waiting in this replica's queue."""
        # O(queue length): for the admin API, not the request path.
        return sum(
            1 for entry in self._admitter.fair_queue.entries() if entry.tenant_id == tenant_id
        )

    def fairness_counter(self, tenant_id: str) -> float | None:
        """The tenant's VTC counter in this replica's fair queue: weighted service / weight.
        None when none is kept (never seen, or idle at its band's floor)."""
        return self._admitter.fair_queue.counter(tenant_id)

    async def snapshot(self, tenant: Tenant) -> QuotaSnapshot:
        """The tenant's live quota state (raises ``StoreUnavailable``)."""
        return await self._quotas.snapshot(tenant.tenant_id, QuotaLimits.of(tenant.plan))

    async def _reserve_to_the_end(
        self, tenant: Tenant, estimate: TokenEstimate
    ) -> Reservation | None:
        """``_reserve``, which a cancellation (the client left) does not cut short: the store
        may grant a reservation whose answer never arrives, and its concurrency hold would stay
        taken until it expires. So the round trip ends, and what it took is given back. A store
        that answers at once needs none of this (nothing can cut it short), nor its task: a
        hop through the event loop was a tenth of a millisecond of every request's TTFT."""
        if self._quotas.answers_at_once:
            return await self._reserve(tenant, estimate)
        reserving = asyncio.ensure_future(self._reserve(tenant, estimate))
        try:
            return await asyncio.shield(reserving)
        except asyncio.CancelledError:
            await asyncio.wait((reserving,))
            if not reserving.cancelled() and reserving.exception() is None:
                reservation = reserving.result()
                if reservation is not None:
                    await self.reconcile_to_the_end(reservation, tenant.plan, 0, ran=False)
            raise

    async def _reserve(self, tenant: Tenant, estimate: TokenEstimate) -> Reservation | None:
        limits = QuotaLimits.of(tenant.plan)
        if limits == QuotaLimits(None, None, None):
            return None  # an unlimited plan needs no round trip
        try:
            result = await self._quotas.reserve(
                tenant.tenant_id, limits, estimate.total_tokens, self._config.hold_s
            )
        except StoreUnavailable as exc:
            self._on_store_error("reserve")
            if self._config.store_failure is StoreFailurePolicy.OPEN:
                log.warning(
                    "quota store unavailable, admitting tenant %s without a quota check "
                    "(policy: open): %s", tenant.name, exc,
                )  # fmt: skip
                return None
            log.error("quota store unavailable, refusing (policy: closed): %s", exc)
            raise StoreUnavailableError(
                "Quota checks are temporarily unavailable; retry shortly.",
                retry_after_s=self._config.store_retry_after_s,
            ) from exc
        if isinstance(result, Denial):
            raise denial_error(result, estimate)
        return result


def check_context_window(estimate: TokenEstimate, max_model_len: int | None) -> None:
    """An output cap longer than the model's whole context window can never be served: 400
    naming the field (the engine would refuse it too, but only after a quota reservation)."""
    if max_model_len is not None and estimate.max_output_tokens > max_model_len:
        raise InvalidRequestError(
            f"{estimate.output_param} is {estimate.max_output_tokens}, more than this model's "
            f"context window of {max_model_len} tokens (prompt and output together). Set "
            f"{estimate.output_param} to at most {max_model_len} minus the prompt's length.",
            code="max_tokens_too_large",
            param=estimate.output_param,
        )


def check_plan_limits(plan: Plan, estimate: TokenEstimate) -> None:
    """Per-request limits of the plan: a request over them can never pass, so 400 (a 429 would
    be retried by clients that do not read ``x-should-retry``)."""
    if plan.max_prompt_tokens is not None and estimate.prompt_tokens > plan.max_prompt_tokens:
        raise InvalidRequestError(
            f"Your prompt has about {estimate.prompt_tokens} tokens; your plan allows at most "
            f"{plan.max_prompt_tokens} per request. Shorten the prompt.",
            code="prompt_too_long",
            param=estimate.prompt_param,
        )
    param = estimate.output_param
    if plan.max_output_tokens is not None and estimate.max_output_tokens > plan.max_output_tokens:
        raise InvalidRequestError(
            f"{param} is {estimate.max_output_tokens}; your plan allows at most "
            f"{plan.max_output_tokens}. Set {param} to {plan.max_output_tokens} or less.",
            code="max_tokens_too_large",
            param=param,
        )
    if plan.tpm is not None and estimate.total_tokens > plan.tpm:
        output_budget = (plan.tpm - estimate.prompt_tokens) // estimate.num_choices
        if output_budget < 1:
            raise InvalidRequestError(
                f"Your prompt has about {estimate.prompt_tokens} tokens, more than your plan's "
                f"{plan.tpm} tokens per minute: it can never be admitted. Shorten the prompt.",
                code="request_too_large",
                param=estimate.prompt_param,
            )
        raise InvalidRequestError(
            f"This request needs up to {estimate.total_tokens} tokens (a prompt of about "
            f"{estimate.prompt_tokens} plus {param}={estimate.max_output_tokens} x n="
            f"{estimate.num_choices}), more than your plan's {plan.tpm} tokens per minute: it "
            f"can never be admitted. Set {param} to {output_budget} or less.",
            code="request_too_large",
            param=param,
        )


def denial_error(denial: Denial, estimate: TokenEstimate) -> RateLimitError:
    """The 429 for a refused reservation, with its retry hints and rate-limit headers."""
    headers = ratelimit_headers(denial.snapshot)
    if denial.retry_after_s is None:
        return QuotaExhaustedError(
            f"This request needs up to {estimate.total_tokens} tokens (prompt plus max_tokens "
            f"x n), more than your plan's {denial.snapshot.limit_tokens} tokens per minute. "
            "Lower max_tokens or split the request.",
            should_retry=False,
            extra_headers=headers,
        )
    if denial.limit is LimitKind.CONCURRENCY:
        # The store's figure is when a hold expires (minutes); a slot usually frees much sooner,
        # when one of the tenant's own requests ends.
        return RateLimitError(
            "Too many concurrent requests for your plan; retry when one of them has ended.",
            retry_after_s=1.0,
            extra_headers=headers,
        )
    what = {
        LimitKind.REQUESTS: f"requests per minute ({denial.snapshot.limit_requests})",
        LimitKind.TOKENS: f"tokens per minute ({denial.snapshot.limit_tokens})",
    }[denial.limit]
    if denial.retry_after_s > MAX_CLIENT_RETRY_S:
        return QuotaExhaustedError(
            f"Rate limit reached for {what}; capacity frees in {denial.retry_after_s:.0f} s.",
            retry_after_s=denial.retry_after_s,
            should_retry=False,
            extra_headers=headers,
        )
    return RateLimitError(
        f"Rate limit reached for {what}. Retry in {denial.retry_after_s:.2f} s.",
        retry_after_s=denial.retry_after_s,
        extra_headers=headers,
    )


def used_tokens(
    estimate: TokenEstimate, usage: Usage | None, *, engine_ran: bool, num_streamed: int
) -> int:
    """What a request spent: the engine's count when it sent one; otherwise the prompt (if an
    engine saw it) plus the tokens streamed before the end."""
    if usage is not None:
        return usage.total_tokens
    return (estimate.prompt_tokens if engine_ran else 0) + num_streamed
