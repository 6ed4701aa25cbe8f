"""The decode pool: vLLM workers that pull KV from prefill workers and generate the output.

Owns: the decode workers' launch specs (role ``decode``, ``kv_consumer`` over NIXL, one HTTP
port, side-channel port and CPU binding each) and the pool that launches, health-polls and
restarts them, or polls external decode workers. Picking a worker for leg 2 is ``pick()``.
Does not import ``prefill_pool``: only the gateway pairs the two.
"""

from decode_pool.pool import DecodePool, decode_worker_specs

__all__ = ["DecodePool", "decode_worker_specs"]
