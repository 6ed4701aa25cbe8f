"""Autoscaling the prefill and decode pools apart (issue 23).

Pure decisions first, I/O at the edges:

- ``profile``: what one worker of a version sustains, measured (prefill tokens/s by prompt
  length; decode concurrency and tokens/s by inter-token latency), and its JSON file.
- ``predict``: the next interval's load from the past ones (constant, Holt's trend).
- ``replicas``: how many prefill and decode workers a predicted load needs, from the profile,
  corrected by the latencies observed against the targets.
- ``scaling``: turning those recommendations into changes: limits, fast up and slow down
  (stabilization windows), hysteresis and a cooldown, so a pool never oscillates.
- ``loop``: one planning step of a version (observe, predict, size, decide), the code both
  the simulator (``bench/planner/sim.py``) and the controller run.
- ``actuate``: the ``Actuator`` interface and the dry run; ``controller``: one version's
  planner at work (read the load, step, carry out, keep the history); ``windows_source``: the
  load from the gateway's per-version windows and backlog. ``tandem profile`` (``bench/profile.py``)
  measures a worker into a ``profile.Profile`` file.

The gateway runs a controller per deployed version (``gateway/planning.py``: settings, the
``planner`` lease on Kubernetes, status, metrics, audit, pause, wake; ``tandem planner status``)
and the local actuator that starts and drains its own workers (``gateway/local_actuator.py``).

Not built yet: a Prometheus load source over every gateway replica, a profile per version.
"""
