"""The interface every moderation provider implements.

A provider turns texts into :class:`~moderation.hits.TextResult` s; it knows nothing of
policies (what to do with a hit is the caller's business). Providers that own resources (a
remote provider's HTTP session) also implement :class:`ManagedProvider`: the
:class:`~moderation.moderator.Moderator` starts and closes exactly those, found with
``isinstance`` on this runtime-checkable protocol, so a provider without resources (the rule
set) need not carry empty ``start``/``aclose`` methods.

A provider whose matches have a bounded length (the rules) also exposes ``max_term_chars``;
the moderator refuses a stream window shorter than that, since a longer match could leave
before it is complete.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from moderation.hits import TextResult


class ModerationProvider(Protocol):
    """Checks texts for the moderation categories."""

    name: str
    """The name policies use to pick this provider."""

    async def check(self, texts: Sequence[str]) -> list[TextResult]:
        """One result per text, in the same order.

        A provider whose failure policy is closed raises
        :class:`core.errors.ModerationUnavailableError` when it cannot answer.
        """
        ...


@runtime_checkable
class ManagedProvider(Protocol):
    """A provider with a lifecycle: started before the first check, closed at shutdown."""

    async def start(self) -> None:
        """Acquire what ``check`` needs (sessions, connections)."""
        ...

    async def aclose(self) -> None:
        """Release it; calling twice is harmless."""
        ...
