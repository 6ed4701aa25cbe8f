"""bench.overhead.memory_sites: what the growth between two heap snapshots is attributed to."""

from __future__ import annotations

import re
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator

import pytest

from bench.overhead.memory_sites import REPO, Site, by_package, growth, package_of, type_growth


@pytest.fixture
def tracing() -> Iterator[None]:
    tracemalloc.start(8)
    try:
        yield
    finally:
        tracemalloc.stop()


def _allocate(num: int, size: int) -> list[bytearray]:
    return [bytearray(size) for _ in range(num)]  # the line the growth is attributed to


def test_growth_finds_the_site_and_its_bytes(tracing: None) -> None:
    before = tracemalloc.take_snapshot()
    kept = _allocate(100, 10_000)
    after = tracemalloc.take_snapshot()
    sites = growth(before, after)
    assert sites == sorted(sites, key=lambda site: -site.size)
    [ours] = [site for site in sites if site.where.startswith("tests/bench/test_memory_sites.py:")]
    assert ours is sites[0]
    assert 100 * 10_000 <= ours.size < 100 * 10_000 * 1.1
    assert ours.blocks >= 100
    assert ours.package == "tests"
    assert ours.caller == "-"  # tests are not Tandem code
    assert len(kept) == 100


def test_freed_memory_is_not_growth(tracing: None) -> None:
    before = tracemalloc.take_snapshot()
    _allocate(100, 10_000)  # dropped at once
    after = tracemalloc.take_snapshot()
    assert not [site for site in growth(before, after) if site.size >= 100 * 10_000]


def test_packages_of_files() -> None:
    venv = "/x/.venv/lib/python3.11/site-packages"
    assert package_of(f"{venv}/uvicorn/protocols/http/httptools_impl.py") == "uvicorn"
    assert package_of(f"{venv}/typing_extensions.py") == "typing_extensions"
    assert package_of(str(REPO / "gateway" / "serving" / "relay.py")) == "gateway"
    assert package_of("/usr/lib/python3.11/asyncio/locks.py") == "stdlib"
    assert package_of("<frozen importlib._bootstrap>") == "<frozen importlib._bootstrap>"
    assert by_package(
        [
            Site("a", "-", "gateway", 10, 1),
            Site("b", "-", "uvicorn", 30, 1),
            Site("c", "-", "gateway", 5, 1),
        ]
    ) == [("uvicorn", 30), ("gateway", 15)]


def test_types_grown_most_first_and_none_lost() -> None:
    before = {"a.Protocol": 10, "b.Flow": 2, "c.Gone": 5}
    after = {"a.Protocol": 12, "b.Flow": 9, "d.New": 1}
    assert type_growth(before, after) == [("b.Flow", 7), ("a.Protocol", 2), ("d.New", 1)]


def test_a_short_run_attributes_the_streams_memory_to_the_gateway() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.overhead.memory_sites", "--concurrency", "4",
         "--duration-s", "3", "--top", "80"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "still referenced after a full collection" in done.stdout
    packages = re.findall(r"^(\w+) +([0-9.]+)$", done.stdout, re.M)
    assert ("gateway" in dict(packages)) and float(dict(packages)["gateway"]) > 0, done.stdout
    per_type = dict(
        (name, float(count))
        for count, name in re.findall(r"^ +([0-9.]+)  (\S+)$", done.stdout, re.M)
    )
    # Each open stream has its request flow: the types table counts per connection.
    assert per_type.get("gateway.serving.flow.RequestFlow", 0) >= 0.5, done.stdout
