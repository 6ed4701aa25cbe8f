"""Benchmarks that print figures: TTFT/ITL through the gateway vs directly on a worker
(``gateway_vs_direct``), what moving KV costs (``kv_transfer``), and what the gateway's
streaming path costs: moderation window, heartbeats, memory per open stream (``streaming``).

Figures live here, never as timed assertions in tests.
"""
