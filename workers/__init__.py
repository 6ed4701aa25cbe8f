"""vLLM worker processes and the pool machinery that prefill_pool and decode_pool share.

Owns: preparing a vLLM-loadable model folder, launching and supervising vLLM OpenAI servers as
child processes (readiness, restart with backoff, no orphans), health polling, and picking the
least-loaded healthy worker. Never imports vllm: a worker is a separate process reached over HTTP.
"""
