"""OpenAI serving: the routes (``routes.py``) and the one flow that owns a request from its
route to its bill (``flow.py``), over the steps it calls: the admission gate (``gate.py``),
input and output moderation (``content_policy.py``, ``output_filter.py``), routing and the
engine legs (``routing.py``, ``upstream.py``), the relay (``relay.py``), usage records
(``usage_records.py``); and how an answer reaches the client: SSE (``sse.py``, ``events.py``),
idempotent runs and replays (``idempotent.py``, ``replay.py``), deadlines (``deadlines.py``)."""
