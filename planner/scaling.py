"""From a pool's recommended size to the size it is given: fast up, slow down, never flapping.

Per pool, every interval (Kubernetes' HPA behaviour, which operators already know):

- **Limits.** The size stays within ``min_replicas``..``max_replicas`` (a prefill pool may go to
  0: its requests then run colocated).
- **Up at once** to the highest recommendation of the short up-window (default: this one).
- **Down slowly:** to the highest recommendation of the whole down-window (default 5 min), so a
  dip must last that long before a worker goes, and only after ``cooldown_s`` since the last
  change of this pool.
- **Hysteresis:** a recommendation within ``tolerance`` of the current size (relative) is no
  change, so a load sitting on a boundary does not flip a worker in and out.

Each decision carries its reason, for ``tandem planner status`` and the audit log.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScalingPolicy:
    min_replicas: int = 1
    max_replicas: int = 4
    up_window_s: float = 0.0
    down_window_s: float = 300.0
    cooldown_s: float = 60.0
    tolerance: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, "
                f"{self.max_replicas}"
            )
        if min(self.up_window_s, self.down_window_s, self.cooldown_s, self.tolerance) < 0:
            raise ValueError("windows, cooldown and tolerance cannot be negative")


@dataclass(frozen=True, slots=True)
class Decision:
    current: int
    recommended: int
    desired: int
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current


class PoolScaler:
    """The scaling state of one pool: its recent recommendations and its last change."""

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self._recommended: deque[tuple[float, int]] = deque()
        self._last_change_at: float | None = None
        self._started_at: float | None = None

    def decide(self, now: float, current: int, recommended: int) -> Decision:
        """The size for the pool at ``now`` (``time.monotonic()`` or a simulator's clock)."""
        policy = self.policy
        if self._started_at is None:
            self._started_at = now
        bounded = min(max(recommended, policy.min_replicas), policy.max_replicas)
        self._recommended.append((now, bounded))
        horizon = max(policy.up_window_s, policy.down_window_s)
        while self._recommended and self._recommended[0][0] < now - horizon:
            self._recommended.popleft()
        decision = self._decide(now, current, recommended, bounded)
        if decision.changes:
            self._last_change_at = now
        return decision

    def _decide(self, now: float, current: int, recommended: int, bounded: int) -> Decision:
        policy = self.policy

        def hold(reason: str) -> Decision:
            return Decision(current, recommended, current, reason)

        if current < policy.min_replicas:
            return Decision(current, recommended, policy.min_replicas, "below the minimum")
        if current > policy.max_replicas:
            return Decision(current, recommended, policy.max_replicas, "above the maximum")
        up_to = max(n for t, n in self._recommended if t >= now - policy.up_window_s)
        if up_to > current:
            if current > 0 and (up_to - current) / current <= policy.tolerance:
                return hold(f"{up_to} is within the tolerance of {current}")
            return Decision(current, recommended, up_to, f"load needs {up_to}")
        down_to = max(n for t, n in self._recommended if t >= now - policy.down_window_s)
        if down_to >= current:
            return hold("the load needs what runs")
        if current and (current - down_to) / current <= policy.tolerance:
            return hold(f"{down_to} is within the tolerance of {current}")
        if self._last_change_at is not None and now - self._last_change_at < policy.cooldown_s:
            return hold(f"cooling down {policy.cooldown_s:g} s after the last change")
        if self._started_at is not None and now - self._started_at < policy.down_window_s:
            # A planner that just started has not seen the dip last the whole window.
            return hold(f"fewer than {policy.down_window_s:g} s of load seen")
        reason = f"the load needed at most {down_to} for {policy.down_window_s:g} s"
        return Decision(current, recommended, down_to, reason)
