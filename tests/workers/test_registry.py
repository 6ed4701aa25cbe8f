from __future__ import annotations

import pytest

from core.messages import WorkerRole
from decode_pool import DecodePool
from workers.pool import PoolConfig
from workers.registry import Worker, least_loaded, mean_kv_usage, pick_by_affinity


def workers(*loads: int) -> list[Worker]:
    return [
        Worker(f"p{i}", WorkerRole.PREFILL, f"http://p{i}", healthy=True, num_outstanding=load)
        for i, load in enumerate(loads)
    ]


def test_same_key_same_worker_and_keys_spread() -> None:
    pool = workers(0, 0, 0)
    chosen = {_name(pick_by_affinity(pool, "system prompt A", 2)) for _ in range(5)}
    assert len(chosen) == 1
    spread = {_name(pick_by_affinity(pool, f"key {i}", 2)) for i in range(60)}
    assert spread == {"p0", "p1", "p2"}


def _name(worker: Worker | None) -> str | None:
    return None if worker is None else worker.name


def test_load_wins_over_affinity_past_the_slack() -> None:
    pool = workers(0, 0)
    preferred = pick_by_affinity(pool, "k", 2)
    assert preferred is not None
    other = next(worker for worker in pool if worker is not preferred)
    preferred.num_outstanding = 2
    assert pick_by_affinity(pool, "k", 2) is preferred  # within the slack
    preferred.num_outstanding = 3
    assert pick_by_affinity(pool, "k", 2) is other


def test_unhealthy_workers_are_skipped_and_only_their_keys_move() -> None:
    pool = workers(0, 0, 0)
    before = {f"k{i}": pick_by_affinity(pool, f"k{i}", 2) for i in range(40)}
    pool[0].healthy = False
    after = {key: pick_by_affinity(pool, key, 2) for key in before}
    assert all(worker is not pool[0] for worker in after.values())
    assert all(after[key] is before[key] for key in before if before[key] is not pool[0])
    assert pick_by_affinity([], "k", 2) is None


# --- KV-cache usage: picking passes over KV-full workers ---------------------------------------
def decode_workers(*usage_and_load: tuple[float | None, int]) -> list[Worker]:
    return [
        Worker(
            f"d{i}",
            WorkerRole.DECODE,
            f"http://d{i}",
            healthy=True,
            num_outstanding=load,
            kv_usage=usage,
        )
        for i, (usage, load) in enumerate(usage_and_load)
    ]


def test_kv_full_is_at_or_over_the_watermark_and_unknown_has_room() -> None:
    over, at, under, unknown = decode_workers((0.97, 0), (0.9, 0), (0.89, 0), (None, 0))
    assert over.kv_full(0.9) and at.kv_full(0.9)
    assert not under.kv_full(0.9) and not unknown.kv_full(0.9)


def test_least_loaded_skips_a_kv_full_worker_for_a_busier_one_under_the_watermark() -> None:
    full, busy = decode_workers((0.97, 0), (0.5, 5))
    assert least_loaded([full, busy], kv_watermark=0.9) is busy
    assert least_loaded([full, busy]) is full  # without a watermark: load only


def test_least_loaded_returns_the_least_loaded_when_every_healthy_worker_is_kv_full() -> None:
    a, b, c = decode_workers((0.99, 3), (0.95, 1), (0.1, 0))
    c.healthy = False  # an unhealthy one with room is still never picked
    assert least_loaded([a, b, c], kv_watermark=0.9) is b
    assert least_loaded([c], kv_watermark=0.9) is None


def test_unknown_kv_usage_counts_as_under_the_watermark() -> None:
    full, unknown = decode_workers((0.97, 0), (None, 4))
    assert least_loaded([full, unknown], kv_watermark=0.9) is unknown


def test_pool_pick_honours_its_kv_watermark() -> None:
    urls = ("http://d0", "http://d1")
    pool = DecodePool(PoolConfig(WorkerRole.DECODE, external_urls=urls, kv_watermark=0.8))
    idle, busy = pool.workers
    for worker in pool.workers:
        worker.healthy = True
    busy.num_outstanding = 3
    assert pool.kv_watermark == 0.8
    assert pool.pick() is idle
    idle.kv_usage = 0.85  # over this pool's watermark, under the default one
    assert pool.pick() is busy
    busy.kv_usage = 0.9  # both full: the admitted request still gets the least-loaded one
    assert pool.pick() is idle
    idle.kv_usage = None  # unknown again: room
    assert pool.pick() is idle


