"""Random ids for what every request makes (its own id, its quota reservation's): 128 bits
from the OS's CSPRNG, as ``secrets.token_hex(16)`` gives them, read a block at a time.

``secrets.token_hex`` is a ``getrandom`` system call per id: 0.5 µs in a loop, but about 20
µs at one stream at a time, where a request meets that path cold in the CPU's caches
(``bench/overhead/ttft_steps.py``). Here one call reads 4 KiB, 256 ids of 16 bytes, and an id
is a slice of it. A forked child starts from a fresh block (``os.register_at_fork``): a parent
and its child never hand out the same bytes.
"""

from __future__ import annotations

import os
import threading

_BLOCK_BYTES = 4096


class _RandomBlock:
    """Bytes read from ``os.urandom`` a block at a time, each handed out once."""

    __slots__ = ("_at", "_block", "_lock")

    def __init__(self) -> None:
        self._block = b""
        self._at = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytes:
        with self._lock:
            start = self._at
            if start + nbytes > len(self._block):
                self._block = os.urandom(max(_BLOCK_BYTES, nbytes))
                start = 0
            self._at = start + nbytes
            return self._block[start : start + nbytes]

    def forget(self) -> None:
        """In a forked child: nothing the parent held is handed out (and no lock it held)."""
        self._block = b""
        self._at = 0
        self._lock = threading.Lock()


_random = _RandomBlock()
os.register_at_fork(after_in_child=_random.forget)


def random_hex(nbytes: int = 16) -> str:
    """``nbytes`` random bytes as hex, as ``secrets.token_hex(nbytes)``."""
    return _random.take(nbytes).hex()
