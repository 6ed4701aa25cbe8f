"""The golden prompts' answers for a rollout's quality check, straight from a version's engine.

Not a client request: no tenant, quota, fairness, ledger row or moderation. Each prompt goes to
the version's least-loaded decode worker (colocated, non-streamed) with the version's own
generation defaults (its system prompt, as clients would get it) and greedy sampling
(temperature 0, a fixed seed), so two runs of one version answer alike and the check compares
the versions, not the dice.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from core.errors import NoHealthyWorkerError
from core.messages import Endpoint
from gateway.catalog import Catalog
from gateway.serving.events import choice_text
from gateway.serving.upstream import EngineClient

_SEED = 0


class EngineCompleter:
    """``rollouts.quality.Completer`` over this gateway's deployments."""

    def __init__(self, engine: EngineClient, catalog: Catalog) -> None:
        self._engine = engine
        self._catalog = catalog

    async def complete(
        self, version: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int
    ) -> str:
        deployment = self._catalog.deployments.get(version)
        if deployment is None:
            raise NoHealthyWorkerError(f"{version} is not deployed on this gateway")
        worker = deployment.decode.pick()
        if worker is None:
            raise NoHealthyWorkerError(f"{version} has no healthy decode worker")
        body: dict[str, Any] = {
            "model": deployment.model.engine_name,
            "messages": [dict(message) for message in messages],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": _SEED,
            "stream": False,
        }
        deployment.model.defaults.apply(body, chat=True)
        with worker.lease():
            answer = await self._engine.post_json(
                worker,
                Endpoint.CHAT.value,
                body,
                f"golden-{secrets.token_hex(6)}",
                prefill=False,
            )
        choices = answer.get("choices") or []
        return (choice_text(choices[0], Endpoint.CHAT, streamed=False) or "") if choices else ""
