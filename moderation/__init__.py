"""Moderation: input checks before admission and streaming output checks with a hold-back window.

Will own the rules and PII providers, the OpenAI-compatible moderation provider, per-tenant
policies and ``/v1/moderations``. Empty until that issue lands.
"""
