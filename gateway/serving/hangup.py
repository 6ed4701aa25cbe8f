"""A client's hang-up cancels the request's own task: the one way the serving path notices it.

The server does not cancel a handler whose client left, so whatever a request waits for (a
place in the fair queue, an engine's next token) has to be interrupted by someone watching.
``HangUpCancels`` watches for the current task: when the client hangs up it cancels the task,
which stops the wait where it is (the queue entry leaves, the engine call is aborted). The work
itself stays in the request's task: a task of its own for the work would cost every request a
hop through the event loop before it even started.

Two ways to hear the hang-up (``ClientGone``):

- the gateway's own HTTP server (``gateway/cli/http_protocol.py``) puts a ``HangUpSignal`` in
  the request's ASGI scope (``scope["extensions"]["tandem.hang_up"]``) and fires it from the
  connection's ``connection_lost``: no task, no wait, nothing held per request but the signal;
- any other ASGI server: a coroutine function that returns once ``receive()`` says
  ``http.disconnect``, run in a watcher task for as long as the watch lasts.

The task then tells that cancel apart from any other (the server stopping) with
``absorb_hang_up``: only a cancel the hang-up alone requested is absorbed. ``unless_client_leaves``
turns a hang-up into ``ClientDisconnectedError`` for one piece of work; it is how admission
(``gate.py``), a non-streaming answer (``flow.py``) and a stream's wait to commit (``sse.py``)
watch, and ``sse.EventStream`` watches its stream itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

from starlette.types import Receive

from core.errors import ClientDisconnectedError

log = logging.getLogger("tandem.requests")

T = TypeVar("T")

HANG_UP_EXTENSION = "tandem.hang_up"
"""The ASGI scope extension under which a server puts a request's ``HangUpSignal``."""


class HangUpSignal:
    """The server's notice that a request's client hung up before its response completed.

    ``fire`` runs each subscriber once, at once; a subscriber that comes after the hang-up
    is run as it subscribes."""

    __slots__ = ("_callbacks", "fired")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.fired = False

    def subscribe(self, callback: Callable[[], None]) -> None:
        if self.fired:
            callback()
        else:
            self._callbacks.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


ClientGone = HangUpSignal | Callable[[], Awaitable[None]]
"""How a request hears its client hang up: the server's ``HangUpSignal``, or a coroutine
function that returns once the client has hung up (never while it is connected)."""


def client_gone_of(scope: Mapping[str, Any], receive: Receive) -> ClientGone:
    """The scope's ``HangUpSignal`` when the server gives one, else a wait on ``receive``.
    Only for after the request's body was read: then the next message is the disconnect."""
    signal = scope.get("extensions", {}).get(HANG_UP_EXTENSION)
    if isinstance(signal, HangUpSignal):
        return signal
    return partial(_disconnected, receive)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


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
        self._watcher: asyncio.Future[None] | None = None  # only without a signal
        self._watching = False
        self.client_left = False

    def __enter__(self) -> HangUpCancels:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("HangUpCancels is entered from a task, which it cancels")
        self._task = task
        self._watching = True
        if isinstance(self._client_gone, HangUpSignal):
            self._client_gone.subscribe(self._hung_up)
        else:
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
        if isinstance(self._client_gone, HangUpSignal):
            self._client_gone.unsubscribe(self._hung_up)
        elif self._watcher is not None:
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
        self._hung_up()

    def _hung_up(self) -> None:
        if not self._watching or self.client_left:
            return
        assert self._task is not None
        self.client_left = True
        self._task.cancel()


async def unless_client_leaves(
    work: Awaitable[T],
    client_gone: ClientGone,
    gone_message: str,
    discard: Callable[[T], Awaitable[None]] | None = None,
) -> T:
    """``work``'s result, unless the client hangs up first: then ``work`` is cancelled (a
    queue entry leaves, an engine call is aborted) and ``ClientDisconnectedError`` raised. A
    result that ``work`` returns all the same (it finished as the hang-up came) goes to
    ``discard``, since nobody will use it. ``work`` runs in the caller's own task
    (``HangUpCancels``)."""
    with HangUpCancels(client_gone) as watch:
        try:
            result = await work
        except asyncio.CancelledError:
            if watch.absorb_hang_up():
                raise ClientDisconnectedError(gone_message) from None
            raise  # cancelled from elsewhere (the server stopping) too: that goes on up
        except BaseException:
            watch.absorb_hang_up()  # ``work`` failed on its own as the hang-up came: that goes up
            raise
    if watch.client_left:  # ``work`` finished despite the cancel: the hang-up still wins
        watch.absorb_hang_up()
        if discard is not None:
            await discard(result)
        raise ClientDisconnectedError(gone_message)
    return result
