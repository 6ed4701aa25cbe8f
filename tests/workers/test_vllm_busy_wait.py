"""The busy-wait plugin (``workers/vllm_busy_wait.py``) on vLLM's own ``SpinCondition``: in the
second after its last message a reader sleeps between looks instead of spinning; past it, vLLM's
wait on a ZeroMQ notification is unchanged; a bad setting fails naming the variable."""

from __future__ import annotations

import importlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from workers import vllm_busy_wait
from workers.vllm_busy_wait import PAUSE_ENV, install, parse_pause

# vLLM is always installed beside Tandem; by name, as the plugin finds it (the import contract).
shm_broadcast: Any = importlib.import_module("vllm.distributed.device_communicators.shm_broadcast")
SpinCondition: Any = shm_broadcast.SpinCondition
PAUSE_US = 2_000


@pytest.fixture
def yields(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts vLLM's spins: each look of a spinning reader is one ``sched_yield``. The class's
    ``wait`` is restored after the test, whatever it installed."""
    counted: list[int] = []
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: counted.append(1))
    monkeypatch.setattr(SpinCondition, "wait", SpinCondition.wait)
    return counted


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    """A reader and the writer that notifies it, over ZeroMQ as vLLM's queues connect them."""
    context = zmq.Context()
    address = f"ipc:///tmp/tandem-busy-wait-{uuid.uuid4().hex}"
    writer = SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = SpinCondition(is_reader=True, context=context, notify_address=address)
    try:
        yield reader, writer
    finally:
        for socket in (reader.local_notify_socket, writer.local_notify_socket):
            socket.close(linger=0)
        for socket in (reader.read_cancel_socket, reader.write_cancel_socket):
            socket.close(linger=0)
        context.term()


def _looks(reader: Any, times: int) -> float:
    started = time.monotonic()
    for _ in range(times):
        reader.wait()
    return time.monotonic() - started


def test_vllms_reader_spins_in_its_busy_second(yields: list[int], pair: tuple[Any, Any]) -> None:
    reader, _ = pair
    reader.record_read()
    _looks(reader, 20)
    assert len(yields) == 20  # what the plugin replaces: without it, every look spins


def test_in_its_busy_second_a_reader_sleeps_between_looks(
    yields: list[int], pair: tuple[Any, Any]
) -> None:
    reader, _ = pair
    install(SpinCondition, PAUSE_US)
    reader.record_read()
    assert _looks(reader, 20) >= 20 * PAUSE_US / 1e6
    assert yields == []


def test_past_its_busy_second_a_reader_waits_for_the_notification_as_before(
    yields: list[int], pair: tuple[Any, Any]
) -> None:
    reader, writer = pair
    install(SpinCondition, PAUSE_US)
    reader.last_read = time.monotonic() - reader.busy_loop_s - 1
    started = time.monotonic()
    reader.wait(timeout_ms=50)  # nothing written: the poll's timeout ends it
    assert time.monotonic() - started >= 0.04
    time.sleep(0.1)  # ZeroMQ connects the subscriber in the background
    writer.notify()
    started = time.monotonic()
    reader.wait(timeout_ms=10_000)
    assert time.monotonic() - started < 5, "the writer's notification woke the reader"
    assert yields == []


def test_installing_twice_wraps_once_and_zero_changes_nothing(yields: list[int]) -> None:
    vllms = SpinCondition.wait
    install(SpinCondition, 0)
    assert SpinCondition.wait is vllms
    install(SpinCondition, PAUSE_US)
    installed = SpinCondition.wait
    install(SpinCondition, PAUSE_US * 2)
    assert SpinCondition.wait is installed is not vllms


def test_register_installs_only_where_tandem_asked(
    yields: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    vllms = SpinCondition.wait
    monkeypatch.delenv(PAUSE_ENV, raising=False)
    vllm_busy_wait.register()
    assert SpinCondition.wait is vllms
    monkeypatch.setenv(PAUSE_ENV, "100")
    vllm_busy_wait.register()
    assert getattr(SpinCondition.wait, "tandem_sleeps", False)


@pytest.mark.parametrize(
    ("raw", "message"),
    [("fast", "not a whole number"), ("-1", "out of range"), ("100001", "out of range")],
)
def test_a_bad_pause_names_the_variable(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        parse_pause(raw)
    assert PAUSE_ENV in str(caught.value)
