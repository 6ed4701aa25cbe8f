"""A vLLM plugin: a worker's processes wait for each other's next message sleeping, not spinning.

A vLLM server's engine process and its model's process hand each step over through shared-memory
queues (``vllm/distributed/device_communicators/shm_broadcast.py``). A reader that finds no
message calls ``SpinCondition.wait``, which for a second after its last message spins
(``sched_yield`` and look again), and only then sleeps on a ZeroMQ notification. While one
process spins, the other one works: the engine process spins through the model's whole step,
the model's process between steps. A spinning reader is runnable whenever the scheduler looks,
so it takes a core's turns from whatever shares it: on the 2-core host, while a stream decoded,
the decode engine's main thread ran 0.90-0.95 of a core beside its model's 0.95, i.e. it held
the other core, the prefill worker's. Sleeping, it runs 0.12-0.14 of a core, and a 1k-token
prompt's KV read took 11.5 ms instead of 18.9 (docs/ARCHITECTURE.md, "vLLM's busy second").

Where Tandem asks (``PAUSE_ENV``, set on the workers it starts by ``workers.process``), a reader
in that busy second sleeps that many microseconds instead, then looks again: the core goes to
the process being waited for, and a message is seen at most one pause (plus the timer's slack)
after it was written: a step's two hand-overs may each wait that long (a decode stream's
inter-token time moved by under 2 % at 100 µs). Past the second, vLLM's own idle wait is
unchanged (a ZeroMQ notification wakes it), so an idle worker costs what it did.

vLLM loads ``register`` in each of its processes through the ``vllm.general_plugins`` entry
point (``pyproject.toml``); vLLM is looked up by name, never imported here (the import
contract keeps vllm out of Tandem's own packages). Other vLLM servers sharing this environment
are left alone.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

PAUSE_ENV = "TANDEM_VLLM_BUSY_WAIT_PAUSE_US"
"""Microseconds a reader sleeps between looks in its busy second; unset or 0 leaves vLLM's
spin."""
DEFAULT_PAUSE_US = 100
"""What ``tandem up`` gives its workers (the setting ``worker_busy_wait_pause_us``)."""
MAX_PAUSE_US = 100_000
"""A longer pause would make every step of the engine wait for it."""
_SPIN_MODULE = "vllm.distributed.device_communicators.shm_broadcast"

# A child of "vllm": vLLM configures that logger (handler, level) in each of its processes.
log = logging.getLogger("vllm.tandem_busy_wait")


def parse_pause(raw: str) -> int:
    """``PAUSE_ENV``'s value in µs; raises ``ValueError`` naming the variable."""
    try:
        pause_us = int(raw)
    except ValueError:
        raise ValueError(f"{PAUSE_ENV}={raw!r} is not a whole number of microseconds") from None
    if not 0 <= pause_us <= MAX_PAUSE_US:
        raise ValueError(
            f"{PAUSE_ENV}={pause_us} is out of range: 0 (vLLM's spin) to {MAX_PAUSE_US} µs"
        )
    return pause_us


def sleeping_wait(original: Callable[..., None], pause_s: float) -> Callable[..., None]:
    """``SpinCondition.wait`` that sleeps ``pause_s`` where vLLM's would spin.

    vLLM's reader spins while ``time.monotonic()`` is within ``busy_loop_s`` of its
    ``last_read``; its caller looks at the queue again after each return, so a return after a
    sleep is a look after the pause. Past that window, ``original`` waits as vLLM does."""

    @functools.wraps(original)
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(pause_s)
            return
        original(self, timeout_ms)

    wait.tandem_sleeps = True  # type: ignore[attr-defined]
    return wait


def install(condition_cls: Any, pause_us: int) -> None:
    """Replace ``condition_cls.wait`` (vLLM's ``SpinCondition``) once; 0 changes nothing."""
    if pause_us == 0 or getattr(condition_cls.wait, "tandem_sleeps", False):
        return
    if not hasattr(condition_cls, "record_read"):  # what keeps the ``last_read`` it reads
        log.warning("this vLLM's %s keeps no last read; its wait is left alone", condition_cls)
        return
    condition_cls.wait = sleeping_wait(condition_cls.wait, pause_us / 1e6)
    log.debug(
        "shared-memory queue readers sleep %d µs between looks in their busy second", pause_us
    )


def register() -> None:
    """vLLM's plugin hook: install the pause where Tandem asked for one."""
    raw = os.environ.get(PAUSE_ENV)
    if raw is None:
        return
    pause_us = parse_pause(raw)  # a bad value fails the worker's start, naming the variable
    try:
        condition_cls = importlib.import_module(_SPIN_MODULE).SpinCondition
    except (ImportError, AttributeError) as exc:  # another vLLM layout: change nothing
        log.warning(
            "%s is set but this vLLM has no %s.SpinCondition: %s", PAUSE_ENV, _SPIN_MODULE, exc
        )
        return
    install(condition_cls, pause_us)
