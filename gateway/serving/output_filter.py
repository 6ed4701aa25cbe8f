"""Output moderation applied to what the client receives: per choice, in stream order.

Each choice's text goes through its own ``StreamModerator`` (hold-back window with overlap, so
nothing unchecked reaches the client and a term split across chunks is still seen). Chunks are
rewritten to carry only the released text; a chunk left with nothing to say is dropped. A
blocked choice ends at once with ``finish_reason: "content_filter"``; once every choice has
ended that way the relay stops the engine. A non-streaming answer goes through the same
moderator in one piece.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.messages import Endpoint
from core.moderation import ModerationDecision
from moderation.stream import Release, StreamModerator

CONTENT_FILTER = "content_filter"


class OutputFilter:
    """Moderates one request's choices; records decisions with ``on_decisions``."""

    def __init__(
        self,
        endpoint: Endpoint,
        new_moderator: Callable[[], StreamModerator],
        on_decisions: Callable[[list[ModerationDecision]], None],
    ) -> None:
        self._chat = endpoint is Endpoint.CHAT
        self._new_moderator = new_moderator
        self._on_decisions = on_decisions
        self._moderators: dict[int, StreamModerator] = {}
        self._num_recorded: dict[int, int] = {}
        self._ended: set[int] = set()
        self.blocked: set[int] = set()

    @property
    def all_blocked(self) -> bool:
        """Every choice seen so far was cut, and at least one was: nothing left to generate
        (for ``n`` > 1 the relay only knows the choices that have started)."""
        return bool(self.blocked) and self.blocked >= set(self._moderators)

    async def filter_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk as the client may see it, or ``None`` when nothing in it may go yet."""
        kept: list[dict[str, Any]] = []
        for choice in chunk["choices"]:
            filtered = await self._filter_choice(choice)
            if filtered is not None:
                kept.append(filtered)
        if not kept:
            return None
        return {**chunk, "choices": kept}

    async def filter_response(self, response: dict[str, Any]) -> None:
        """Moderate a non-streaming answer in place."""
        for choice in response.get("choices") or []:
            index = int(choice.get("index", 0))
            holder = choice.get("message") if self._chat else choice
            if not isinstance(holder, dict):
                continue
            key = "content" if self._chat else "text"
            text = holder.get(key)
            if not isinstance(text, str) or not text:
                continue
            moderator = self._moderator(index)
            released = _join(await moderator.feed(text), await moderator.finish())
            self._record(index, moderator)
            holder[key] = released.text
            if released.blocked:
                choice["finish_reason"] = CONTENT_FILTER
                choice["stop_reason"] = None
                self.blocked.add(index)

    async def _filter_choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        index = int(choice.get("index", 0))
        if index in self._ended:
            return None  # cut earlier: the engine's later output never reaches the client
        moderator = self._moderator(index)
        text = _text_of(choice, self._chat)
        release = await moderator.feed(text) if text else Release("", False)
        finish_reason = choice.get("finish_reason")
        if finish_reason and not release.blocked:
            release = _join(release, await moderator.finish())
        self._record(index, moderator)
        if release.blocked:
            self._ended.add(index)
            self.blocked.add(index)
            return _with_text(choice, self._chat, release.text, CONTENT_FILTER)
        if finish_reason:
            self._ended.add(index)
        if not release.text and not finish_reason and not _has_other_content(choice, self._chat):
            return None
        return _with_text(choice, self._chat, release.text, finish_reason)

    def _moderator(self, index: int) -> StreamModerator:
        moderator = self._moderators.get(index)
        if moderator is None:
            moderator = self._moderators[index] = self._new_moderator()
        return moderator

    def _record(self, index: int, moderator: StreamModerator) -> None:
        seen = self._num_recorded.get(index, 0)
        if moderator.num_decisions > seen:
            decisions = moderator.decisions
            self._on_decisions(list(decisions[seen:]))
            self._num_recorded[index] = len(decisions)


def _join(first: Release, second: Release) -> Release:
    return Release(first.text + second.text, first.blocked or second.blocked)


def _text_of(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _has_other_content(choice: dict[str, Any], chat: bool) -> bool:
    """A role chunk, tool calls or reasoning: not moderated text, relayed as they come."""
    if not chat:
        return False
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    return any(delta.get(key) is not None for key in delta if key != "content")


def _with_text(
    choice: dict[str, Any], chat: bool, text: str, finish_reason: str | None
) -> dict[str, Any]:
    out = dict(choice)
    if chat:
        delta = dict(choice.get("delta") or {})
        if text or "content" in delta:
            delta["content"] = text
        out["delta"] = delta
    else:
        out["text"] = text
    out["finish_reason"] = finish_reason
    if finish_reason == CONTENT_FILTER:
        out["stop_reason"] = None
    return out
