"""What rollouts' gates and rollbacks do, in figures.

    python -m bench.rollouts.gates       # the default TTFT gate's power and false failures,
                                         # and whole simulated rollouts over seeds (``sim``)
    python -m bench.rollouts.rollback    # gate failure -> no candidate traffic, two replicas

``sim`` is a rollout simulated second by second on a fake clock with the real controller (the
controller's tests drive it too); ``replicas`` and ``engine`` build the rollback benchmark's two
gateways on one Redis and their fake engines.
"""
