"""The moderation facade the gateway uses: named providers, a policy, a verdict.

Providers are built once at startup and named; a tenant's policy picks providers by name per
stage. The moderator runs a stage's providers concurrently, applies the policy's actions to
their hits and reports what it did as :class:`~core.moderation.ModerationDecision` s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from core.moderation import (
    Action,
    Category,
    ModerationDecision,
    ModerationPolicy,
    Stage,
    StagePolicy,
)
from moderation.hits import Hit, TextResult, merge_results
from moderation.provider import ManagedProvider, ModerationProvider
from moderation.redact import Redaction, apply
from moderation.stream import StreamConfig, StreamModerator


@dataclass(frozen=True)
class InputVerdict:
    """The outcome of input moderation for one request."""

    blocked: bool
    """A BLOCK hit (or a whole-text REDACT hit): refuse with 400 ``content_filter``."""
    texts: tuple[str, ...]
    """The checked texts, redacted where the policy says so, else unchanged."""
    decisions: tuple[ModerationDecision, ...]
    """One per acted-on hit (flags included), stage INPUT."""
    blocked_categories: tuple[Category, ...]
    """The categories that blocked, in first-seen order (for the error message)."""


class Moderator:
    """Runs the configured providers for input checks, output streams and
    ``/v1/moderations``; owns their lifecycle."""

    def __init__(
        self, providers: Mapping[str, ModerationProvider], stream_config: StreamConfig
    ) -> None:
        for key, provider in providers.items():
            if provider.name != key:
                raise ValueError(f"provider registered as {key!r} is named {provider.name!r}")
            # A term longer than the window could be released before it is complete.
            needed = getattr(provider, "max_term_chars", 0)
            if isinstance(needed, int) and needed > stream_config.window_chars:
                raise ValueError(
                    f"moderation stream window_chars ({stream_config.window_chars}) is shorter "
                    f"than the longest match of provider {key!r} ({needed} characters); raise "
                    f"window_chars to at least {needed} or shorten that provider's rules"
                )
        self._providers = dict(providers)
        self._stream_config = stream_config

    @property
    def provider_names(self) -> frozenset[str]:
        """The names policies may use."""
        return frozenset(self._providers)

    def check_policy(self, policy: ModerationPolicy) -> None:
        """``ValueError`` naming the first provider ``policy`` uses that is not configured."""
        for stage in Stage:
            for name in policy.stage(stage).providers:
                if name not in self._providers:
                    known = ", ".join(sorted(self._providers)) or "none"
                    raise ValueError(
                        f"moderation.{stage.value}.providers: unknown provider {name!r}; "
                        f"configured providers: {known}"
                    )

    async def start(self) -> None:
        """Start the providers that have a lifecycle (closing them again if one fails)."""
        started: list[ManagedProvider] = []
        try:
            for provider in self._providers.values():
                if isinstance(provider, ManagedProvider):
                    await provider.start()
                    started.append(provider)
        except BaseException:
            await _close_all(started)
            raise

    async def aclose(self) -> None:
        """Close every provider that has a lifecycle."""
        await _close_all([p for p in self._providers.values() if isinstance(p, ManagedProvider)])

    async def check_input(self, policy: StagePolicy, texts: Sequence[str]) -> InputVerdict:
        """Apply an input-stage policy to a request's texts."""
        if not policy.enabled or not texts:
            return InputVerdict(False, tuple(texts), (), ())
        merged = await self.classify(texts, policy.providers)
        decisions: list[ModerationDecision] = []
        blocked: list[Category] = []
        out: list[str] = []
        for text, result in zip(texts, merged, strict=True):
            redactions: list[Redaction] = []
            for hit in sorted(result.hits, key=_hit_order):
                action = policy.action_for(hit.category)
                if action is Action.ALLOW:
                    continue
                if action is Action.REDACT and (hit.start is None or hit.end is None):
                    action = Action.BLOCK  # nothing to redact: the whole text is the hit
                decisions.append(_decision(Stage.INPUT, hit, action))
                if action is Action.BLOCK and hit.category not in blocked:
                    blocked.append(hit.category)
                elif action is Action.REDACT and hit.start is not None and hit.end is not None:
                    label = hit.detector or hit.category.value
                    redactions.append(Redaction(hit.start, hit.end, label))
            out.append(apply(text, redactions) if redactions else text)
        return InputVerdict(bool(blocked), tuple(out), tuple(decisions), tuple(blocked))

    def output_stream(self, policy: StagePolicy) -> StreamModerator:
        """A moderator for one streamed choice under an output-stage policy."""
        providers = self._pick(policy.providers)
        if len(providers) == 1:  # the usual policy: checked at every chunk, so no extra layers
            provider = providers[0]

            async def check(text: str) -> list[Hit]:
                [result] = _checked(provider, (text,), await provider.check((text,)))
                return list(result.hits)

        else:

            async def check(text: str) -> list[Hit]:
                results = await _run_all(providers, [text])
                return [hit for result in results for hit in result[0].hits]

        return StreamModerator(check, policy, self._stream_config)

    async def classify(self, texts: Sequence[str], providers: Sequence[str]) -> list[TextResult]:
        """Every named provider on ``texts``, merged per text: all hits, the best score per
        category. For ``/v1/moderations`` and input checks."""
        if not texts:
            return []
        results = await _run_all(self._pick(providers), texts)
        return [merge_results(per_text) for per_text in zip(*results, strict=True)]

    def _pick(self, names: Sequence[str]) -> list[ModerationProvider]:
        missing = [name for name in names if name not in self._providers]
        if missing:
            raise ValueError(f"unknown moderation providers {missing}; check_policy first")
        return [self._providers[name] for name in names]


async def _run_all(
    providers: Sequence[ModerationProvider], texts: Sequence[str]
) -> list[list[TextResult]]:
    """Run providers concurrently. Every check finishes (each has its own timeout) before the
    first error is raised, so a fail-closed provider's error is not lost in a group and no
    check is left running unowned."""
    if len(providers) == 1:  # the usual policy: no task to run one check beside nothing
        return [_checked(providers[0], texts, await providers[0].check(texts))]
    outcomes = await asyncio.gather(*(p.check(texts) for p in providers), return_exceptions=True)
    results: list[list[TextResult]] = []
    for provider, outcome in zip(providers, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            raise outcome
        results.append(_checked(provider, texts, outcome))
    return results


def _checked(
    provider: ModerationProvider, texts: Sequence[str], outcome: list[TextResult]
) -> list[TextResult]:
    if len(outcome) != len(texts):
        raise RuntimeError(
            f"moderation provider {provider.name!r} returned {len(outcome)} results "
            f"for {len(texts)} texts"
        )
    return outcome


async def _close_all(providers: Sequence[ManagedProvider]) -> None:
    outcomes = await asyncio.gather(*(p.aclose() for p in providers), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


def _hit_order(hit: Hit) -> tuple[int, int]:
    return (-1 if hit.start is None else hit.start, -1 if hit.end is None else hit.end)


def _decision(stage: Stage, hit: Hit, action: Action) -> ModerationDecision:
    return ModerationDecision(stage, hit.provider, hit.category, action, hit.detector)
