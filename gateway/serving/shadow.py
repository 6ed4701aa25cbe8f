"""Shadow traffic: a copy of a primary request sent to another version, for comparison only.

A shadow copy bypasses everything a tenant is accountable for: no quota, no fair-queue charge,
no ledger row, no idempotency key (it is a task of this module's, not of the request's flow).
The client never sees its answer. Its load is capped per shadow version
(``traffic.shadow.ShadowLimiter``): a copy past the cap is dropped and counted, so shadowing can
never starve primary traffic. It runs colocated (no prefill leg) and non-streamed on the
shadow version's least-loaded decode worker, with the shadow version's own generation defaults.

What it records, per shadow version: its latency, error kind, output tokens and finish reason
in the version windows (kept apart from primary figures), and the last comparisons of its
output with the primary's (``ShadowComparison``), readable through the admin API.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

from core.errors import TandemError
from core.messages import Endpoint
from core.models import unapply_defaults
from core.request import Request
from gateway.serving.events import choice_text
from gateway.serving.routing import answer_usage
from gateway.serving.upstream import EngineClient
from traffic.shadow import ShadowLimiter
from traffic.windows import RequestFigures, VersionWindows
from workers.deployments import Deployment

log = logging.getLogger("tandem.shadow")

_COMPARISONS_KEPT = 200  # per shadow version


@dataclass(frozen=True, slots=True)
class ShadowComparison:
    """One primary answer next to its shadow's (choice 0 only)."""

    request_id: str
    at: float
    primary_version: str
    shadow_version: str
    primary_text: str | None
    shadow_text: str | None
    primary_tokens: int | None
    shadow_tokens: int | None
    primary_finish: str | None
    shadow_finish: str | None
    shadow_error: str | None
    shadow_e2e_s: float
    same_text: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PrimaryOutput:
    """The primary's choice-0 text, gathered from its chunks or its answer for comparison."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._parts: list[str] = []

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        self._keep(chunk, streamed=True)

    def on_answer(self, answer: dict[str, Any]) -> None:
        self._keep(answer, streamed=False)

    def _keep(self, received: dict[str, Any], *, streamed: bool) -> None:
        for choice in received.get("choices") or ():
            if choice.get("index", 0) == 0:
                text = choice_text(choice, self._endpoint, streamed=streamed)
                if text:
                    self._parts.append(text)

    @property
    def text(self) -> str:
        return "".join(self._parts)


class ShadowRunner:
    """Starts shadow copies and owns their tasks (``aclose`` cancels those still running)."""

    def __init__(
        self, engine: EngineClient, windows: VersionWindows, limiter: ShadowLimiter
    ) -> None:
        self._engine = engine
        self._windows = windows
        self.limiter = limiter
        self._tasks: set[asyncio.Task[None]] = set()
        self._comparisons: dict[str, collections.deque[ShadowComparison]] = {}

    def start(
        self,
        request: Request,
        defaults_filled: tuple[str, ...],
        shadow: Deployment,
        max_in_flight: int,
    ) -> asyncio.Future[PrimaryOutcome] | None:
        """Send ``request``'s copy to ``shadow`` unless its cap is reached (then it is
        dropped and counted); ``defaults_filled``: what the primary version's defaults put
        in the body. The returned future is for the primary's outcome, which the comparison
        waits for; None when nothing was sent."""
        if not self.limiter.try_acquire(shadow.version, max_in_flight):
            log.debug(
                "request %s: shadow to %s dropped (cap reached)", request.request_id, shadow.version
            )
            return None
        primary: asyncio.Future[PrimaryOutcome] = asyncio.get_running_loop().create_future()
        body = _shadow_body(request, defaults_filled, shadow)
        task = asyncio.create_task(
            self._run(request, shadow, body, primary), name=f"shadow-{request.request_id}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return primary

    def comparisons(self, version: str) -> list[ShadowComparison]:
        """The latest comparisons for shadow ``version``, oldest first."""
        return list(self._comparisons.get(version, ()))

    def comparison_dicts(self, version: str) -> list[dict[str, Any]]:
        """``comparisons`` as JSON objects (the admin API's)."""
        return [comparison.to_dict() for comparison in self.comparisons(version)]

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(
        self,
        request: Request,
        shadow: Deployment,
        body: dict[str, Any],
        primary: asyncio.Future[PrimaryOutcome],
    ) -> None:
        started = time.monotonic()
        answer: dict[str, Any] | None = None
        error: str | None = None
        try:
            worker = shadow.decode.pick()
            if worker is None:
                error = "no_healthy_worker"
            else:
                with worker.lease():
                    answer = await self._engine.post_json(
                        worker,
                        request.endpoint.value,
                        body,
                        f"shadow-{request.request_id}",
                        prefill=False,
                    )
        except TandemError as exc:
            # Any answer but a 200 is the shadow version's error, a 400 too (its engine may
            # refuse what the primary's accepted): counted in its window and compared.
            error = exc.code or exc.error_type
        finally:
            self.limiter.release(shadow.version)
        e2e_s = time.monotonic() - started
        tokens = _completion_tokens(answer)
        finish = _finish_reason(answer)
        self._windows.observe(
            shadow.version,
            RequestFigures(
                ttft_s=None if answer is None else e2e_s,  # non-streamed: all arrives at once
                itl_s=None,
                e2e_s=e2e_s,
                error=error,
                output_tokens=tokens or 0,
                finish_reason=finish,
                moderation=None,
                shadow=True,
            ),
        )
        outcome = await primary  # set by the flow however the primary ended
        shadow_text = None if answer is None else _answer_text(answer, request.endpoint)
        self._remember(
            ShadowComparison(
                request_id=request.request_id,
                at=time.time(),
                primary_version=request.model.version_name,
                shadow_version=shadow.version,
                primary_text=outcome.text,
                shadow_text=shadow_text,
                primary_tokens=outcome.tokens,
                shadow_tokens=tokens,
                primary_finish=outcome.finish_reason,
                shadow_finish=finish,
                shadow_error=error,
                shadow_e2e_s=e2e_s,
                same_text=outcome.text is not None and outcome.text == shadow_text,
            )
        )

    def _remember(self, comparison: ShadowComparison) -> None:
        kept = self._comparisons.setdefault(
            comparison.shadow_version, collections.deque(maxlen=_COMPARISONS_KEPT)
        )
        kept.append(comparison)


@dataclass(frozen=True, slots=True)
class PrimaryOutcome:
    """How the primary ended, for the comparison (text None: it did not complete)."""

    text: str | None
    tokens: int | None
    finish_reason: str | None


def _shadow_body(
    request: Request, defaults_filled: tuple[str, ...], shadow: Deployment
) -> dict[str, Any]:
    """The primary's body as its engine gets it (redacted, output capped), non-streamed, for
    the shadow version: the primary version's defaults taken back out, the shadow's own put
    in, its own ``model``."""
    body = copy.deepcopy(request.body)
    unapply_defaults(body, defaults_filled)
    body["model"] = shadow.model.engine_name
    body["stream"] = False
    body.pop("stream_options", None)
    body.pop("kv_transfer_params", None)
    body.pop("priority", None)
    shadow.model.defaults.apply(body, chat=_is_chat(request))
    return body


def _is_chat(request: Request) -> bool:
    return request.endpoint is Endpoint.CHAT


def _answer_text(answer: dict[str, Any], endpoint: Endpoint) -> str | None:
    choices = answer.get("choices") or []
    return choice_text(choices[0], endpoint, streamed=False) if choices else None


def _completion_tokens(answer: dict[str, Any] | None) -> int | None:
    usage = None if answer is None else answer_usage(answer)
    return None if usage is None else usage.completion_tokens


def _finish_reason(answer: dict[str, Any] | None) -> str | None:
    choices = (answer or {}).get("choices") or []
    return choices[0].get("finish_reason") if choices else None
