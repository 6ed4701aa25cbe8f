"""``HangUpCancels``: a hang-up cancels the task that entered the watch, only while it is
entered, and only a cancel the hang-up alone requested is absorbed; the same whether the
server's ``HangUpSignal`` tells it or a watcher task waiting on ``receive()`` does. Its two users are tested
through their own behaviour: ``test_unless_client_leaves.py`` (admission) and the streaming
tests (``EventStream``)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.serving.hangup import (
    HANG_UP_EXTENSION,
    ClientGone,
    HangUpCancels,
    HangUpSignal,
    client_gone_of,
)


class Client:
    """A client that hangs up when told to, heard by a watcher task (any ASGI server)."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def gone(self) -> None:
        await self.left.wait()

    def leave(self) -> None:
        self.left.set()


class SignalledClient:
    """A client whose server fires a ``HangUpSignal`` (the gateway's own HTTP server)."""

    def __init__(self) -> None:
        self.signal = HangUpSignal()

    @property
    def gone(self) -> ClientGone:
        return self.signal

    def leave(self) -> None:
        self.signal.fire()


@pytest.fixture(params=[Client, SignalledClient], ids=["watched", "signalled"])
def client(request: pytest.FixtureRequest) -> Client | SignalledClient:
    """Both ways a watch hears the hang-up: what follows holds for each."""
    kind: type[Client | SignalledClient] = request.param
    return kind()


def _task() -> asyncio.Task[object]:
    task = asyncio.current_task()
    assert task is not None
    return task


async def test_a_hang_up_cancels_the_task_where_it_waits_and_is_absorbed(
    client: Client | SignalledClient,
) -> None:
    asyncio.get_running_loop().call_later(0.01, client.leave)
    with HangUpCancels(client.gone) as watch, pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(5)
    assert watch.client_left
    assert watch.absorb_hang_up()
    assert _task().cancelling() == 0


async def test_a_hang_up_after_the_watch_ended_cancels_nothing(
    client: Client | SignalledClient,
) -> None:
    with HangUpCancels(client.gone) as watch:
        await asyncio.sleep(0)
    client.leave()
    await asyncio.sleep(0.01)  # a cancel, had one been sent, would land here
    assert not watch.client_left
    assert not watch.absorb_hang_up()
    assert _task().cancelling() == 0


async def test_another_cancel_of_the_task_is_not_absorbed() -> None:
    client = Client()
    task = _task()
    with HangUpCancels(client.gone) as watch:
        client.leave()
        await asyncio.sleep(0)  # the watcher sees the hang-up
        task.cancel()  # and the server stops the request too
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(5)
    assert watch.client_left
    assert not watch.absorb_hang_up()  # the server's cancel still goes on up
    assert task.uncancel() == 0


async def test_a_watch_that_fails_leaves_the_task_alone() -> None:
    async def broken() -> None:
        raise OSError("the connection's receive failed")

    with HangUpCancels(broken) as watch:
        await asyncio.sleep(0.01)  # the failed watch must not cancel this wait
    assert not watch.client_left
    assert _task().cancelling() == 0


async def test_entering_outside_a_task_is_refused() -> None:
    watch = HangUpCancels(Client().gone)

    def enter() -> None:
        with watch:
            pass

    # A plain callback runs outside any task: there is nothing to cancel.
    loop = asyncio.get_running_loop()
    failed: asyncio.Future[BaseException] = loop.create_future()

    def call() -> None:
        try:
            enter()
        except RuntimeError as exc:
            failed.set_result(exc)

    loop.call_soon(call)
    assert "from a task" in str(await failed)


async def test_a_signal_fired_before_the_watch_cancels_the_first_wait() -> None:
    client = SignalledClient()
    client.leave()
    with HangUpCancels(client.gone) as watch, pytest.raises(asyncio.CancelledError):
        await asyncio.sleep(5)
    assert watch.absorb_hang_up()


async def test_another_cancel_beside_the_signal_is_not_absorbed() -> None:
    # As the test above, without its loop turn: the signal cancels at once, so a wait between
    # the hang-up and the server's cancel would already raise.
    client = SignalledClient()
    task = _task()
    with HangUpCancels(client.gone) as watch:
        client.leave()
        task.cancel()  # the server stops the request too
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(5)
    assert watch.client_left
    assert not watch.absorb_hang_up()
    assert task.uncancel() == 0


async def test_an_ended_watch_keeps_no_subscriber_on_the_signal() -> None:
    client = SignalledClient()
    with HangUpCancels(client.gone):
        await asyncio.sleep(0)
    assert client.signal._callbacks == []  # the ended watch let go of the task


async def test_the_scope_s_signal_is_used_when_the_server_gives_one() -> None:
    signal = HangUpSignal()

    async def receive() -> dict[str, object]:
        raise AssertionError("with a signal, nothing waits on receive()")

    assert client_gone_of({"extensions": {HANG_UP_EXTENSION: signal}}, receive) is signal
    other = client_gone_of({"type": "http"}, receive)
    assert not isinstance(other, HangUpSignal)
    with HangUpCancels(other) as watch:  # the watcher task calls receive(): its failure is
        await asyncio.sleep(0.01)  # only logged, the task is left alone
    assert not watch.client_left
