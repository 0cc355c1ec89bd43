"""The test suite on a busy machine: `python -m pytest` while busy processes hog the CPUs.

    python -m benchmarks.suite_under_load                      # 2 hogs, the whole suite once
    python -m benchmarks.suite_under_load --runs 3             # three consecutive runs, stops at the first red
    python -m benchmarks.suite_under_load --hogs 4 -- -x tests/integration/test_broker.py

Everything after ``--`` goes to pytest (default: ``-q``).  Each hog is a pure busy loop in
its own process, as a CPU-bound neighbour is; the hogs start before each run, are
stopped after it, and die with this script (they watch its pid), so none outlives the
suite.  Prints per run: green/red, pytest's exit status, duration and the load average;
exits with the first red run's status (0 when every run was green).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _hog(parent: int) -> None:
    """Spin until told to stop, or until the script that started us is gone."""
    while True:
        for _ in range(2_000_000):
            pass
        if os.getppid() != parent:
            return


class Hogs:
    def __init__(self, count: int):
        self.count = count
        self.procs: list[multiprocessing.Process] = []

    def __enter__(self) -> "Hogs":
        ctx = multiprocessing.get_context("spawn")
        for _ in range(self.count):
            proc = ctx.Process(target=_hog, args=(os.getpid(),), daemon=True)
            proc.start()
            self.procs.append(proc)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.join(10)
        self.procs.clear()


def run_once(pytest_args: list[str], hogs: int) -> tuple[int, float, tuple]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    with Hogs(hogs):
        started = time.monotonic()
        suite = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO, env=env)
        try:
            rc = suite.wait()
        finally:  # interrupted (Ctrl-C, SIGTERM): the suite stops with us
            if suite.poll() is None:
                suite.terminate()
                suite.wait(30)
        took = time.monotonic() - started
        load = os.getloadavg()
    return rc, took, load


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = ["-q"]
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1:] or pytest_args
    p = argparse.ArgumentParser(prog="suite_under_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--hogs", type=int, default=2, help="busy processes running beside the suite")
    p.add_argument("--runs", type=int, default=1, help="consecutive runs; stops at the first red one")
    args = p.parse_args(argv)
    if args.hogs < 0 or args.runs < 1:
        p.error("--hogs must be >= 0 and --runs >= 1")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the suite and the hogs are stopped
    for run in range(1, args.runs + 1):
        rc, took, load = run_once(pytest_args, args.hogs)
        verdict = "GREEN" if rc == 0 else "RED"
        print(f"suite_under_load: run {run}/{args.runs} {verdict} (pytest exit {rc}) in {took:.0f} s with "
              f"{args.hogs} hog(s); load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
        if rc != 0:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
