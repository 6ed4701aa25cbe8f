"""tandem bench: a TTFT/ITL benchmark harness for OpenAI-compatible endpoints."""
