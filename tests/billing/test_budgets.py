"""BudgetGuard: spend is the database's figure plus what this gateway recorded since the refresh
that read it; alert levels fire once per month, by integer comparison; months roll over."""

from __future__ import annotations

from billing.budgets import BudgetGuard, BudgetStatus
from billing.store import AccountSettings, BudgetAlert

NOV, DEC = "2026-11", "2026-12"


def guard_with(budget: int | None, thresholds: tuple[int, ...] = (50, 80, 100)) -> BudgetGuard:
    guard = BudgetGuard(NOV)
    guard.set_accounts([AccountSettings("acme", budget, thresholds)])
    return guard


def levels(alerts: list[BudgetAlert]) -> list[int]:
    return [alert.threshold_pct for alert in alerts]


def test_spend_is_stored_plus_local() -> None:
    guard = BudgetGuard(NOV)
    assert guard.spend("acme") == 0
    guard.add("acme", NOV, 100)
    guard.add("acme", NOV, 20)
    guard.add("globex", NOV, 7)
    assert (guard.spend("acme"), guard.spend("globex")) == (120, 7)
    generation = guard.begin_refresh()
    # The database had both records (written by the flush) and 1000 from another gateway.
    guard.complete_refresh(generation, NOV, {"acme": 1120, "initech": 5}, [])
    assert (guard.spend("acme"), guard.spend("globex"), guard.spend("initech")) == (1120, 0, 5)
    guard.add("acme", NOV, 3)
    assert guard.spend("acme") == 1123
    assert guard.tenants() == ["acme", "initech"]


def test_records_after_begin_refresh_stay_local() -> None:
    guard = BudgetGuard(NOV)
    guard.add("acme", NOV, 100)  # flushed before the refresh reads the database
    generation = guard.begin_refresh()
    guard.add("acme", NOV, 40)  # recorded while the refresh runs: not in its read
    assert guard.spend("acme") == 140
    guard.complete_refresh(generation, NOV, {"acme": 100}, [])
    assert guard.spend("acme") == 140  # 100 stored + 40 still local, nothing counted twice
    later = guard.begin_refresh()
    guard.complete_refresh(later, NOV, {"acme": 140}, [])
    assert guard.spend("acme") == 140


def test_overlapping_refreshes_leave_each_generation_once() -> None:
    guard = BudgetGuard(NOV)
    guard.add("acme", NOV, 1)
    first = guard.begin_refresh()
    guard.add("acme", NOV, 10)
    second = guard.begin_refresh()
    guard.add("acme", NOV, 100)
    guard.complete_refresh(first, NOV, {"acme": 1}, [])
    assert guard.spend("acme") == 111
    guard.complete_refresh(second, NOV, {"acme": 11}, [])
    assert guard.spend("acme") == 111


def test_a_refresh_of_another_month_is_ignored() -> None:
    guard = BudgetGuard(NOV)
    guard.add("acme", NOV, 50)
    generation = guard.begin_refresh()
    guard.complete_refresh(generation, "2026-10", {"acme": 999}, [])
    assert guard.spend("acme") == 50


def test_each_threshold_fires_once_at_its_exact_boundary() -> None:
    guard = guard_with(1000)
    assert levels(guard.add("acme", NOV, 499)) == []
    [alert] = guard.add("acme", NOV, 1)
    assert alert == BudgetAlert("acme", NOV, 50, 500, 1000, 0)
    assert levels(guard.add("acme", NOV, 299)) == []
    assert levels(guard.add("acme", NOV, 1)) == [80]
    assert levels(guard.add("acme", NOV, 199)) == []
    assert guard.status("acme").exhausted is False
    assert levels(guard.add("acme", NOV, 1)) == [100]
    assert guard.status("acme") == BudgetStatus("acme", NOV, 1000, 1000)
    assert guard.status("acme").exhausted is True
    assert levels(guard.add("acme", NOV, 5000)) == []


def test_thresholds_compare_integers_without_rounding() -> None:
    # Half of an odd budget of 10**18 + 1 micros: 5 * 10**17 is just under 50 %, but in floats
    # the ratio rounds to exactly 0.5.
    budget = 10**18 + 1
    guard = guard_with(budget, (50,))
    assert levels(guard.add("acme", NOV, 5 * 10**17)) == []
    assert levels(guard.add("acme", NOV, 1)) == [50]
    guard = guard_with(3, (34,))  # 34 % of 3 micros is 1.02: one micro is not enough
    assert levels(guard.add("acme", NOV, 1)) == []
    assert levels(guard.add("acme", NOV, 1)) == [34]


