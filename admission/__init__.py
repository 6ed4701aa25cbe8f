"""Admission: token quotas (reserve before, reconcile after) and weighted-fair (VTC) queueing.

Will own the bounded admission queue in front of the worker pools and the quota store
(in memory for the embedded default, Redis when configured). Empty until that issue lands.
"""