def test_pool_config_rejects_a_watermark_outside_0_to_1() -> None:
    for watermark in (0.0, 1.5):
        with pytest.raises(ValueError, match="kv_watermark"):
            PoolConfig(WorkerRole.DECODE, kv_watermark=watermark)


def test_pick_by_affinity_is_unchanged_by_kv_usage() -> None:
    pool = workers(0, 0)
    preferred = pick_by_affinity(pool, "k", 2)
    assert preferred is not None
    preferred.kv_usage = 1.0  # prefill usage is not polled; were it set, affinity ignores it
    assert pick_by_affinity(pool, "k", 2) is preferred


# --- draining: a leaving worker takes nothing new -----------------------------------------------
def test_in_rotation_is_healthy_and_not_draining() -> None:
    (worker,) = workers(0)
    assert worker.in_rotation
    worker.draining = True
    assert not worker.in_rotation
    worker.draining, worker.healthy = False, False
    assert not worker.in_rotation


def test_busy_counts_requests_in_flight_and_kv_still_to_read() -> None:
    (worker,) = workers(0)
    assert not worker.busy
    with worker.lease():
        assert worker.busy
    assert not worker.busy
    with worker.holding_kv():
        assert worker.busy
    assert not worker.busy


def test_a_lease_counts_once_held_and_gives_back_once() -> None:
    (worker,) = workers(0)
    with worker.lease() as leased, worker.lease():
        assert leased is worker
        assert worker.num_outstanding == 2
    assert worker.num_outstanding == 0
    with pytest.raises(RuntimeError), worker.lease():
        raise RuntimeError("the request failed")
    assert worker.num_outstanding == 0
    held = worker.lease().hold().hold()  # a stream's lease, held across calls
    assert worker.num_outstanding == 1
    held.release()
    held.release()  # a close after a close: nothing more to give back
    assert worker.num_outstanding == 0


def test_holding_kv_counts_nested_legs_and_releases_on_an_exception() -> None:
    (worker,) = workers(0)
    with worker.holding_kv() as held, worker.holding_kv():
        assert held is worker
        assert worker.num_kv_held == 2
        assert worker.num_outstanding == 0  # a KV read is no request in flight
    assert worker.num_kv_held == 0
    with pytest.raises(RuntimeError), worker.holding_kv():
        raise RuntimeError("the decode leg failed")
    assert worker.num_kv_held == 0


def test_least_loaded_never_picks_a_draining_worker() -> None:
    idle, busy = workers(0, 5)
    idle.draining = True
    assert least_loaded([idle, busy]) is busy
    assert least_loaded([idle, busy], kv_watermark=0.9) is busy
    busy.kv_usage = 0.99  # KV-full: still preferred over the draining one with room
    assert least_loaded([idle, busy], kv_watermark=0.9) is busy
    busy.draining = True
    assert least_loaded([idle, busy]) is None
    assert least_loaded([idle, busy], kv_watermark=0.9) is None


def test_pick_by_affinity_moves_a_draining_workers_keys_and_only_those() -> None:
    pool = workers(0, 0, 0)
    before = {f"k{i}": pick_by_affinity(pool, f"k{i}", 2) for i in range(40)}
    assert any(worker is pool[0] for worker in before.values())  # it is some keys' preferred
    pool[0].draining = True
    pool[1].num_outstanding = 1  # the draining one stays the least loaded
    after = {key: pick_by_affinity(pool, key, 2) for key in before}
    assert all(worker is not None and worker is not pool[0] for worker in after.values())
    assert all(after[key] is before[key] for key in before if before[key] is not pool[0])


def test_pick_by_affinity_is_none_when_every_healthy_worker_is_draining() -> None:
    pool = workers(0, 0)
    for worker in pool:
        worker.draining = True
    assert pick_by_affinity(pool, "k", 2) is None
    pool[1].draining = False
    pool[1].healthy = False  # the one not draining is down
    assert pick_by_affinity(pool, "k", 2) is None


def test_mean_kv_usage_is_over_the_workers_in_rotation_that_report_it() -> None:
    serving = [_kv_worker("a", 0.4), _kv_worker("b", 0.8), _kv_worker("c", None)]
    leaving = _kv_worker("d", 1.0)
    leaving.draining = True
    down = _kv_worker("e", 1.0)
    down.healthy = False
    assert mean_kv_usage([*serving, leaving, down]) == pytest.approx(0.6)
    assert mean_kv_usage([_kv_worker("f", None), leaving]) is None


def _kv_worker(name: str, usage: float | None) -> Worker:
    return Worker(name, WorkerRole.DECODE, f"http://{name}", healthy=True, kv_usage=usage)
