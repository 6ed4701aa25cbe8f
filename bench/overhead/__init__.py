"""What the gateway adds: the same closed-loop load sent to an engine directly and through the
gateway (and through LiteLLM's proxy, when installed), with added TTFT/ITL and the server's CPU
per request and per streamed chunk. ``python -m bench.overhead --help``; see ``cli``."""
