from __future__ import annotations

from core.messages import WorkerRole
from kv_transfer.affinity import prefix_key
from workers.registry import Worker, pick_by_affinity


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


def test_prefix_key() -> None:
    chat = {"messages": [{"role": "system", "content": "abc"}, {"role": "user", "content": "x"}]}
    assert prefix_key(chat, 100) == "system:abc\nuser:x\n"
    assert prefix_key(chat, 6) == "system"
    assert prefix_key({"prompt": "hello world"}, 5) == "hello"
    assert prefix_key({"prompt": [1, 2, 3]}, 3) == "1,2"
    assert prefix_key({"prompt": ["first", "second"]}, 10) == "first"
