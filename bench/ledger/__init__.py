"""What the usage ledger costs: sustained write throughput of ``billing.writer.LedgerWriter`` and
of the stores' batch inserts on SQLite and PostgreSQL (``writes``), and the latency and gateway
CPU that billing adds to a streamed request (``latency``). ``python -m bench.ledger --help``;
see ``cli``."""
