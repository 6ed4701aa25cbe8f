"""``unless_client_leaves``: the work runs in the caller's task, a hang-up cancels it, and the
task's cancellation count is balanced however it ends (an ``asyncio.timeout`` later in the same
task must still tell its own expiry from a cancel)."""

from __future__ import annotations

import asyncio

import pytest

from core.errors import ClientDisconnectedError
from gateway.serving.hangup import unless_client_leaves


class Client:
    """A client that hangs up when told to."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def gone(self) -> None:
        await self.left.wait()


async def test_the_work_s_result_when_the_client_stays() -> None:
    client = Client()

    async def work() -> str:
        await asyncio.sleep(0.01)
        return "done"

    assert await unless_client_leaves(work(), client.gone, "gone") == "done"
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_hang_up_cancels_the_work_where_it_waits() -> None:
    client = Client()
    cleaned_up = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned_up.set()
        return "never"

    asyncio.get_running_loop().call_later(0.01, client.left.set)
    with pytest.raises(ClientDisconnectedError, match="the client left"):
        await unless_client_leaves(work(), client.gone, "the client left")
    assert cleaned_up.is_set()
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
    await asyncio.sleep(0)  # no cancellation is left pending on this task


async def test_a_result_returned_despite_the_hang_up_is_discarded() -> None:
    client = Client()
    discarded: list[str] = []

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "finished anyway"  # e.g. a grant that arrived with the cancel
        return "never"

    async def discard(result: str) -> None:
        discarded.append(result)

    asyncio.get_running_loop().call_later(0.01, client.left.set)
    with pytest.raises(ClientDisconnectedError):
        await unless_client_leaves(work(), client.gone, "gone", discard=discard)
    assert discarded == ["finished anyway"]
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_a_cancel_from_elsewhere_goes_on_up() -> None:
    client = Client()
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.sleep(30)

    async def caller() -> None:
        await unless_client_leaves(work(), client.gone, "gone")

    task = asyncio.create_task(caller())
    await started.wait()
    task.cancel()  # the server stopping, not the client leaving
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_hang_up_as_the_work_ends_changes_nothing() -> None:
    """The watcher finishes in the same turn of the loop as the work: its callback then runs
    after the work returned, and must not cancel the task that moved on."""
    client = Client()
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    async def work() -> str:
        await ready
        return "done"

    def hang_up_and_finish() -> None:
        client.left.set()  # wakes the watcher first...
        ready.set_result(None)  # ...then the work, in the same turn

    loop.call_later(0.01, hang_up_and_finish)
    assert await unless_client_leaves(work(), client.gone, "gone") == "done"
    await asyncio.sleep(0.01)  # a late watcher callback would cancel this task here
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
