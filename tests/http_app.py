"""An aiohttp app served for a test on a free port of 127.0.0.1 (a worker, a webhook receiver, a
classifier): ``async with served(app) as base_url: ...``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    """``app`` listening until the block ends; yields its base URL, ``http://127.0.0.1:PORT``."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
