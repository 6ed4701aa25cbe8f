"""The OpenAI-compatible HTTP gateway: the only package that knows the whole request flow.

Owns the FastAPI app, request validation at the edge, the serving pipeline (pick workers, run the
prefill and decode legs, relay the stream), error rendering, settings and the ``tandem`` CLI.
"""
