"""The gateway's commands (``tandem up``, ``model``, ``admin``, ``billing``): ``main.py`` parses
and dispatches, ``admin.py`` and ``billing.py`` talk to a running gateway's admin API."""
