"""The OpenAI-compatible HTTP gateway, in sub-packages by job (``docs/ARCHITECTURE.md``):

cli/       the ``tandem`` commands (up, model, admin, billing)
assembly/  settings, stores, the stack ``tandem up`` runs, the FastAPI app and its services
serving/   the OpenAI routes and the one request flow (``serving/flow.py``)
admin/     the admin API and a tenant's own usage
auth.py, errors.py, metrics.py: what serving and admin share
"""
