"""Moderation as the gateway applies it: the tenant's policy, input before admission, output
on the relay, and every decision recorded on the request and counted.

    plan.moderation (or the gateway's default) -> check_input: block -> 400 content_filter,
    redact -> the engine gets the redacted prompt -> output_filter for the relay
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from admission.tenants import Tenant
from core.errors import ContentFilterError
from core.moderation import ModerationDecision, ModerationPolicy
from core.request import Request
from gateway.metrics import GatewayMetrics
from gateway.serving.output_filter import OutputFilter
from moderation.inputs import with_texts
from moderation.moderator import Moderator
from moderation.provider import ModerationProvider
from moderation.remote import RemoteProvider, RemoteProviderConfig
from moderation.rules import RulesProvider, load_rules
from moderation.stream import StreamConfig

log = logging.getLogger("tandem.moderation")


RULES_PROVIDER = "rules"


@dataclass(frozen=True, slots=True)
class ModerationSetup:
    """The gateway's moderation providers and the policy of tenants that set none."""

    rules_path: Path | None = None
    """The operator's rules file (JSON); ``None`` = the shipped default rules."""
    remote: Mapping[str, RemoteProviderConfig] = field(default_factory=lambda: MappingProxyType({}))
    """OpenAI-compatible ``/v1/moderations`` servers, by the name policies use."""
    default_policy: ModerationPolicy = field(default_factory=ModerationPolicy)
    """For tenants whose plan has no moderation policy (the default checks nothing)."""
    stream: StreamConfig = field(default_factory=StreamConfig)
    """Output hold-back window."""


def build_moderator(setup: ModerationSetup) -> Moderator:
    """The built-in rules provider (``rules``) and the configured remote ones; the default
    policy must only name those (``ValueError`` otherwise)."""
    if RULES_PROVIDER in setup.remote:
        raise ValueError(f"'{RULES_PROVIDER}' is the built-in provider; name remote ones otherwise")
    providers: dict[str, ModerationProvider] = {
        RULES_PROVIDER: RulesProvider(load_rules(setup.rules_path), name=RULES_PROVIDER)
    }
    for name, config in setup.remote.items():
        providers[name] = RemoteProvider(name, config)
    moderator = Moderator(providers, setup.stream)
    moderator.check_policy(setup.default_policy)
    return moderator


class ContentPolicy:
    """Applies each tenant's moderation policy with the gateway's providers."""

    def __init__(
        self, moderator: Moderator, default_policy: ModerationPolicy, metrics: GatewayMetrics
    ) -> None:
        self.moderator = moderator
        self._default = default_policy
        self._metrics = metrics

    def policy_for(self, tenant: Tenant) -> ModerationPolicy:
        return tenant.plan.moderation or self._default

    async def check_input(self, request: Request, policy: ModerationPolicy) -> None:
        """Check the prompt; the engine gets it redacted where the policy says so (the request's
        body is replaced); 400 ``content_filter`` when the policy blocks it."""
        texts = request.prompt.texts
        if not policy.input.enabled or not texts:
            return
        verdict = await self.moderator.check_input(policy.input, list(texts))
        self._record(request, list(verdict.decisions))
        if verdict.blocked:
            categories = ", ".join(sorted(c.value for c in verdict.blocked_categories))
            raise ContentFilterError(
                f"The request was blocked by this tenant's content policy ({categories}); "
                "change the prompt and retry.",
                param=request.prompt.param,
            )
        if tuple(verdict.texts) != texts:
            request.redact(with_texts(request.endpoint, request.body, list(verdict.texts)))

    def output_filter(self, request: Request, policy: ModerationPolicy) -> OutputFilter | None:
        """The relay's output moderation, or ``None`` when the policy checks no output."""
        if not policy.output.enabled:
            return None
        return OutputFilter(
            request.endpoint,
            lambda: self.moderator.output_stream(policy.output),
            lambda decisions: self._record(request, decisions),
        )

    def _record(self, request: Request, decisions: list[ModerationDecision]) -> None:
        request.record_moderation(decisions)
        for decision in decisions:
            self._metrics.observe_moderation(decision)
            log.info(
                "request %s: %s moderation %s %s by %s (%s)",
                request.request_id, decision.stage, decision.action, decision.category,
                decision.provider, decision.detector,
            )  # fmt: skip
