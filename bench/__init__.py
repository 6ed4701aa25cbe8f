"""Benchmarks that print figures: ``tandem bench`` (``harness``, checked against vLLM's own
benchmark by ``vs_vllm``), what the gateway adds over an engine and over LiteLLM
(``overhead``), what moving KV costs (``kv_transfer``), and what the gateway's streaming path
costs: moderation window, heartbeats, memory per open stream (``streaming``); how well rollout
gates tell a worse version from noise, and how fast a failed one loses its traffic on every
replica (``rollouts``).

Figures live here, never as timed assertions in tests.
"""
