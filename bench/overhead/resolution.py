"""``python -m bench.overhead.resolution``: the CPU a request's version resolution costs.

What ``RequestFlow.receive`` calls per request (``gateway.catalog.Catalog.resolve``: the
alias's compiled policy, the draw or the hash, the deployment looked up), timed in process
with ``time.process_time`` over many calls, for each kind of policy. Target: under 20 µs.
The whole request's CPU with a policy in force is ``python -m bench.overhead --targets
tandem-policy`` (the gateway process's CPU per request, next to ``tandem-2leg`` without one).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.models import ServedModel
from gateway.catalog import Catalog
from traffic.policy import Pin, Shadow, Split, TrafficPolicy
from traffic.resolver import Subject
from workers.deployments import Deployment, Deployments
from workers.registry import Worker

ALIAS = "bench-model"
BASELINE, CANDIDATE, THIRD = (f"{ALIAS}@{digit * 8}" for digit in "abc")


class _NoWorkers:
    """A pool with no workers: resolution never touches a pool."""

    workers: Sequence[Worker] = ()
    kv_watermark = 1.0

    def pick(self) -> Worker | None:
        return None


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    policy: TrafficPolicy | None
    subject: Callable[[int], Subject]


def _catalog(policy: TrafficPolicy | None) -> Catalog:
    pool = _NoWorkers()
    deployments = Deployments(
        [Deployment(ServedModel(ALIAS, 2048, 0, version), pool, pool)
         for version in (BASELINE, CANDIDATE, THIRD)]
    )  # fmt: skip
    catalog = Catalog(deployments)
    if policy is not None:
        catalog.apply({ALIAS: policy})
    return catalog


def cases() -> list[Case]:
    split = (Split(BASELINE, 900), Split(CANDIDATE, 100))
    pins = tuple(Pin(f"tenant-{i}", None, CANDIDATE) for i in range(100))
    one_tenant = lambda i: Subject("tenant-x", "key-x")  # noqa: E731
    many_users = lambda i: Subject("tenant-x", "key-x", user=f"user-{i % 10_000}")  # noqa: E731
    return [
        Case("no policy (the alias's one version)", None, one_tenant),
        Case("weighted 90/10", TrafficPolicy(ALIAS, split), one_tenant),
        Case("weighted 90/10 + shadow 5 %", TrafficPolicy(ALIAS, split, shadow=Shadow(THIRD, 50)),
             one_tenant),
        Case("sticky 90/10, 10k users", TrafficPolicy(ALIAS, split, sticky=True), many_users),
        Case("sticky, 3 versions", TrafficPolicy(
            ALIAS, (Split(BASELINE, 800), Split(CANDIDATE, 100), Split(THIRD, 100)), sticky=True),
            many_users),
        Case("tenant pinned (100 pins)", TrafficPolicy(ALIAS, split, pins=pins),
             lambda i: Subject("tenant-7", "key-x")),
        Case("a version named directly", TrafficPolicy(ALIAS, split),
             lambda i: Subject("tenant-x", "key-x")),
    ]  # fmt: skip


def measure(case: Case, num_calls: int) -> float:
    """CPU µs per ``Catalog.resolve`` for ``case``, best of three rounds."""
    catalog = _catalog(case.policy)
    requested = BASELINE if case.name.startswith("a version named") else ALIAS
    subjects = [case.subject(i) for i in range(num_calls)]
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        for subject in subjects:
            catalog.resolve(requested, subject)
        best = min(best, time.process_time() - started)
    return best / num_calls * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.resolution")
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args(argv)
    print(f"version resolution, CPU per request (best of 3 x {args.calls:,} calls):")
    for case in cases():
        print(f"  {case.name:<40} {measure(case, args.calls):6.2f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
