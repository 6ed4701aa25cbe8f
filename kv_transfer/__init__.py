"""KV-cache transfer between prefill and decode workers over vLLM's NixlConnector.

Owns: the connector settings each worker role is launched with, the leg-1 parameters that ask a
prefill worker to keep its KV for a remote decode, and checking the transfer handle it returns
before it is forwarded to the decode worker. Later: decider, failure handling, transfer metrics.
"""
