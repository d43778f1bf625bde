"""``Watchdog``: a thread that notices a blocked event loop and a stalled pipeline.

Loop lag is measured from outside the loop: every ``interval_s`` the watchdog thread posts a
heartbeat with ``call_soon_threadsafe`` and notes when it was posted; the loop runs the
heartbeat when it gets to it. A heartbeat unanswered for ``threshold_s`` means the loop has
been blocked at least that long: the watchdog reads the loop thread's current Python stack
(``sys._current_frames``) and logs ``event_loop_blocked`` with the innermost frame
(``blocking``, the code that blocks) and the stack (``frames``). A block is detected at
most ``threshold_s + interval_s`` after it starts (plus a GIL switch interval when the loop
thread spins in Python). The cyclic garbage collector holds the GIL for a whole pass, up to a
second with millions of live objects, so a block it caused is seen once it is over, with a
stack that is not the collector's: each report says how many of its seconds were the
collector's passes (``collector_s``; the watchdog observes them through ``gc.callbacks``
while it runs, and changes no collector setting).

The limits, all in seconds and measured by the watchdog thread:

- ``threshold_s`` (*block threshold*): a heartbeat unanswered this long is reported once as
  a block of the event loop; nothing is killed.
- ``stall_after_s`` (*stall*): while a pipeline batch is in progress and no sample finished
  for this long, ``pipeline_stalled`` is logged and a snapshot written, once per stall. The
  loop may be perfectly healthy (samples are just slow): a stall is a report, not a fault.
- ``hard_limit_s`` (*block kill*): a block lasting this long writes a snapshot and ends the
  process with ``exit_code`` (``os._exit``: the only exit that works when the loop thread is
  stuck). It applies to blocks only; it must exceed ``threshold_s``.
- ``stall_limit_s`` (*stall kill*): a stall lasting this long does the same. It needs
  ``stall_after_s`` and may not be below it (a stall is reported before it kills).

Blocks and stalls are killed by separate limits, so a tight block limit never ends a
process whose samples are merely slow. Inconsistent values raise :class:`ConfigError` at
construction.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from pipeline._exceptions import ConfigError
from pipeline.diagnostics._collector import COLLECTOR
from pipeline.diagnostics._frames import FrameInfo, iter_list_retrying, stack_of
from pipeline.diagnostics._snapshot import note_loop_thread

_logger = structlog.get_logger("pipeline.diagnostics")


@dataclass(frozen=True, slots=True)
class BlockReport:
    """One detected block of the event loop (passed to ``on_block``)."""

    lag_s: float
    """How long the unanswered heartbeat had waited when the block was reported."""
    started: float
    """``time.monotonic()`` when the unanswered heartbeat was posted."""
    thread_ident: int | None
    stack: tuple[FrameInfo, ...]
    """The loop thread's stack at detection, innermost last."""
    collector_s: float = 0.0
    """Seconds of the block that were the cyclic garbage collector's passes (it holds the
    GIL for a whole pass: the stack then shows where the loop was, not the collector)."""

    @property
    def blocking(self) -> FrameInfo | None:
        """The innermost frame: the code that holds the loop."""
        return self.stack[-1] if self.stack else None


@dataclass(frozen=True, slots=True)
class LagStats:
    """Heartbeat lags observed so far (seconds)."""

    beats: int
    max_s: float
    mean_s: float
    blocks: int
    stalls: int


