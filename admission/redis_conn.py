"""Admission's Redis stores over ``core/redis_conn.py``: failures are ``StoreUnavailable``."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from admission.quota import StoreUnavailable
from core.redis_conn import MAX_CONNECTIONS, connect
from core.redis_conn import bounded as bounded_call

__all__ = ["MAX_CONNECTIONS", "bounded", "connect"]

T = TypeVar("T")


async def bounded(call: Awaitable[T], deadline_s: float, what: str) -> T:
    """``core.redis_conn.bounded`` with admission's ``StoreUnavailable``."""
    return await bounded_call(call, deadline_s, what, StoreUnavailable)
