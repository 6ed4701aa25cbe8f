"""Traffic policies: parsing percents to permille, every refusal naming its field, the exact
round trip through the JSON shape, checking versions against what is deployed, the exports."""

from __future__ import annotations

from typing import Any

import pytest

import traffic
from traffic.policy import (
    Pin,
    PolicyError,
    Shadow,
    Split,
    TrafficPolicy,
    check_versions,
    policy_from_dict,
    policy_to_dict,
)

FULL: dict[str, Any] = {
    "split": [{"version": "a@1", "weight": 90}, {"version": "a@2", "weight": 10}],
    "sticky": True,
    "pins": [
        {"tenant": "t1", "key": None, "version": "a@1"},
        {"tenant": "t1", "key": "k9", "version": "a@2"},
    ],
    "shadow": {"version": "a@3", "percent": 5, "max_in_flight": 2},
    "direct_access": False,
}


def with_(**changes: Any) -> dict[str, Any]:
    return {**FULL, **changes}


def test_parses_the_full_shape() -> None:
    policy = policy_from_dict("a", FULL)
    assert policy == TrafficPolicy(
        "a",
        (Split("a@1", 900), Split("a@2", 100)),
        sticky=True,
        pins=(Pin("t1", None, "a@1"), Pin("t1", "k9", "a@2")),
        shadow=Shadow("a@3", 50, 2),
        direct_access=False,
    )
    assert policy.versions() == {"a@1", "a@2", "a@3"}


def test_defaults() -> None:
    policy = policy_from_dict("a", {"split": [{"version": "a@1", "weight": 100}]})
    assert policy == TrafficPolicy.single("a", "a@1")
    assert not policy.sticky
    assert policy.pins == ()
    assert policy.shadow is None
    assert policy.direct_access
    shadowed = policy_from_dict("a", with_(shadow={"version": "a@3", "percent": 1}))
    assert shadowed.shadow == Shadow("a@3", 10, 4)


@pytest.mark.parametrize(
    ("weights", "permille"),
    [
        ((99.9, 0.1), (999, 1)),
        (("99.9", "0.1"), (999, 1)),
        ((50, 50.0), (500, 500)),
        (("12.5", 87.5), (125, 875)),
        ((" 70 ", "30.0"), (700, 300)),
    ],
)
def test_percents_become_permille(weights: tuple[Any, Any], permille: tuple[int, int]) -> None:
    split = [{"version": "a@1", "weight": weights[0]}, {"version": "a@2", "weight": weights[1]}]
    policy = policy_from_dict("a", {"split": split})
    assert tuple(s.permille for s in policy.split) == permille


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({}, "split"),
        ({"split": []}, "split"),
        ({"split": "a@1"}, "split"),
        ({"split": [{"version": "a@1", "weight": 90}]}, "split"),
        ({"split": [{"version": "a@1", "weight": 60}, {"version": "a@2", "weight": 50}]}, "split"),
        (
            {"split": [{"version": "a@1", "weight": 100}, {"version": "a@2", "weight": 0}]},
            "split[1].weight",
        ),
        (
            {"split": [{"version": "a@1", "weight": 110}, {"version": "a@2", "weight": -10}]},
            "split[0].weight",
        ),
        (
            {"split": [{"version": "a@1", "weight": 50}, {"version": "a@1", "weight": 50}]},
            "split[1].version",
        ),
        (
            {"split": [{"version": "a@1", "weight": 99.95}, {"version": "a@2", "weight": 0.05}]},
            "split[0].weight",
        ),
        (
            {"split": [{"version": "a@1", "weight": "10.000000000000000000000000000001"}]},
            "split[0].weight",
        ),
        ({"split": [{"version": "a@1", "weight": True}]}, "split[0].weight"),
        ({"split": [{"version": "a@1", "weight": "ten"}]}, "split[0].weight"),
        ({"split": [{"version": "a@1", "weight": "NaN"}]}, "split[0].weight"),
        ({"split": [{"version": "a@1", "weight": None}]}, "split[0].weight"),
        ({"split": [{"version": "a@1"}]}, "split[0].weight"),
        ({"split": [{"weight": 100}]}, "split[0].version"),
        ({"split": [{"version": "", "weight": 100}]}, "split[0].version"),
        ({"split": [{"version": "a@1", "weight": 100, "wieght": 1}]}, "split[0].wieght"),
        ({"split": ["a@1"]}, "split[0]"),
        (with_(stickky=True, zzz=1), "stickky"),
        (with_(sticky="yes"), "sticky"),
        (with_(direct_access=1), "direct_access"),
        (with_(pins={"tenant": "t1"}), "pins"),
        (with_(pins=[{"key": None, "version": "a@1"}]), "pins[0].tenant"),
        (with_(pins=[{"tenant": "t1", "key": "", "version": "a@1"}]), "pins[0].key"),
        (with_(pins=[{"tenant": "t1", "key": None}]), "pins[0].version"),
        (with_(pins=[{"tenant": "t1", "version": "a@1", "team": "x"}]), "pins[0].team"),
        (
            with_(
                pins=[
                    {"tenant": "t1", "key": "k", "version": "a@1"},
                    {"tenant": "t1", "key": "k", "version": "a@2"},
                ]
            ),
            "pins[1]",
        ),
        (with_(shadow="a@3"), "shadow"),
        (with_(shadow={"percent": 5}), "shadow.version"),
        (with_(shadow={"version": "a@3"}), "shadow.percent"),
        (with_(shadow={"version": "a@3", "percent": 0}), "shadow.percent"),
        (with_(shadow={"version": "a@3", "percent": 100.1}), "shadow.percent"),
        (with_(shadow={"version": "a@3", "percent": 0.05}), "shadow.percent"),
        (
            with_(shadow={"version": "a@3", "percent": 5, "max_in_flight": 0}),
            "shadow.max_in_flight",
        ),
        (
            with_(shadow={"version": "a@3", "percent": 5, "max_in_flight": 2.5}),
            "shadow.max_in_flight",
        ),
        (with_(shadow={"version": "a@3", "percent": 5, "cap": 2}), "shadow.cap"),
    ],
)
def test_every_refusal_names_its_field(data: dict[str, Any], param: str) -> None:
    with pytest.raises(PolicyError) as caught:
        policy_from_dict("a", data)
    assert caught.value.param == param
    assert str(caught.value)


