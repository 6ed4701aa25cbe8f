"""A TCP relay between one client and a server that a test can cut and restore: a real network
outage for that client alone (its open connections reset, new ones closed at once), while other
clients of the same server carry on.

While cut, nothing a client sends reaches the server: a call that fails during an outage was
not executed. The relay runs on the test's event loop; ``aclose`` ends it and every pipe.
"""

from __future__ import annotations

import asyncio
import contextlib


class Link:
    """Relays ``127.0.0.1:<port>`` to ``upstream_host:upstream_port``. ``start`` / ``aclose``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._sockets: set[asyncio.StreamWriter] = set()
        self.up = True

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("Link.port before start()")
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    def cut(self) -> None:
        """Reset every open connection and refuse service until ``restore``."""
        self.up = False
        for writer in self._sockets:
            writer.transport.abort()
        self._sockets.clear()

    def restore(self) -> None:
        self.up = True

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for pipe in self._pipes:
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.transport.abort()
            return
        if not self.up:  # cut while connecting
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._sockets |= {writer, up_writer}
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pipe = asyncio.create_task(self._pipe(source, sink))
            self._pipes.add(pipe)
            pipe.add_done_callback(self._pipes.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await source.read(65536):
                if not self.up:
                    break
                sink.write(data)
                await sink.drain()
        sink.transport.abort()
        self._sockets.discard(sink)
