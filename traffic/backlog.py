"""Requests of each version still waiting for their first token: queued for admission, being
prefilled, or handed to a decode worker that has not answered yet. The planner's prefill
backlog (their prompt tokens) and the demand of a pool with no worker (their count).

Requests are counted from the moment they join the admission queue to their first token (or
their end, if none comes); a request's prompt tokens are admission's estimate of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from core.request import Request


@dataclass(frozen=True, slots=True)
class Waiting:
    requests: int
    prompt_tokens: int


class Backlog:
    """Per version, the requests waiting for their first token. Mutated on one event loop."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[Request]] = {}

    @contextmanager
    def waiting(self, request: Request) -> Iterator[None]:
        """Count ``request`` for as long as the block runs."""
        version = request.model.version_name
        waiting = self._waiting.setdefault(version, set())
        waiting.add(request)
        try:
            yield
        finally:
            waiting.discard(request)
            if not waiting:
                self._waiting.pop(version, None)

    def of(self, version: str) -> Waiting:
        waiting = self._waiting.get(version, ())
        tokens = sum(r.estimate.prompt_tokens for r in waiting if r.estimate is not None)
        return Waiting(len(waiting), tokens)
