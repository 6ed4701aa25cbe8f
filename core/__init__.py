"""Shared types every Tandem package uses: the request and its phases, wire messages, errors.

Nothing here does I/O but ``core/sqlite.py`` (the step both SQLite file stores take on connect).
Everything above ``core`` may import it; it imports nothing of Tandem's.
"""
