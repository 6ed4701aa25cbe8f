"""Serving an app under uvicorn as every gateway process does: on uvloop, with Tandem's own
signal handling and a garbage collector tuned for streams."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Iterator

import uvicorn


def run_event_loop(main_coro: object) -> int:
    """Run ``main_coro`` to its exit code on uvloop."""
    import uvloop  # uvicorn[standard] brings it; the relay's per-event cost is lower on it

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return int(runner.run(main_coro))  # type: ignore[arg-type]


def tune_garbage_collector() -> None:
    """Keep collector pauses out of streams (measured by bench/overhead).

    What exists before serving (the app, its stores, the imported libraries) lives as long as
    the process: frozen, full collections no longer re-scan it (each took ~0.1 s under load). A
    larger first generation runs the young collections a tenth as often.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


_GC_YOUNG_THRESHOLD = 7_000  # CPython's default is 700


class Server(uvicorn.Server):
    """uvicorn's server without its signal handlers, able to cover another socket."""

    async def cover(self, sock: socket.socket) -> asyncio.Server:
        """Accept on ``sock`` too, with this server's app, state and protocol (a dead gateway
        process's share of the port, until its restart answers). Serves a duplicate of
        ``sock``: closing the returned server stops accepting and leaves ``sock`` open; the
        connections it accepted are this server's, drained by its shutdown like the others."""
        config, state = self.config, self.server_state

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=state, app_state=self.lifespan.state, _loop=_loop
            )

        loop = asyncio.get_running_loop()
        return await loop.create_server(create_protocol, sock=sock.dup(), backlog=config.backlog)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Tandem's own handlers stop the server and then the pools; uvicorn's would re-raise
        # the signal after serving and kill the process before the workers are stopped.
        yield