def test_refusals_say_what_is_wrong() -> None:
    split = [{"version": "a@1", "weight": 60}, {"version": "a@2", "weight": 39.5}]
    with pytest.raises(PolicyError, match=r"sum to exactly 100, got 99\.5"):
        policy_from_dict("a", {"split": split})
    with pytest.raises(PolicyError, match="stickky") as caught:
        policy_from_dict("a", with_(stickky=True))
    assert "sticky" in caught.value.message
    with pytest.raises(PolicyError, match="the traffic policy must be a JSON object"):
        policy_from_dict("a", ["a@1"])  # type: ignore[arg-type]


def test_constructed_policies_are_checked_too() -> None:
    with pytest.raises(PolicyError) as caught:
        TrafficPolicy("a", (Split("a@1", 500),))
    assert caught.value.param == "split"
    with pytest.raises(PolicyError) as caught:
        TrafficPolicy("", (Split("a@1", 1000),))
    assert caught.value.param == "alias"
    with pytest.raises(PolicyError) as caught:
        TrafficPolicy("a", (Split("a@1", 1000),), shadow=Shadow("a@2", 10, 0))
    assert caught.value.param == "shadow.max_in_flight"


def test_a_shadow_may_also_be_in_the_split() -> None:
    policy = policy_from_dict("a", with_(shadow={"version": "a@2", "percent": 100}))
    assert policy.shadow == Shadow("a@2", 1000, 4)


@pytest.mark.parametrize(
    "data",
    [
        FULL,
        {"split": [{"version": "a@1", "weight": 100}]},
        {
            "split": [
                {"version": "a@1", "weight": 99.8},
                {"version": "a@2", "weight": 0.1},
                {"version": "a@3", "weight": "0.1"},
            ],
            "shadow": {"version": "a@4", "percent": 0.1},
        },
    ],
)
def test_to_dict_and_from_dict_are_inverses(data: dict[str, Any]) -> None:
    policy = policy_from_dict("a", data)
    rendered = policy_to_dict(policy)
    assert policy_from_dict("a", rendered) == policy
    assert policy_to_dict(policy_from_dict("a", rendered)) == rendered


def test_to_dict_renders_whole_percents_as_ints() -> None:
    split = [{"version": "a@1", "weight": "99.5"}, {"version": "a@2", "weight": 0.5}]
    rendered = policy_to_dict(
        policy_from_dict("a", {"split": split, "shadow": {"version": "a@2", "percent": 20.0}})
    )
    assert rendered == {
        "split": [{"version": "a@1", "weight": 99.5}, {"version": "a@2", "weight": 0.5}],
        "sticky": False,
        "pins": [],
        "shadow": {"version": "a@2", "percent": 20, "max_in_flight": 4},
        "direct_access": True,
    }
    assert isinstance(rendered["shadow"]["percent"], int)


def test_check_versions_names_the_missing_or_undeployed_version() -> None:
    policy = policy_from_dict("a", FULL)
    deployed = {"a@1", "a@2", "a@3"}
    check_versions(policy, exists=deployed.__contains__, has_workers=deployed.__contains__)

    with pytest.raises(PolicyError, match="does not exist") as caught:
        check_versions(policy, exists={"a@1", "a@3"}.__contains__, has_workers=lambda v: True)
    assert caught.value.param == "split[1].version"

    with pytest.raises(PolicyError, match="deploy it first") as caught:
        check_versions(policy, exists=lambda v: True, has_workers={"a@1", "a@2"}.__contains__)
    assert caught.value.param == "shadow.version"

    pinned_elsewhere = policy_from_dict(
        "a", with_(pins=[{"tenant": "t", "version": "a@9"}], shadow=None)
    )
    with pytest.raises(PolicyError, match="deploy it first") as caught:
        check_versions(pinned_elsewhere, exists=lambda v: True, has_workers=deployed.__contains__)
    assert caught.value.param == "pins[0].version"


def test_public_exports() -> None:
    assert sorted(traffic.__all__) == [
        "Backlog",
        "CompiledPolicy",
        "Pin",
        "PolicyError",
        "Quantiles",
        "Reason",
        "RequestFigures",
        "Resolution",
        "Resolver",
        "Shadow",
        "ShadowLimiter",
        "Split",
        "Subject",
        "TrafficPolicy",
        "VersionWindows",
        "Waiting",
        "WindowSnapshot",
        "check_versions",
        "policy_from_dict",
        "policy_to_dict",
        "resolve",
        "resolve_direct",
    ]
    assert all(hasattr(traffic, name) for name in traffic.__all__)
