"""One logging setup for all tokserve processes.

Lines carry the process role and pid so that the interleaved output of a whole
stack (launcher, broker, workers, gateway) stays attributable.
"""
from __future__ import annotations

import logging
import sys
import time

from common import config

_FORMAT = "%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s"


def setup_logging(role: str, level: str | None = None) -> None:
    """Configure the root logger once per process (idempotent: replaces handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.format(role=role)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or config.log_level()).upper())


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


class RateLimitedLog:
    """Logs at most ``burst`` messages per ``period`` seconds, then a summary.

    Used for peer-controlled events (garbage frames, unreachable clients) so a
    misbehaving peer cannot flood the log or slow the hot loop with formatting.
    """

    def __init__(self, logger: logging.Logger, period: float = 10.0, burst: int = 10):
        self._logger = logger
        self._period = period
        self._burst = burst
        self._window_start = 0.0
        self._count = 0
        self._suppressed = 0

    def warning(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._window_start > self._period:
            if self._suppressed:
                self._logger.warning("(%d similar messages suppressed)", self._suppressed)
            self._window_start, self._count, self._suppressed = now, 0, 0
        if self._count < self._burst:
            self._count += 1
            self._logger.warning(msg, *args)
        else:
            self._suppressed += 1
