"""The chaos soak (issue 25): the real stack under load while real faults are injected, then
its invariants checked. ``python -m bench.soak --help``."""
