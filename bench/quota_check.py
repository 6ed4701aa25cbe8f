"""What the in-memory quota store costs a request as its open streams grow: microseconds per
reservation and its reconcile.

    python -m bench.quota_check [--open 16,512,5000] [--requests 20000] [--repeat 3]

Each request reserves (tokens, a request unit, a concurrency hold) and the oldest open one
reconciles, so ``--open`` holds stay taken by one tenant throughout, as that many streams would.
Prints the best of ``--repeat`` runs for each level. A reservation's cost should not grow with
the holds open (``admission/quota_memory.py``: expired holds are found through a heap, not a
scan of every hold). Figures, never assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque

from admission.plans import QuotaLimits
from admission.quota import Reservation
from admission.quota_memory import MemoryQuotaStore

TENANT = "bench-tenant"
LIMITS = QuotaLimits(tpm=10**9, rpm=10**9, max_concurrent=None)
HOLD_S = 600.0


async def us_per_request(num_open: int, num_requests: int) -> float:
    """Microseconds per reserve + reconcile with ``num_open`` holds taken throughout."""
    store = MemoryQuotaStore()
    held: deque[Reservation] = deque()
    for _ in range(num_open):
        held.append(await _reserve(store))
    started = time.perf_counter()
    for _ in range(num_requests):
        await store.reconcile(held.popleft(), LIMITS, 50)
        held.append(await _reserve(store))
    return (time.perf_counter() - started) / num_requests * 1e6


async def _reserve(store: MemoryQuotaStore) -> Reservation:
    reservation = await store.reserve(TENANT, LIMITS, 100, HOLD_S)
    if not isinstance(reservation, Reservation):
        raise RuntimeError(f"the bench's limits refused a reservation: {reservation}")
    return reservation


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quota_check")
    parser.add_argument("--open", default="16,512,5000", help="holds open, comma-separated")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"holds open  us per reserve + reconcile (best of {args.repeat})")
    for num_open in (int(level) for level in args.open.split(",")):
        best = min(asyncio.run(us_per_request(num_open, args.requests)) for _ in range(args.repeat))
        print(f"{num_open:>10}  {best:8.2f}")


if __name__ == "__main__":
    main()
