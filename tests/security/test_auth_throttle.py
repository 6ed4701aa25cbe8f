"""The failed-authentication throttle and the client address it counts by, as pure policy with
a fake clock (``gateway/auth_throttle.py``, ``gateway/client_address.py``). Through the real
gateway: ``test_failed_auth.py``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.assembly.settings import TandemSettings
from gateway.auth_throttle import AuthThrottleConfig, FailedAuthThrottle, client_key
from gateway.client_address import is_local, parse_trusted_proxies, resolve_client


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(max_failures: int = 5, window_s: float = 10.0, **config: int) -> tuple[
    FailedAuthThrottle, FakeClock
]:  # fmt: skip
    clock = FakeClock()
    return FailedAuthThrottle(AuthThrottleConfig(max_failures, window_s, **config), clock), clock


def test_a_burst_of_the_limit_is_allowed_and_the_next_attempt_waits_one_refill() -> None:
    throttle, _ = _throttle(max_failures=5, window_s=10.0)
    for _ in range(4):
        assert throttle.record_failure("198.51.100.7") is None
        assert throttle.retry_after_s("198.51.100.7") is None
    # The fifth failure empties the bucket: it is the one that throttles (reported once).
    assert throttle.record_failure("198.51.100.7") == pytest.approx(2.0)
    assert throttle.retry_after_s("198.51.100.7") == pytest.approx(2.0)
    assert throttle.retry_after_s("198.51.100.8") is None, "another client is untouched"


def test_the_bucket_refills_one_attempt_per_window_over_limit() -> None:
    throttle, clock = _throttle(max_failures=5, window_s=10.0)
    for _ in range(5):
        throttle.record_failure("198.51.100.7")
    clock.now += 1.5
    assert throttle.retry_after_s("198.51.100.7") == pytest.approx(0.5)
    clock.now += 0.5
    assert throttle.retry_after_s("198.51.100.7") is None
    # One refill bought one attempt: failing it throttles again for one refill...
    assert throttle.record_failure("198.51.100.7") == pytest.approx(2.0)
    # ...so a steady guesser gets max_failures per window, not more.
    failures = 0
    for _ in range(480):  # a minute of trying every 125 ms (exact in binary: no drift)
        clock.now += 0.125
        if throttle.retry_after_s("198.51.100.7") is None:
            throttle.record_failure("198.51.100.7")
            failures += 1
    assert failures == 30  # 5 per 10 s
    # Left alone for a window, the client has its whole burst back.
    clock.now += 10.0
    for _ in range(4):
        assert throttle.record_failure("198.51.100.7") is None


def test_a_refund_gives_back_one_failure() -> None:
    throttle, clock = _throttle(max_failures=2, window_s=10.0)
    throttle.record_failure("198.51.100.7")
    assert throttle.record_failure("198.51.100.7") is not None  # a reservation empties it...
    throttle.refund("198.51.100.7")  # ...and its attempt succeeded
    assert throttle.retry_after_s("198.51.100.7") is None
    throttle.refund("198.51.100.7")
    assert throttle.num_clients == 0, "nothing left to remember"
    throttle.refund("198.51.100.7")  # forgotten meanwhile: nothing to give back
    clock.now += 1.0
    assert throttle.record_failure("198.51.100.7") is None


def test_memory_is_bounded_under_failures_from_many_addresses() -> None:
    throttle, clock = _throttle(max_failures=2, window_s=60.0, max_clients=100)
    for _ in range(2):
        throttle.record_failure("203.0.113.1")  # throttled first...
    for i in range(10_000):
        clock.now += 0.001
        throttle.record_failure(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert throttle.num_clients == 100
    # ...and, its last failure the oldest, the first forgotten: the bound costs a tracked
    # client its state, never memory.
    assert throttle.retry_after_s("203.0.113.1") is None
    assert throttle.retry_after_s("10.0.39.15") is None  # one failure of 2: not throttled
    throttle.record_failure("10.0.39.15")
    assert throttle.retry_after_s("10.0.39.15") is not None


def test_ipv6_clients_count_by_their_64_network() -> None:
    throttle, _ = _throttle(max_failures=3)
    for host in ("2001:db8:1:2::1", "2001:db8:1:2::2", "2001:db8:1:2:ffff::9"):
        throttle.record_failure(host)
    assert throttle.retry_after_s("2001:db8:1:2::77") is not None, "same /64: same client"
    assert throttle.retry_after_s("2001:db8:1:3::1") is None
    assert client_key("::ffff:192.0.2.9") == "192.0.2.9"
    assert client_key("2001:db8:1:2:3:4:5:6") == "2001:db8:1:2::/64"
    assert client_key("not-an-address") == "not-an-address"


def test_no_address_or_a_zero_limit_is_never_throttled() -> None:
    throttle, _ = _throttle(max_failures=1)
    assert throttle.record_failure(None) is None
    assert throttle.retry_after_s(None) is None
    off, _ = _throttle(max_failures=0)
    for _ in range(100):
        assert off.record_failure("198.51.100.7") is None
    assert off.retry_after_s("198.51.100.7") is None and off.num_clients == 0


def test_config_refuses_impossible_limits() -> None:
    for bad in ({"max_failures": -1}, {"window_s": 0.0}, {"max_clients": 0}):
        with pytest.raises(ValueError, match="AuthThrottleConfig needs"):
            AuthThrottleConfig(**bad)  # type: ignore[arg-type]


# -- whose address ----------------------------------------------------------------------------

PROXIES = parse_trusted_proxies(["10.0.0.0/8", "192.0.2.1"])


def test_forwarded_for_is_ignored_unless_the_peer_is_a_trusted_proxy() -> None:
    assert resolve_client("198.51.100.7", ["203.0.113.9"], ()) == "198.51.100.7"
    assert resolve_client("198.51.100.7", ["203.0.113.9"], PROXIES) == "198.51.100.7"
    assert resolve_client("10.1.2.3", ["203.0.113.9"], PROXIES) == "203.0.113.9"
    assert resolve_client("10.1.2.3", [], PROXIES) == "10.1.2.3"
    assert resolve_client(None, ["203.0.113.9"], PROXIES) is None


def test_the_client_is_the_rightmost_address_that_is_not_a_trusted_proxy() -> None:
    # The client wrote the leftmost entries itself: a forged one is never read.
    forged = ["6.6.6.6, 203.0.113.9, 10.0.0.5", "192.0.2.1"]
    assert resolve_client("10.1.2.3", forged, PROXIES) == "203.0.113.9"
    # Every hop trusted: the leftmost is the client.
    assert resolve_client("10.1.2.3", ["10.9.9.9, 10.0.0.5"], PROXIES) == "10.9.9.9"
    # Ports some proxies append, and junk, which is never taken for a proxy.
    assert resolve_client("10.1.2.3", ["203.0.113.9:5123"], PROXIES) == "203.0.113.9"
    assert resolve_client("10.1.2.3", ["[2001:db8::5]:443"], PROXIES) == "2001:db8::5"
    assert resolve_client("10.1.2.3", ["203.0.113.9, junk"], PROXIES) == "junk"


def test_local_clients_are_this_hosts_loopback_addresses() -> None:
    assert all(is_local(a) for a in ("127.0.0.1", "127.0.0.9", "::1", "::ffff:127.0.0.1"))
    assert not any(is_local(a) for a in ("10.0.0.1", "2001:db8::1", "junk", None))


def test_trusted_proxies_setting_names_a_bad_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_TRUSTED_PROXIES", "10.0.0.0/8, 127.0.0.1")
    assert TandemSettings().trusted_proxies == ["10.0.0.0/8", "127.0.0.1"]
    monkeypatch.setenv("TANDEM_TRUSTED_PROXIES", "10.0.0.0/8,proxy.internal")
    with pytest.raises(ValidationError, match=r"'proxy\.internal' is not an IP address or network"):
        TandemSettings()
    monkeypatch.setenv("TANDEM_AUTH_FAILURE_LIMIT", "-1")
    monkeypatch.delenv("TANDEM_TRUSTED_PROXIES")
    with pytest.raises(ValidationError, match="auth_failure_limit"):
        TandemSettings()
