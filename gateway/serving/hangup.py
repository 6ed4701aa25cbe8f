"""A client's hang-up cancels the request's own task: the one way the serving path notices it.

The server does not cancel a handler whose client left, so whatever a request waits for (a
place in the fair queue, an engine's next token) has to be interrupted by someone watching.
``HangUpCancels`` starts one watcher for the current task: when ``client_gone`` returns it
cancels the task, which stops the wait where it is (the queue entry leaves, the engine call is
aborted). The work itself stays in the request's task: a task of its own for the work would
cost every request a hop through the event loop before it even started.

The task then tells that cancel apart from any other (the server stopping) with
``absorb_hang_up``: only a cancel the hang-up alone requested is absorbed. Used by admission
(``gate.unless_client_leaves``) and by the streaming response (``sse.EventStream``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType

log = logging.getLogger("tandem.requests")

ClientGone = Callable[[], Awaitable[None]]
"""Returns once the client has hung up; never returns while it is connected."""


class HangUpCancels:
    """While entered, the client's hang-up cancels the task that entered it.

    ``client_left`` says whether it did. After a ``CancelledError``, ``absorb_hang_up()``
    says whether the hang-up was its only cause (and takes that cancel back); after work that
    ended otherwise, ``absorb_hang_up()`` takes back a cancel the work outlived. Leaving stops
    the watch: a hang-up after that cancels nothing.
    """

    __slots__ = ("_client_gone", "_task", "_watcher", "_watching", "client_left")

    def __init__(self, client_gone: ClientGone) -> None:
        self._client_gone = client_gone
        self._task: asyncio.Task[object] | None = None
        self._watcher: asyncio.Future[None] | None = None
        self._watching = False
        self.client_left = False

    def __enter__(self) -> HangUpCancels:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("HangUpCancels is entered from a task, which it cancels")
        self._task = task
        self._watching = True
        self._watcher = asyncio.ensure_future(self._client_gone())
        self._watcher.add_done_callback(self._on_gone)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        """No cancel from here on (idempotent): the work is over or past being interrupted."""
        self._watching = False
        if self._watcher is not None:
            self._watcher.cancel()  # a cancelled wait for the hang-up consumes nothing

    def absorb_hang_up(self) -> bool:
        """True when the client left and no other cancel of the task is pending: the hang-up's
        own cancel is taken back, and the caller ends the request as a hang-up. False when the
        client is still there or the task was also cancelled from elsewhere (that goes on up)."""
        if not self.client_left:
            return False
        assert self._task is not None
        return self._task.uncancel() == 0

    def _on_gone(self, watcher: asyncio.Future[None]) -> None:
        # ``_watching``: this callback may run after the work ended (it was scheduled first).
        if not self._watching or watcher.cancelled():
            return
        if (error := watcher.exception()) is not None:  # no way left to hear a hang-up
            log.debug("the watch for the client hanging up failed: %r", error)
            return
        assert self._task is not None
        self.client_left = True
        self._task.cancel()
