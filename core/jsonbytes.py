"""JSON bytes that something keeps: orjson's output trimmed to its length.

``orjson.dumps`` hands back its working buffer, shortened but not shrunk: the bytes object
keeps at least 4 KiB, and about 13 times the length of a larger document (measured with
tracemalloc on orjson 3.13: 4,104 bytes held for a 51-byte chunk, 64,938 for 5,041 bytes).
That costs nothing for bytes written out and dropped, and a lot for bytes that wait: the
chunk an idempotent stream holds until the next one comes, an idempotent answer stored for a
day (a stream's event is framed into a copy of its own: ``gateway/serving/sse.py``).
``dumps_to_keep`` is for those; the copy costs about what the dump did.
"""

from __future__ import annotations

import orjson


def dumps_to_keep(value: object) -> bytes:
    """``orjson.dumps(value)`` in a bytes object of its own length."""
    return bytes(memoryview(orjson.dumps(value)))
