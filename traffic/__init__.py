"""Traffic between an alias's versions: policies, their resolution per request, the shadow's
in-flight cap, and sliding windows of per-version figures that rollout gates read.

Pure: no I/O, no asyncio, no clock but the one a caller passes. Imports only ``core`` and the
standard library; the gateway owns the loops that reload policies and feed the windows.

- ``policy``: ``TrafficPolicy`` (split, pins, shadow, stickiness, direct access), its JSON shape
  and ``PolicyError`` naming the field at fault.
- ``resolver``: ``CompiledPolicy``, ``resolve`` (pin > sticky or weighted split; shadow drawn on
  top), ``Resolver`` (every alias's policy, replaced whole).
- ``shadow``: ``ShadowLimiter``, the in-flight cap on shadow copies per version.
- ``windows``: ``VersionWindows``, time-bucketed figures per version, and their snapshots.
- ``backlog``: ``Backlog``, the requests of each version waiting for their first token (the
  autoscaling planner's prefill backlog).
"""

from traffic.backlog import Backlog, Waiting
from traffic.policy import (
    Pin,
    PolicyError,
    Shadow,
    Split,
    TrafficPolicy,
    check_versions,
    policy_from_dict,
    policy_to_dict,
)
from traffic.resolver import (
    CompiledPolicy,
    Reason,
    Resolution,
    Resolver,
    Subject,
    resolve,
    resolve_direct,
)
from traffic.shadow import ShadowLimiter
from traffic.windows import Quantiles, RequestFigures, VersionWindows, WindowSnapshot

__all__ = [
    "Backlog",
    "CompiledPolicy",
    "Pin",
    "PolicyError",
    "Quantiles",
    "Reason",
    "RequestFigures",
    "Resolution",
    "Resolver",
    "Shadow",
    "ShadowLimiter",
    "Split",
    "Subject",
    "TrafficPolicy",
    "VersionWindows",
    "Waiting",
    "WindowSnapshot",
    "check_versions",
    "policy_from_dict",
    "policy_to_dict",
    "resolve",
    "resolve_direct",
]
