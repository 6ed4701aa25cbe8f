"""The prefill pool: vLLM workers that run prompts and hand their KV cache to decode workers.

Owns: the prefill workers' launch specs (role ``prefill``, ``kv_producer`` over NIXL, one HTTP
port, side-channel port and CPU binding each) and the pool that launches, health-polls and
restarts them, or polls external prefill workers. Picking a worker for leg 1 is ``pick()``.
Does not import ``decode_pool``: only the gateway pairs the two.
"""

from prefill_pool.pool import PrefillPool, prefill_worker_specs

__all__ = ["PrefillPool", "prefill_worker_specs"]
