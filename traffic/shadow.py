"""The in-flight cap on shadow copies, per shadow version, on one gateway.

A shadow copy is never worth queueing: past the cap it is dropped and counted, so a slow shadow
version can never hold back or pile up behind the traffic it copies. Single-threaded (one event
loop), so plain counters suffice.
"""

from __future__ import annotations


class ShadowLimiter:
    """Counts shadow copies in flight, sent and dropped, per version."""

    __slots__ = ("_dropped", "_in_flight", "_sent")

    def __init__(self) -> None:
        self._in_flight: dict[str, int] = {}
        self._sent: dict[str, int] = {}
        self._dropped: dict[str, int] = {}

    def try_acquire(self, version: str, max_in_flight: int) -> bool:
        """Take a slot for a copy to ``version``: True (sent; ``release`` it when it ends) or
        False when ``max_in_flight`` copies are already running (dropped and counted)."""
        running = self._in_flight.get(version, 0)
        if running >= max_in_flight:
            self._dropped[version] = self._dropped.get(version, 0) + 1
            return False
        self._in_flight[version] = running + 1
        self._sent[version] = self._sent.get(version, 0) + 1
        return True

    def release(self, version: str) -> None:
        """Give back the slot of a copy to ``version`` that ended, however it ended."""
        running = self._in_flight.get(version, 0)
        if running <= 0:
            # A second release would let one more copy in than the cap: a bug, not a state.
            raise ValueError(f"no shadow copy to {version!r} is in flight")
        if running == 1:
            del self._in_flight[version]
        else:
            self._in_flight[version] = running - 1

    def in_flight(self, version: str) -> int:
        """Copies to ``version`` running now."""
        return self._in_flight.get(version, 0)

    def sent(self, version: str) -> int:
        """Copies to ``version`` ever let through."""
        return self._sent.get(version, 0)

    def dropped(self, version: str) -> int:
        """Copies to ``version`` ever dropped at the cap."""
        return self._dropped.get(version, 0)
