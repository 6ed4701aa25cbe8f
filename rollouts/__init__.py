"""Rollouts: a candidate version promoted step by step, or rolled back, on the evidence of gates.

Pure decisions, with their I/O at the edges:

- ``spec``: what an operator asks (versions, mode, steps, gates, limits, quality check, webhook)
  and its JSON shape; ``record``: a rollout's state; ``machine``: its transitions (pure).
- ``gates`` and ``stats``: one gate's verdict on a candidate's figures against its baseline's
  over one window, and a step's outcome from its measurements (pure).
- ``quality``: the golden prompts run on both versions before any client traffic.
- ``provider``: where gates read figures (``MetricsProvider``; the gateway's own windows);
  ``provider_prometheus``: the same figures by PromQL over every replica (over ``httpx``).
- ``controller``: the one owner of every rollout's progress, on the gateway holding the lease.
- ``store``, ``store_sqlite``, ``store_redis``, ``lease``: rollout state, operator commands and
  the lease with its fencing token.
- ``webhook``: signed event deliveries; ``report``: a finished rollout's plots and decision log.

Imports ``traffic``, ``versions``, ``billing`` (figures, for types), ``admission`` (the store
errors and the Redis connection), ``core`` and the standard library; never the gateway, which
implements the interfaces the controller needs (``TrafficControl``, ``quality.Completer``).
"""

from rollouts.gates import (
    RATE_FLOOR,
    Gate,
    GateKind,
    Measurement,
    StepAssessment,
    Verdict,
    VersionFigures,
    assess,
    default_gates,
    measure,
)
from rollouts.stats import MannWhitney, mann_whitney, percentile, two_proportion

__all__ = [
    "RATE_FLOOR",
    "Gate",
    "GateKind",
    "MannWhitney",
    "Measurement",
    "StepAssessment",
    "Verdict",
    "VersionFigures",
    "assess",
    "default_gates",
    "mann_whitney",
    "measure",
    "percentile",
    "two_proportion",
]