class Watchdog:
    """Measures event-loop lag from a thread; reports blocks and stalls; can escalate.

    Args:
        threshold_s: a heartbeat unanswered this long is reported as a block.
        interval_s: time between heartbeats (default: ``min(0.05, threshold_s / 4)``).
        stall_after_s: report a stall when a pipeline batch is in progress and no sample
            finished for this long; None disables the stall detector.
        stall_check_s: how often the stall detector looks (default ``min(1, stall_after_s/10)``).
        hard_limit_s: a block of the loop lasting this long writes a snapshot and exits the
            process with ``exit_code``; None (default) never exits on a block.
        stall_limit_s: a stall lasting this long writes a snapshot and exits the process;
            None (default) never exits on a stall.
        exit_code: the exit status for either kill limit.
        dump: writes a snapshot and returns its path (default: :func:`pipeline.diagnostics.dump`).
        on_block: called (from the watchdog thread) with each :class:`BlockReport`.

    Raises:
        ConfigError: a non-positive limit, ``hard_limit_s`` not above ``threshold_s``,
            ``stall_limit_s`` without ``stall_after_s`` or below it, or ``interval_s`` above
            ``threshold_s`` (a block could end unseen between two heartbeats).
    """

    def __init__(self, threshold_s: float = 1.0, *, interval_s: float | None = None,
                 stall_after_s: float | None = None, stall_check_s: float | None = None,
                 hard_limit_s: float | None = None, stall_limit_s: float | None = None,
                 exit_code: int = 70,
                 dump: Callable[[str], Path] | None = None,
                 on_block: Callable[[BlockReport], None] | None = None) -> None:
        for name, value in (("threshold_s", threshold_s), ("interval_s", interval_s),
                            ("stall_after_s", stall_after_s), ("stall_check_s", stall_check_s),
                            ("hard_limit_s", hard_limit_s), ("stall_limit_s", stall_limit_s)):
            if value is not None and not value > 0:
                raise ConfigError(f"Watchdog: {name} must be > 0, got {value!r}")
        if hard_limit_s is not None and hard_limit_s <= threshold_s:
            raise ConfigError(f"Watchdog: hard_limit_s ({hard_limit_s}) must exceed "
                              f"threshold_s ({threshold_s}): a block is reported before it "
                              f"kills")
        if interval_s is not None and interval_s > threshold_s:
            raise ConfigError(f"Watchdog: interval_s ({interval_s}) must not exceed "
                              f"threshold_s ({threshold_s})")
        if stall_limit_s is not None:
            if stall_after_s is None:
                raise ConfigError("Watchdog: stall_limit_s needs stall_after_s (the stall "
                                  "detector is off without it)")
            if stall_limit_s < stall_after_s:
                raise ConfigError(f"Watchdog: stall_limit_s ({stall_limit_s}) must not be "
                                  f"below stall_after_s ({stall_after_s}): a stall is "
                                  f"reported before it kills")
        self.threshold_s = threshold_s
        self.interval_s = interval_s or min(0.05, threshold_s / 4)
        self.stall_after_s = stall_after_s
        self.stall_check_s = stall_check_s or (
            None if stall_after_s is None else min(1.0, stall_after_s / 10))
        self.hard_limit_s = hard_limit_s
        self.stall_limit_s = stall_limit_s
        self.exit_code = exit_code
        self.dump = dump
        self.on_block = on_block
        self.blocks: list[BlockReport] = []
        self.stalls = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._answered = 0
        self._posted_at: float | None = None
        self._beats = 0
        self._lag_sum = 0.0
        self._lag_max = 0.0

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> Watchdog:
        """Start watching ``loop`` (default: the running loop).

        Raises:
            RuntimeError: no loop given and none running, or already started.
        """
        if self._thread is not None:
            raise RuntimeError("this Watchdog is already started")
        self._loop = loop or asyncio.get_running_loop()
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is self._loop:
                self._loop_thread = threading.get_ident()
                note_loop_thread(self._loop)
        self._stop.clear()
        COLLECTOR.attach()
        self._thread = threading.Thread(target=self._watch, name="rollout-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and wait for it (at most a few heartbeat intervals)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
            COLLECTOR.detach()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stats(self) -> LagStats:
        """Heartbeat lag figures so far."""
        beats = self._beats
        return LagStats(beats=beats, max_s=self._lag_max,
                        mean_s=self._lag_sum / beats if beats else 0.0,
                        blocks=len(self.blocks), stalls=self.stalls)

    def lags(self) -> dict[int, float]:
        """``id(loop) -> seconds`` the pending heartbeat has waited (for snapshots)."""
        posted, loop = self._posted_at, self._loop
        if posted is None or loop is None:
            return {}
        return {id(loop): time.monotonic() - posted}

    def _beat(self, seq: int, posted: float) -> None:
        """Runs on the loop: answers heartbeat ``seq``."""
        lag = time.monotonic() - posted
        self._loop_thread = threading.get_ident()
        self._beats += 1
        self._lag_sum += lag
        self._lag_max = max(self._lag_max, lag)
        self._answered = seq

    def _watch(self) -> None:
        try:
            self._watch_loop()
        except Exception as exc:  # a dead watchdog must say so
            _logger.error("watchdog_failed", error=f"{type(exc).__name__}: {exc}")

    def _watch_loop(self) -> None:
        loop = self._loop
        assert loop is not None
        seq = 0
        stall = _StallState()
        next_stall_check = time.monotonic()
        while not self._stop.is_set():
            seq += 1
            posted = time.monotonic()
            collector_at_post = COLLECTOR.total_s
            self._posted_at = posted
            try:
                loop.call_soon_threadsafe(self._beat, seq, posted)
            except RuntimeError:  # the loop is closed
                return
            reported: BlockReport | None = None
            escalated = False
            while not self._stop.wait(self._wait_step(posted, reported)):
                now = time.monotonic()
                if self._answered >= seq:
                    break
                if not loop.is_running():  # stopped or closed, not blocked: nothing to report
                    if loop.is_closed():
                        return
                    posted = now
                    continue
                lag = now - posted
                if reported is None and lag >= self.threshold_s:
                    reported = self._report_block(lag, posted,
                                                  COLLECTOR.total_s - collector_at_post)
                if (not escalated and self.hard_limit_s is not None
                        and lag >= self.hard_limit_s):
                    escalated = True
                    self._escalate(f"event loop blocked for {lag:.1f}s", self.hard_limit_s)
                if self.stall_after_s is not None and now >= next_stall_check:
                    next_stall_check = now + (self.stall_check_s or 1.0)
                    self._check_stall(stall, now)
            self._posted_at = None
            if reported is not None:
                _logger.warning("event_loop_unblocked",
                                blocked_s=round(time.monotonic() - posted, 3))
            now = time.monotonic()
            if self.stall_after_s is not None and now >= next_stall_check:
                next_stall_check = now + (self.stall_check_s or 1.0)
                self._check_stall(stall, now)
            self._stop.wait(max(0.0, self.interval_s - (now - posted)))

    def _wait_step(self, posted: float, reported: BlockReport | None) -> float:
        """How long to sleep before looking at the pending heartbeat again."""
        if reported is not None:
            return self.interval_s
        left = posted + self.threshold_s - time.monotonic()
        return max(0.0, min(self.interval_s, left))

    def _report_block(self, lag: float, posted: float, collector_s: float) -> BlockReport:
        ident = self._loop_thread
        frame = sys._current_frames().get(ident) if ident is not None else None
        stack = stack_of(frame)
        report = BlockReport(lag_s=lag, started=posted, thread_ident=ident, stack=stack,
                             collector_s=collector_s)
        self.blocks.append(report)
        blocking = report.blocking
        _logger.warning("event_loop_blocked", lag_s=round(lag, 3),
                        collector_s=round(collector_s, 3),
                        blocking=None if blocking is None else str(blocking),
                        frames=[str(f) for f in stack[-20:]])
        if self.on_block is not None:
            try:
                self.on_block(report)
            except Exception as exc:
                _logger.error("watchdog_on_block_failed", error=f"{type(exc).__name__}: {exc}")
        return report

    def _check_stall(self, stall: _StallState, now: float) -> None:
        from pipeline._runner.pipeline import running_pipelines  # the core imports diagnostics

        try:
            pipes = list(iter_list_retrying(running_pipelines()))
        except RuntimeError:
            return
        if not pipes:
            stall.reset(None, now)
            return
        done = sum(p.samples_done for p in pipes)
        if stall.done != done:
            stall.reset(done, now)
            return
        quiet = now - stall.since
        assert self.stall_after_s is not None
        if not stall.reported and quiet >= self.stall_after_s:
            stall.reported = True
            self.stalls += 1
            inflight = [s for p in pipes for s in p.inflight()]
            stages: dict[str, int] = {}
            for s in inflight:
                stages[s.stage or "-"] = stages.get(s.stage or "-", 0) + 1
            path = self._write_dump(f"stall: no sample finished for {quiet:.0f}s")
            _logger.error("pipeline_stalled", no_sample_done_s=round(quiet, 1),
                          inflight=len(inflight), by_stage=stages,
                          dump=None if path is None else str(path))
        if (self.stall_limit_s is not None and not stall.escalated
                and quiet >= self.stall_limit_s):
            stall.escalated = True
            self._escalate(f"no sample finished for {quiet:.0f}s", self.stall_limit_s)

    def _write_dump(self, reason: str) -> Path | None:
        try:
            if self.dump is not None:
                return self.dump(reason)
            from pipeline.diagnostics._dumper import dump

            return dump(reason=reason)
        except Exception as exc:
            _logger.error("watchdog_dump_failed", error=f"{type(exc).__name__}: {exc}")
            return None

    def _escalate(self, why: str, limit_s: float) -> None:
        path = self._write_dump(f"hard limit: {why}")
        _logger.critical("watchdog_exit", reason=why, limit_s=limit_s,
                         exit_code=self.exit_code, dump=None if path is None else str(path))
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(self.exit_code)


class _StallState:
    __slots__ = ("done", "escalated", "reported", "since")

    def __init__(self) -> None:
        self.done: int | None = None
        self.since = time.monotonic()
        self.reported = False
        self.escalated = False

    def reset(self, done: int | None, now: float) -> None:
        self.done, self.since, self.reported, self.escalated = done, now, False, False
