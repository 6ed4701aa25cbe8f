"""The ``tandem`` command: the one place that composes the gateway's commands with ``bench``."""
