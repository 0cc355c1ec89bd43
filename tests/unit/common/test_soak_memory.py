"""benchmarks/soak.py's memory watch without a stack: the over-time rows and the
'worker RSS flat within ±5 % over the last two thirds' verdict."""
from __future__ import annotations

import os

from benchmarks import soak
from benchmarks.soak import MemoryWatch, anon_rss_kib


def watch_with(rows: list[tuple[float, dict[str, int]]]) -> MemoryWatch:
    watch = MemoryWatch(None)
    for seconds, rss in rows:
        watch.rows.append((seconds, 0, rss))
        for role, kib in rss.items():
            watch.pids[role] = 1
            watch.baseline.setdefault(role, kib)
            watch.maximum[role] = max(watch.maximum.get(role, 0), kib)
            watch.last[role] = kib
    return watch


def minutes(values: list[int], role: str = "worker[0]") -> list[tuple[float, dict[str, int]]]:
    return [(60.0 * i, {role: v, "broker": 40_000}) for i, v in enumerate(values)]


def test_growth_before_the_window_passes():
    # minutes 0..30: +20 % in the first ten, flat after: the criterion looks at the last 20
    values = [400_000 + 8_000 * i for i in range(10)] + [480_000] * 21
    watch = watch_with(minutes(values))
    low, high = watch.flatness("worker[0]")
    assert low == 0.0 and high == 0.0
    assert watch.report() is True


def test_growth_inside_the_window_fails(capsys):
    values = [400_000] * 10 + [400_000 + 1_300 * i for i in range(21)]  # +6.5 % by the end
    watch = watch_with(minutes(values))
    low, high = watch.flatness("worker[0]")
    assert low == 0.0 and 0.06 < high < 0.07
    assert watch.report() is False
    assert "FAIL" in capsys.readouterr().out


def test_a_drop_inside_the_window_counts_too():
    values = [500_000] * 11 + [450_000] * 20  # -10 % just after minute 10, where the window starts
    watch = watch_with(minutes(values))
    assert watch.flatness("worker[0]")[0] < -soak.FLAT_TOLERANCE
    assert watch.report() is False


def test_only_workers_decide_the_verdict():
    rows = [(60.0 * i, {"worker[0]": 400_000, "gateway[9]": 60_000 + 10_000 * i}) for i in range(31)]
    assert watch_with(rows).report() is True


def test_no_rows_is_no_pass():
    watch = MemoryWatch(None)
    watch.baseline["worker[0]"] = watch.maximum["worker[0]"] = watch.last["worker[0]"] = 1
    watch.pids["worker[0]"] = 1
    assert watch.flatness("worker[0]") is None
    assert watch.report() is False


def test_anon_split_of_a_live_process():
    parts = anon_rss_kib(os.getpid())
    assert parts is not None and parts["heap"] + parts["anon"] > 0
    assert anon_rss_kib(1 << 30) is None  # no such process
