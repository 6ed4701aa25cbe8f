"""A provider that asks an OpenAI-compatible ``/v1/moderations`` server (OpenAI itself, or a
self-hosted classifier behind the same API).

A remote classifier gives scores for the whole text, no spans: its hits have
``start = end = None``, so a policy can flag or block on them but not redact.

When the server cannot answer (timeout, connection error, non-200, a body that is not a
moderation response) the provider's failure policy decides: ``open`` lets the text through
unchecked (logged, counted in :attr:`RemoteProvider.failures`); ``closed`` raises
:class:`core.errors.ModerationUnavailableError` (503) so nothing unchecked goes out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import aiohttp

from core.errors import ModerationUnavailableError
from core.moderation import OPENAI_CATEGORIES, Category
from moderation.hits import EMPTY_RESULT, Hit, TextResult

log = logging.getLogger(__name__)

_OPENAI_CHECKED = frozenset(OPENAI_CATEGORIES)


@dataclass(frozen=True)
class RemoteProviderConfig:
    """How to reach one remote moderation server and what to do when it fails."""

    url: str
    """Base URL, e.g. ``http://classifier:8000``; requests go to ``{url}/v1/moderations``."""
    model: str | None = None
    """Sent as ``model``; ``None`` leaves it out (the server's default)."""
    api_key: str | None = None
    """Sent as ``Authorization: Bearer``; ``None`` sends no credential."""
    timeout_s: float = 2.0
    """Whole-request budget; moderation sits on the request path, so keep it short."""
    on_failure: Literal["open", "closed"] = "open"
    """``open``: an unanswered check lets the text through; ``closed``: it fails the request."""
    threshold: float | None = None
    """``None``: trust the server's ``categories`` booleans; a number in [0, 1]: a category
    is hit when its score is at least this."""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) base URL, got {self.url!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(
                f"timeout_s must be a positive number of seconds, got {self.timeout_s}"
            )
        if self.on_failure not in ("open", "closed"):
            raise ValueError(f"on_failure must be 'open' or 'closed', got {self.on_failure!r}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be between 0 and 1, got {self.threshold}")

    @property
    def endpoint(self) -> str:
        """The full moderation URL."""
        return self.url.rstrip("/") + "/v1/moderations"


class RemoteProvider:
    """A :class:`~moderation.provider.ModerationProvider` (and ``ManagedProvider``) that owns
    one ``aiohttp.ClientSession`` from :meth:`start` to :meth:`aclose`."""

    def __init__(self, name: str, config: RemoteProviderConfig) -> None:
        self.name = name
        self.config = config
        self.failures = 0
        """Checks that got no usable answer (any failure policy); the gateway exports it."""
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session (idempotent)."""
        if self._session is None:
            headers = {}
            if self.config.api_key is not None:
                headers["Authorization"] = f"Bearer {self.config.api_key}"
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=aiohttp.ClientTimeout(total=self.config.timeout_s)
            )

    async def aclose(self) -> None:
        """Close the HTTP session (idempotent)."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def check(self, texts: Sequence[str]) -> list[TextResult]:
        """One request for all ``texts``; one result per text, whole-text hits only."""
        if not texts:
            return []
        if self._session is None:
            raise RuntimeError(f"moderation provider {self.name!r} used before start()")
        body: dict[str, Any] = {"input": list(texts)}
        if self.config.model is not None:
            body["model"] = self.config.model
        try:
            async with self._session.post(self.config.endpoint, json=body) as response:
                if response.status != 200:
                    raise _Failure(f"HTTP {response.status}")
                payload = await response.json(content_type=None)
            return self._parse(payload, len(texts))
        except (_Failure, aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return self._failed(exc, len(texts))

    def _failed(self, exc: Exception, count: int) -> list[TextResult]:
        """Apply the failure policy to a check that got no usable answer."""
        self.failures += 1
        reason = _reason(exc)
        if self.config.on_failure == "closed":
            raise ModerationUnavailableError(
                f"moderation provider {self.name!r} at {self.config.endpoint} failed "
                f"({reason}) and its failure policy is closed; fix or scale that server, raise "
                "its timeout_s, or set on_failure to 'open' to let text through unchecked"
            ) from exc
        log.warning(
            "moderation provider %r failed (%s); failing open: %d text(s) not checked",
            self.name,
            reason,
            count,
        )
        return [EMPTY_RESULT] * count

    def _parse(self, payload: Any, count: int) -> list[TextResult]:
        """Map an OpenAI moderation response; ``_Failure`` when it is not one."""
        results = payload.get("results") if isinstance(payload, Mapping) else None
        if not isinstance(results, list) or len(results) != count:
            raise _Failure(f"expected a results list of {count}, got {_shape(results)}")
        return [self._parse_one(item) for item in results]

    def _parse_one(self, item: Any) -> TextResult:
        if not isinstance(item, Mapping):
            raise _Failure("a result is not an object")
        flags = item.get("categories")
        raw_scores = item.get("category_scores")
        if not isinstance(flags, Mapping) or not isinstance(raw_scores, Mapping):
            raise _Failure("a result lacks categories or category_scores")
        scores = dict.fromkeys(Category, 0.0)
        hits: list[Hit] = []
        for category in OPENAI_CATEGORIES:  # other keys (newer categories) are ignored
            score = raw_scores.get(category.value, 0.0)
            if isinstance(score, bool) or not isinstance(score, int | float):
                raise _Failure(f"category_scores[{category.value!r}] is not a number")
            scores[category] = float(score)
            if self.config.threshold is None:
                hit = flags.get(category.value) is True
            else:
                hit = score >= self.config.threshold
            if hit:
                hits.append(Hit(category, self.name, None, None, float(score)))
        return TextResult(tuple(hits), MappingProxyType(scores), _OPENAI_CHECKED)


class _Failure(Exception):
    """The server answered, but not usefully (status or body)."""


def _reason(exc: Exception) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    if isinstance(exc, _Failure):
        return str(exc)
    if isinstance(exc, ValueError):
        return f"body is not JSON: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _shape(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__
