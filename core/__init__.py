"""Shared types every Tandem package uses: the request and its phases, wire messages, errors.

Nothing here does I/O but ``core/sqlite.py`` (the SQLite file the tenant registry and the version
store each keep: one connection on a thread of its own, migrations, WAL; the ledger's WAL
switch).
Everything above ``core`` may import it; it imports nothing of Tandem's.
"""
