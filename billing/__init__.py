"""Billing: the exactly-once usage ledger, price cards, budgets, exports, cost per 1k tokens.

Empty until that issue lands.
"""
