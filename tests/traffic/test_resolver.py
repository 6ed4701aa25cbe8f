"""Resolution: weighted shares, sticky rendezvous hashing (stable, moves only towards a raised
weight, matches the weights), pin precedence, the shadow draw, direct and single-version
requests, and the resolver's table swap. Seeded draws throughout."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from traffic.policy import Pin, Shadow, Split, TrafficPolicy
from traffic.resolver import (
    CompiledPolicy,
    Reason,
    Resolver,
    Subject,
    resolve,
    resolve_direct,
)


def split_policy(
    *weights: tuple[str, int], sticky: bool = False, shadow: Shadow | None = None
) -> CompiledPolicy:
    """A policy for alias ``a`` over (version, permille) pairs."""
    split = tuple(Split(version, permille) for version, permille in weights)
    return CompiledPolicy.compile(TrafficPolicy("a", split, sticky=sticky, shadow=shadow))


def no_draws() -> float:
    raise AssertionError("this resolution must not draw")


def subjects(n: int) -> list[Subject]:
    return [Subject(f"tenant-{i % 7}", "key", session=f"session-{i}") for i in range(n)]


def test_weighted_shares_match_the_weights() -> None:
    compiled = split_policy(("a@1", 900), ("a@2", 100))
    rand = random.Random(7).random
    subject = Subject("t", "k")
    counts = Counter(resolve(compiled, subject, rand).version for _ in range(10_000))
    assert 900 <= counts["a@2"] <= 1100
    assert resolve(compiled, subject, rand).reason == Reason.WEIGHTED


def test_a_tenth_of_a_percent_is_honoured() -> None:
    compiled = split_policy(("a@1", 999), ("a@2", 1))
    rand = random.Random(7).random
    subject = Subject("t", "k")
    counts = Counter(resolve(compiled, subject, rand).version for _ in range(100_000))
    assert 60 <= counts["a@2"] <= 140  # expected 100, standard deviation 10


def test_sticky_subjects_keep_their_version() -> None:
    compiled = split_policy(("a@1", 500), ("a@2", 300), ("a@3", 200), sticky=True)
    people = subjects(1000)
    first = [resolve(compiled, subject, no_draws) for subject in people]
    assert {resolution.reason for resolution in first} == {Reason.STICKY}
    for _ in range(3):
        again = [resolve(compiled, subject, no_draws).version for subject in people]
        assert again == [resolution.version for resolution in first]
    # Another replica compiles the same policy on its own and agrees.
    replica = split_policy(("a@1", 500), ("a@2", 300), ("a@3", 200), sticky=True)
    assert [resolve(replica, s, no_draws).version for s in people] == [r.version for r in first]
    shares = Counter(resolution.version for resolution in first)
    assert shares["a@1"] == pytest.approx(500, abs=45)
    assert shares["a@2"] == pytest.approx(300, abs=45)
    assert shares["a@3"] == pytest.approx(200, abs=45)


def test_sticky_identity_is_tenant_plus_session_else_user_else_tenant() -> None:
    compiled = split_policy(("a@1", 500), ("a@2", 500), sticky=True)

    def version(subject: Subject) -> str:
        return resolve(compiled, subject, no_draws).version

    # Every key of a tenant, and every user of one session, share the session's version.
    for i in range(50):
        session = f"s{i}"
        assert version(Subject("t", "k1", session=session)) == version(
            Subject("t", "k2", user="u", session=session)
        )
        assert version(Subject("t", "k1", user=f"u{i}")) == version(
            Subject("t", None, user=f"u{i}")
        )
    # Without session or user the whole tenant is one subject.
    assert len({version(Subject("t", f"k{i}")) for i in range(50)}) == 1
    # The tenant is part of the identity: one session id under many tenants spreads.
    assert len({version(Subject(f"t{i}", "k", session="s")) for i in range(50)}) == 2


def test_raising_the_candidate_only_moves_subjects_to_it() -> None:
    people = subjects(1000)
    previous: list[str] | None = None
    for percent in (1, 5, 10, 25, 50, 90, 100):
        permille = percent * 10
        if permille == 1000:
            compiled = CompiledPolicy.compile(TrafficPolicy.single("a", "a@new"))
        else:
            compiled = split_policy(("a@old", 1000 - permille), ("a@new", permille), sticky=True)
        now = [resolve(compiled, subject, no_draws).version for subject in people]
        if previous is not None:
            moved_back = [
                i
                for i, (was, is_) in enumerate(zip(previous, now, strict=True))
                if was == "a@new" != is_
            ]
            assert moved_back == []
        share = now.count("a@new") / len(people)
        assert share == pytest.approx(percent / 100, abs=0.04), percent
        previous = now
    assert previous == ["a@new"] * len(people)


def test_with_three_versions_raising_one_moves_subjects_only_to_it() -> None:
    people = subjects(1000)
    # Raise a@1; a@2 and a@3 give up weight in proportion (their ratio stays 1:1).
    steps = [(200, 400, 400), (400, 300, 300), (600, 200, 200), (800, 100, 100)]
    previous: list[str] | None = None
    for w1, w2, w3 in steps:
        compiled = split_policy(("a@1", w1), ("a@2", w2), ("a@3", w3), sticky=True)
        now = [resolve(compiled, subject, no_draws).version for subject in people]
        if previous is not None:
            for was, is_ in zip(previous, now, strict=True):
                assert was == is_ or is_ == "a@1", (was, is_)
        shares = Counter(now)
        assert shares["a@1"] == pytest.approx(w1, abs=45)
        previous = now


def test_key_pin_beats_tenant_pin_beats_the_split() -> None:
    policy = TrafficPolicy(
        "a",
        (Split("a@1", 500), Split("a@2", 500)),
        sticky=True,
        pins=(Pin("acme", None, "a@3"), Pin("acme", "k-special", "a@4")),
    )
    compiled = CompiledPolicy.compile(policy)
    key_pinned = resolve(compiled, Subject("acme", "k-special", session="s"), no_draws)
    assert (key_pinned.version, key_pinned.reason) == ("a@4", Reason.PIN)
    tenant_pinned = resolve(compiled, Subject("acme", "k-other", session="s"), no_draws)
    assert (tenant_pinned.version, tenant_pinned.reason) == ("a@3", Reason.PIN)
    assert resolve(compiled, Subject("acme", None), no_draws).version == "a@3"
    other = resolve(compiled, Subject("globex", "k-special", session="s"), no_draws)
    assert other.reason == Reason.STICKY
    assert other.version in {"a@1", "a@2"}


def test_a_key_pin_alone_leaves_the_tenants_other_keys_on_the_split() -> None:
    policy = TrafficPolicy("a", (Split("a@1", 1000),), pins=(Pin("acme", "k1", "a@2"),))
    compiled = CompiledPolicy.compile(policy)
    assert resolve(compiled, Subject("acme", "k1"), no_draws).version == "a@2"
    only = resolve(compiled, Subject("acme", "k2"), no_draws)
    assert (only.version, only.reason) == ("a@1", Reason.ONLY)


def test_shadow_share_matches_its_percent() -> None:
    compiled = split_policy(("a@1", 900), ("a@2", 100), shadow=Shadow("a@3", 50, 4))
    rand = random.Random(7).random
    resolutions = [resolve(compiled, Subject("t", "k"), rand) for _ in range(10_000)]
    shadowed = sum(1 for resolution in resolutions if resolution.shadow == "a@3")
    assert 400 <= shadowed <= 600
    assert all(resolution.shadow in (None, "a@3") for resolution in resolutions)
    # Independent of the primary: a@2 (10 %) is shadowed about 5 % of its requests too.
    to_2 = [resolution for resolution in resolutions if resolution.version == "a@2"]
    assert 0.02 <= sum(1 for r in to_2 if r.shadow) / len(to_2) <= 0.08


def test_a_shadow_is_never_the_primary() -> None:
    compiled = split_policy(("a@1", 500), ("a@2", 500), shadow=Shadow("a@2", 1000, 4))
    rand = random.Random(7).random
    resolutions = [resolve(compiled, Subject("t", "k"), rand) for _ in range(2_000)]
    for resolution in resolutions:
        assert resolution.shadow == (None if resolution.version == "a@2" else "a@2")
    assert {resolution.version for resolution in resolutions} == {"a@1", "a@2"}


def test_pinned_requests_are_shadowed_too() -> None:
    policy = TrafficPolicy(
        "a", (Split("a@1", 1000),), pins=(Pin("t", None, "a@2"),), shadow=Shadow("a@3", 1000, 4)
    )
    resolution = resolve(CompiledPolicy.compile(policy), Subject("t", "k"), random.Random(7).random)
    assert (resolution.version, resolution.reason, resolution.shadow) == ("a@2", Reason.PIN, "a@3")


def test_single_version_and_direct_requests() -> None:
    compiled = CompiledPolicy.compile(TrafficPolicy.single("a", "a@1"))
    only = resolve(compiled, Subject("t", "k"), no_draws)
    assert (only.version, only.reason, only.shadow) == ("a@1", Reason.ONLY, None)

    direct = resolve_direct(compiled, "a@0", Subject("t", "k"))
    assert direct is not None
    assert (direct.version, direct.reason, direct.shadow) == ("a@0", Reason.DIRECT, None)
    pins = (Pin("p", None, "a@0"), Pin("q", "kq", "a@2"))
    closed = CompiledPolicy.compile(
        TrafficPolicy("a", (Split("a@1", 1000),), pins=pins, direct_access=False)
    )
    assert resolve_direct(closed, "a@0", Subject("t", "k")) is None
    # A closed alias still serves a tenant (or a key) the version it is pinned to, only that.
    assert resolve_direct(closed, "a@0", Subject("p", "any key")) is not None
    assert resolve_direct(closed, "a@2", Subject("p", "any key")) is None
    assert resolve_direct(closed, "a@2", Subject("q", "kq")) is not None
    assert resolve_direct(closed, "a@2", Subject("q", "other")) is None


def test_reasons_are_their_metric_labels() -> None:
    assert [str(reason) for reason in Reason] == ["pin", "sticky", "weighted", "direct", "only"]


def test_resolver_replaces_its_whole_table() -> None:
    one = TrafficPolicy.single("a", "a@1")
    other = TrafficPolicy.single("b", "b@1")
    resolver = Resolver({"a": one})
    assert resolver.aliases() == ["a"]
    compiled_a = resolver.get("a")
    assert compiled_a is not None
    assert compiled_a.policy == one
    assert resolver.get("b") is None

    resolver.replace({"b": other, "a": TrafficPolicy.single("a", "a@1")})
    assert resolver.aliases() == ["a", "b"]
    assert resolver.get("a") is compiled_a  # an unchanged policy keeps its compiled form

    moved = TrafficPolicy("a", (Split("a@1", 500), Split("a@2", 500)))
    resolver.replace({"a": moved})
    assert resolver.aliases() == ["a"]
    compiled = resolver.get("a")
    assert compiled is not None
    assert compiled.policy == moved

    with pytest.raises(ValueError, match="filed under alias 'c'"):
        resolver.replace({"c": one})
    assert resolver.get("a") is compiled  # a refused table leaves the old one in place
