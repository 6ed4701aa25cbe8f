"""``tandem up`` with tracemalloc on, for ``bench.overhead.memory_sites``.

``python -m bench.overhead.memory_entry up ...`` starts tracemalloc (``FRAMES`` frames a
block) before the gateway imports anything of its own, then runs ``tandem up``. Each SIGUSR1
dumps two snapshots: ``<$TANDEM_MEMORY_SNAPSHOTS>.<n>`` as the heap is (n = 0, 1, ...), then
``<...>.<n>.collected`` after a full collection (what is left is what something still
references), then ``<...>.<n>.types``: the objects the collector tracks, counted by type (JSON;
a type that outnumbers the connections says what something keeps too long: how the protocols
of reset connections were found, held for uvicorn's keep-alive timeout). Not for serving:
tracemalloc makes every allocation several times dearer.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import tracemalloc
from collections import Counter
from collections.abc import Callable
from types import FrameType

import orjson

SNAPSHOTS_ENV = "TANDEM_MEMORY_SNAPSHOTS"
FRAMES = 8
"""Deep enough to reach from a library's allocation to the Tandem call that asked for it."""


def _dumper(prefix: str) -> Callable[[int, FrameType | None], None]:
    taken = 0

    def dump(_signum: int, _frame: FrameType | None) -> None:
        nonlocal taken
        path = f"{prefix}.{taken}"
        for target, collect in ((path, False), (f"{path}.collected", True)):
            if collect:
                gc.collect()
            tracemalloc.take_snapshot().dump(f"{target}.part")
            # Whole or absent: the reader polls for the last and then reads them all.
            os.replace(f"{target}.part", target)
        with open(f"{path}.types.part", "wb") as out:
            out.write(orjson.dumps(tracked_by_type()))
        os.replace(f"{path}.types.part", f"{path}.types")
        taken += 1

    return dump


def tracked_by_type() -> dict[str, int]:
    """The objects the collector tracks, by ``module.qualname`` of their type."""
    return dict(
        Counter(f"{type(item).__module__}.{type(item).__qualname__}" for item in gc.get_objects())
    )


def main() -> int:
    prefix = os.environ.get(SNAPSHOTS_ENV)
    if not prefix:
        raise SystemExit(f"{SNAPSHOTS_ENV} names the files the snapshots go to")
    tracemalloc.start(FRAMES)
    signal.signal(signal.SIGUSR1, _dumper(prefix))
    from gateway.cli.main import main as tandem_main

    return tandem_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
