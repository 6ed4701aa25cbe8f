"""Output moderation of one streamed choice: hold back a window, check, release.

The stream arrives in chunks that may cut a term anywhere ("how to ki" + "ll myself"), so
text is released only once nothing that starts in it can still be completed by later chunks:

1. New text joins ``pending`` (unreleased). While ``pending`` is no longer than
   ``window_chars`` nothing is checked or released.
2. Otherwise check ``context + pending``, where ``context`` is the last ``overlap_chars`` of
   what was already released (so word edges and phrase starts are seen).
3. Everything but the last ``window_chars`` of ``pending`` may go out. Because the window is
   at least as long as the longest term the rules match, a term whose start is releasable is
   complete in the checked text, so it is decided before any of it leaves.
4. Per hit (by the stage policy): BLOCK releases nothing from the hit's start on and ends the
   choice; REDACT replaces the span with ``[REDACTED:<detector>]`` (a span the window
   boundary cuts is held back whole until it is complete); FLAG records and changes nothing;
   ALLOW is ignored. A whole-text hit (remote providers) cannot be redacted: it blocks.
   Hits lying wholly in ``context`` were decided before and are skipped; one that starts there
   and runs into ``pending`` is acted on from ``pending``'s start.
5. :meth:`StreamModerator.finish` checks and releases the rest at the end of the choice.

Each check sees at most ``overlap_chars + window_chars`` plus the newest chunk (and
``batch_chars``), so the cost per chunk does not grow with the length of the output.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from core.moderation import Action, Category, ModerationDecision, Stage, StagePolicy
from moderation.hits import Hit
from moderation.redact import Redaction, apply

CheckFn = Callable[[str], Awaitable[list[Hit]]]
"""Runs the stage's providers on one text and returns all their hits (spans into it)."""