def test_one_record_can_cross_several_levels_in_order() -> None:
    guard = guard_with(200, (100, 50, 80))
    assert levels(guard.add("acme", NOV, 170)) == [50, 80]
    assert levels(guard.add("acme", NOV, 30)) == [100]


def test_no_budget_no_alerts() -> None:
    guard = guard_with(None)
    assert guard.add("acme", NOV, 10**12) == []
    assert guard.status("acme").exhausted is False
    assert guard.add("globex", NOV, 10**12) == []  # no settings at all


def test_alerts_another_gateway_fired_are_not_fired_again() -> None:
    guard = guard_with(1000)
    generation = guard.begin_refresh()
    fired = [BudgetAlert("acme", NOV, 50, 600, 1000, 1), BudgetAlert("acme", NOV, 80, 800, 1000, 2)]
    guard.complete_refresh(generation, NOV, {"acme": 800}, fired)
    assert levels(guard.add("acme", NOV, 100)) == []
    assert levels(guard.add("acme", NOV, 100)) == [100]
    # Last month's alerts do not silence this month's.
    guard = guard_with(1000)
    generation = guard.begin_refresh()
    guard.complete_refresh(generation, NOV, {}, [BudgetAlert("acme", "2026-10", 50, 5, 10, 1)])
    assert levels(guard.add("acme", NOV, 500)) == [50]


def test_a_new_month_resets_spend_and_alerts() -> None:
    guard = guard_with(1000)
    generation = guard.begin_refresh()
    guard.complete_refresh(generation, NOV, {"acme": 900}, [])
    assert levels(guard.add("acme", NOV, 100)) == [50, 80, 100]
    assert guard.status("acme").exhausted is True
    # The first record of December rolls the guard over.
    assert levels(guard.add("acme", DEC, 499)) == []
    assert guard.month == DEC
    assert guard.status("acme") == BudgetStatus("acme", DEC, 1000, 499)
    assert levels(guard.add("acme", DEC, 1)) == [50]
    assert levels(guard.add("acme", DEC, 500)) == [80, 100]


def test_roll_over_drops_stored_spend() -> None:
    guard = guard_with(1000)
    generation = guard.begin_refresh()
    guard.complete_refresh(generation, NOV, {"acme": 700}, [])
    guard.add("acme", NOV, 10)
    guard.roll_over(DEC)
    assert guard.spend("acme") == 0
    assert guard.status("acme").exhausted is False
    # A refresh that read November completes after the turn: it must not become December's.
    guard.complete_refresh(generation + 1, NOV, {"acme": 710}, [])
    assert guard.spend("acme") == 0


def test_a_straggler_from_last_month_does_not_count_this_month() -> None:
    guard = guard_with(1000)
    guard.roll_over(DEC)
    guard.add("acme", DEC, 100)
    # A request that ended on 30 November, recorded after the turn.
    assert guard.add("acme", NOV, 900) == []
    assert guard.month == DEC
    assert guard.spend("acme") == 100
    assert levels(guard.add("acme", DEC, 400)) == [50]


def test_a_total_delivered_before_the_read_came_back_is_kept() -> None:
    """Another gateway's increment ran after this gateway's read of the month, and its message
    arrived first: the read's older reply must neither drop nor undo it."""
    guard = BudgetGuard(NOV, shared=True)
    assert guard.shared_seen(NOV, "acme", 300) is False  # no read back yet: kept for it
    guard.shared_loaded(NOV, {"acme": 0, "other": 50})
    assert guard.status("acme").spend_micros == 300
    assert guard.status("other").spend_micros == 50
    assert guard.shared_seen(NOV, "acme", 500) is True
    guard.shared_loaded(NOV, {"acme": 400})  # a read that ran before the 500
    assert guard.status("acme").spend_micros == 500
    assert guard.status("other").spend_micros == 50


def test_a_total_seen_for_another_month_or_before_a_roll_over_is_not_kept() -> None:
    guard = BudgetGuard(NOV, shared=True)
    assert guard.shared_seen("2026-10", "acme", 300) is False
    assert guard.shared_seen(NOV, "acme", 200) is False
    guard.roll_over(DEC)
    guard.shared_loaded(DEC, {})
    assert guard.status("acme").spend_micros == 0
    guard.shared_loaded(NOV, {"acme": 900})  # last month's read, back late: ignored
    assert guard.status("acme").spend_micros == 0
