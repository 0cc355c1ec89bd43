"""ConnectionLimiter's decisions (gateway/connection_limits.py): which connection gives
way at a cap; the real protocol path is in tests/integration/test_security_connections.py."""
from __future__ import annotations

from gateway.connection_limits import ConnectionLimiter, is_probe_path


def _limiter(total=4, per_peer=2, headroom=1):
    closed = []
    return ConnectionLimiter(total, per_peer, headroom, closed.append), closed


def test_a_peer_over_its_cap_loses_its_own_longest_idle_connection():
    lim, closed = _limiter()
    assert lim.admit("a1", "A") == "ok" and lim.admit("a2", "A") == "ok" and lim.admit("b1", "B") == "ok"
    lim.idle("a1")  # active again: a2 is now the longest idle of A
    assert lim.admit("a3", "A") == "ok"
    assert closed == ["a2"] and lim.open_connections == 3


def test_the_global_cap_evicts_the_longest_idle_of_anyone_and_skips_busy_ones():
    lim, closed = _limiter(per_peer=10)
    for c, p in (("a1", "A"), ("b1", "B"), ("c1", "C"), ("d1", "D")):
        assert lim.admit(c, p) == "ok"
    lim.busy("a1")  # a request in flight: never evicted
    assert lim.admit("e1", "E") == "ok"
    assert closed == ["b1"]
    lim.release("b1")  # its connection_lost, later: counted once
    assert lim.open_connections == 4


def test_with_nothing_idle_the_headroom_then_refusal():
    lim, closed = _limiter(total=2, per_peer=10, headroom=1)
    for c in ("x", "y"):
        lim.admit(c, "A")
        lim.busy(c)
    assert lim.admit("p", "B") == "probe"
    assert lim.admit("q", "B") == "refuse" and lim.refused == 1
    lim.release("p")
    assert lim.admit("q", "B") == "probe"
    lim.idle("x")  # x answered and waits: the next one takes its place
    assert lim.admit("r", "C") == "ok" and closed == ["x"]
    assert lim.open_connections == 3  # y, r and the probe q


def test_probe_paths_as_the_router_matches_them():
    for path in (b"/health", b"//health", b"/health/", b"/metrics?x=1", b"/version", b"/%68ealth"):
        assert is_probe_path(path), path
    for path in (b"/inference/v1/generate", b"/healthz", b"/v1/models", b"/", b"/health%2Fx"):
        assert not is_probe_path(path), path
