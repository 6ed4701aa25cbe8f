"""Benchmarks that print figures: TTFT/ITL through the gateway vs directly on a worker.

Figures live here, never as timed assertions in tests.
"""
