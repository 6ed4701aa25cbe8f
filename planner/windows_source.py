"""The planner's load from the gateway's own per-version windows (``traffic.windows``) and
backlog (``traffic.backlog``): the embedded default, as the rollout gates' ``WindowsProvider``
is. With several gateways it sees one replica's share; a Prometheus source over every replica
is the multi-gateway one (to come).

Rate = requests that ended in the window / the seconds its whole buckets cover (a window of one
interval is rounded out to bucket edges: over the interval alone, a bucket's requests would
count as if they had all come within it); lengths are means per request; TTFT and
ITL are the window's means (the profile's correction works on means, as Dynamo's does). The
prefill backlog is the prompt tokens of the requests waiting for their first token now.
"""

from __future__ import annotations

from planner.replicas import Load, Observed
from traffic.backlog import Backlog
from traffic.windows import VersionWindows


class WindowsLoadSource:
    def __init__(self, windows: VersionWindows, backlog: Backlog | None = None) -> None:
        self._windows = windows
        self._backlog = backlog or Backlog()

    async def interval(self, version: str, window_s: float) -> tuple[Load, Observed]:
        snapshot = self._windows.snapshot(version, min(window_s, self._windows.horizon_s))
        waiting = self._backlog.of(version)
        count = snapshot.num_requests
        if not count:
            return Load(0.0, 0.0, 0.0, waiting.prompt_tokens, waiting.requests), Observed()
        load = Load(
            count / (snapshot.covered_s or snapshot.window_s),
            snapshot.input_tokens / count,
            snapshot.output_tokens / count,
            waiting.prompt_tokens,
            waiting.requests,
        )
        latency = Observed(
            ttft_s=None if snapshot.ttft is None else snapshot.ttft.mean,
            itl_s=None if snapshot.itl is None else snapshot.itl.mean,
        )
        return load, latency
