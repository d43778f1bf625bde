"""Live progress of a long batch: done / failed / timeout counts as samples finish.

On a terminal the counts are redrawn in place on one line (a bar, rate and ETA); anywhere
else (CI logs, files) they become a plain structlog event every ``log_every_s`` seconds and
once at the end. A :class:`BatchProgress` is itself an ``on_sample_done`` callback::

    progress = BatchProgress(total=len(rows) * n)
    result = await pipeline.run_batch(rows, n=n,
                                      on_sample_done=chain_callbacks(writer.write, progress))
    progress.close()
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TextIO

import structlog

from pipeline._concurrency.callables import check_callable
from pipeline._data.models import AgentRolloutItem, RolloutSample, Status

SampleCallback = Callable[[AgentRolloutItem, RolloutSample], None]

_logger = structlog.get_logger("pipeline")


def chain_callbacks(*callbacks: SampleCallback | None) -> SampleCallback:
    """One ``on_sample_done`` callback calling each given one in order (``None`` skipped).

    Raises:
        ConfigError: a callback that is not a plain callable (as ``on_sample_done`` itself).
    """
    chain = [cb for cb in callbacks if cb is not None]
    for callback in chain:
        check_callable(callback, "on_sample_done", "sync", shape="(item, sample) -> None")

    def on_sample_done(item: AgentRolloutItem, sample: RolloutSample) -> None:
        for callback in chain:
            callback(item, sample)

    return on_sample_done


class BatchProgress:
    """Counts finished samples by status and shows them live.

    Args:
        total: samples expected in the batch (None if unknown: no bar, no ETA).
        stream: where a terminal line is drawn (default ``sys.stderr``).
        tty: draw in place (True) or log events (False); default: whether ``stream`` is a
            terminal.
        refresh_s: the shortest time between two redraws on a terminal.
        log_every_s: the shortest time between two log events off a terminal.
        label: the word in front of the line and the ``label`` of log events.
        logger: a structlog logger for the events (default: the ``pipeline`` logger).
        clock: the time source (``time.monotonic``).
    """

    def __init__(self, total: int | None = None, *, stream: TextIO | None = None,
                 tty: bool | None = None, refresh_s: float = 0.1, log_every_s: float = 10.0,
                 label: str = "rollout", logger: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _isatty(self.stream) if tty is None else tty
        self.refresh_s = refresh_s
        self.log_every_s = log_every_s
        self.label = label
        self.logger = logger if logger is not None else _logger
        self.clock = clock
        self.counts: Counter[str] = Counter()
        self.started = clock()
        self._last_emit: float | None = None
        self._closed = False
        self._final_emitted = False

    @property
    def finished(self) -> int:
        """Samples finished so far, any status."""
        return sum(self.counts.values())

    def __call__(self, item: AgentRolloutItem, sample: RolloutSample) -> None:
        """``on_sample_done`` form of :meth:`update`."""
        self.update(sample.status)

    def update(self, status: Status | str) -> None:
        """Count one finished sample and redraw (or log) if it is time to."""
        self.counts[status.value if isinstance(status, Status) else str(status)] += 1
        now = self.clock()
        every = self.refresh_s if self.tty else self.log_every_s
        last_one = self.total is not None and self.finished >= self.total
        if self._last_emit is None and not self.tty:
            self._last_emit = self.started  # off a terminal, the first event waits a period
        if last_one:
            self._emit(now, final=True)
        elif self._last_emit is None or now - self._last_emit >= every:
            self._emit(now)

    def render(self, width: int = 24) -> str:
        """The progress line, e.g. ``rollout 37/100 [#########...] done 30 failed 5 ...``."""
        done = self.finished
        elapsed = self.clock() - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        parts = [self.label]
        if self.total:
            filled = min(width, int(width * done / self.total))
            parts.append(f"{done}/{self.total} [{'#' * filled}{'.' * (width - filled)}]")
        else:
            parts.append(f"{done}")
        parts.append(" ".join(f"{name} {self.counts.get(key, 0)}" for name, key in _SHOWN
                              if key != "aborted" or self.counts.get(key)))
        others = sorted(k for k in self.counts if k not in _KNOWN)
        parts.extend(f"{k} {self.counts[k]}" for k in others)
        parts.append(f"| {rate:.1f}/s {_duration(elapsed)}")
        if self.total and rate > 0 and done < self.total:
            parts.append(f"eta {_duration((self.total - done) / rate)}")
        return " ".join(parts)

    def close(self) -> None:
        """Draw (or log) the final counts; ends the terminal line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._final_emitted:
            self._emit(self.clock(), final=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _emit(self, now: float, final: bool = False) -> None:
        self._last_emit = now
        self._final_emitted = final
        if self.tty:
            self.stream.write("\r" + self.render() + "\x1b[K")
            self.stream.flush()
            return
        elapsed = now - self.started
        self.logger.info("rollout_progress", label=self.label, finished=self.finished,
                         total=self.total, completed=self.counts.get("completed", 0),
                         failed=self.counts.get("failed", 0),
                         timeout=self.counts.get("timeout", 0),
                         aborted=self.counts.get("aborted", 0),
                         elapsed_s=round(elapsed, 3), final=final)


_SHOWN = (("done", "completed"), ("failed", "failed"), ("timeout", "timeout"),
          ("aborted", "aborted"))
_KNOWN = {key for _, key in _SHOWN}


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
