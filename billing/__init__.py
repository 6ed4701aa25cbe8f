"""Billing: the exactly-once usage ledger, price cards, budgets, exports and measured cost per 1k tokens.

Empty until that issue lands.
"""