@dataclass(frozen=True)
class StreamConfig:
    """How much output text to hold back while it is checked."""

    window_chars: int = 48
    """Unreleased characters kept back after each check; must be at least the longest term
    or pattern the rules can match (the moderator checks this at startup)."""
    overlap_chars: int = 48
    """Already-released characters checked again before the new text, for context."""
    batch_chars: int = 0
    """When > 0, check and release only once at least this many characters can go out, so a
    slow remote provider is called per batch rather than per token."""

    def __post_init__(self) -> None:
        for name in ("window_chars", "overlap_chars", "batch_chars"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class Release:
    """What a feed or finish lets through."""

    text: str
    """The text the client may receive now (redacted where the policy says)."""
    blocked: bool
    """The choice hit a BLOCK: end it with ``finish_reason: "content_filter"``."""


@dataclass(frozen=True, slots=True)
class _Span:
    hit: Hit
    action: Action
    start: int  # in pending's coordinates, clipped to 0
    end: int
    key: tuple[str, Category, str | None, int]  # identifies the hit across checks


class StreamModerator:
    """Moderates the text of one streamed choice; feed it chunks in order."""

    def __init__(self, check: CheckFn, policy: StagePolicy, config: StreamConfig) -> None:
        self._check = check
        self._policy = policy
        # StagePolicy is frozen: read its ``enabled`` (a scan of its actions) once, not per chunk.
        self._enabled = policy.enabled
        self._config = config
        self._pending = ""
        self._pending_start = 0  # offset of pending[0] in the whole output
        self._context = ""  # the released original text just before pending
        self._blocked = False
        self._decisions: list[ModerationDecision] = []
        self._seen: set[tuple[str, Category, str | None, int]] = set()
        self._seen_whole: set[tuple[str, Category]] = set()

    @property
    def decisions(self) -> tuple[ModerationDecision, ...]:
        """Every decision taken on this choice (flags included), in order."""
        return tuple(self._decisions)

    @property
    def num_decisions(self) -> int:
        """``len(decisions)``, without the copy (read at every chunk)."""
        return len(self._decisions)

    @property
    def blocked(self) -> bool:
        """True once a BLOCK ended the choice; later feeds release nothing."""
        return self._blocked

    async def feed(self, text: str) -> Release:
        """Add the next chunk; return what may be sent now.

        Errors of the check (a fail-closed provider's ``ModerationUnavailableError``) pass
        through: the stream has started, so the caller ends it with an error event.
        """
        if self._blocked:
            return Release("", True)
        self._pending += text
        if not self._enabled:
            return self._release_unchecked()
        releasable = len(self._pending) - self._config.window_chars
        if releasable < max(1, self._config.batch_chars):
            return Release("", False)
        return await self._release(final=False)

    async def finish(self) -> Release:
        """The choice ended: check and release everything still held back."""
        if self._blocked:
            return Release("", True)
        if not self._pending:
            return Release("", False)
        if not self._enabled:
            return self._release_unchecked()
        return await self._release(final=True)

    def _release_unchecked(self) -> Release:
        text, self._pending = self._pending, ""
        return Release(text, False)

    async def _release(self, final: bool) -> Release:
        context, pending = self._context, self._pending
        hits = await self._check(context + pending)
        cut = len(pending) if final else len(pending) - self._config.window_chars
        if not hits:  # the usual check: everything up to the window goes out as it is
            released = pending[:cut]
            self._advance(released, cut)
            return Release(released, False)
        spans, whole = self._classify(hits, len(context))

        # A redaction the boundary cuts may still grow (an email whose domain is arriving):
        # hold it back whole. Moving the cut can cut another span, hence the loop.
        moved = True
        while moved:
            moved = False
            for span in spans:
                if span.action is Action.REDACT and span.start < cut < span.end:
                    cut, moved = span.start, True

        block_at: int | None = None
        if any(action in (Action.BLOCK, Action.REDACT) for _, action in whole):
            block_at = 0
        for span in spans:
            if span.action is Action.BLOCK and span.start < cut:
                block_at = span.start if block_at is None else min(block_at, span.start)
        stop = cut if block_at is None else block_at

        for hit, action in whole:
            self._record_whole(hit, Action.BLOCK if action is Action.REDACT else action)
        redactions: list[Redaction] = []
        for span in sorted(spans, key=lambda s: s.start):
            # Decide what the client will have read past, and the hit that stops it.
            stops_here = span.action is Action.BLOCK and span.start == block_at
            if span.start >= stop and not stops_here:
                continue
            if span.key not in self._seen:
                self._seen.add(span.key)
                self._record(span.hit, span.action)
            if span.action is Action.REDACT:
                label = span.hit.detector or span.hit.category.value
                redactions.append(Redaction(span.start, min(span.end, stop), label))

        released = pending[:stop]
        self._advance(released, stop)
        if block_at is not None:
            self._blocked = True
            self._pending = ""
        return Release(apply(released, redactions), self._blocked)

    def _classify(
        self, hits: list[Hit], offset: int
    ) -> tuple[list[_Span], list[tuple[Hit, Action]]]:
        """Split hits into span hits (moved to pending's coordinates) and whole-text hits,
        dropping allowed ones and those wholly in the already-released context."""
        spans: list[_Span] = []
        whole: list[tuple[Hit, Action]] = []
        for hit in hits:
            action = self._policy.action_for(hit.category)
            if action is Action.ALLOW:
                continue
            if hit.start is None or hit.end is None:
                whole.append((hit, action))
                continue
            start, end = hit.start - offset, hit.end - offset
            if end <= 0:
                continue
            key = (hit.provider, hit.category, hit.detector, self._pending_start + start)
            spans.append(_Span(hit, action, max(start, 0), end, key))
        return spans, whole

    def _advance(self, released: str, count: int) -> None:
        """Move ``count`` characters from pending to the released context."""
        overlap = self._config.overlap_chars
        self._context = (self._context + released)[-overlap:] if overlap else ""
        self._pending = self._pending[count:]
        self._pending_start += count
        # Hits starting before the context can never be seen again: forget them.
        horizon = self._pending_start - len(self._context)
        if self._seen:
            self._seen = {key for key in self._seen if key[3] >= horizon}

    def _record(self, hit: Hit, action: Action) -> None:
        self._decisions.append(
            ModerationDecision(Stage.OUTPUT, hit.provider, hit.category, action, hit.detector)
        )

    def _record_whole(self, hit: Hit, action: Action) -> None:
        """A whole-text hit is seen again by every later check: record it once per choice."""
        key = (hit.provider, hit.category)
        if key not in self._seen_whole:
            self._seen_whole.add(key)
            self._record(hit, action)
