"""Adaptive concurrency: the controller that sets how many samples one pipeline admits from the
engine's own load (``PipelineConfig.adaptive_concurrency``; :mod:`pipeline._runner.flow`
decides when it runs).

The rule, applied to each reading of the engine's load. The *turnover* is how long a sample
holds its slot (the larger of the completed samples' running mean and Little's law, slots in
use over completions per second): the engine's state changes only as admitted samples
finish, so every rate is per turnover, and the load is read about
:data:`READS_PER_TURNOVER` times per turnover (at most every ``interval_s``), so that its
averages span several readings:

- *shrink* by :data:`SHRINK` when the engine thrashes: it preempts more than
  ``preempt_high`` sequences per running one per turnover (at most once per half a
  turnover);
- *grow* while the engine has room (its KV cache below ``kv_high``, fewer running sequences
  than its cap) and the limit is in use (no free slot): by :data:`SLOW_START` per turnover
  until the engine is first full, by :data:`GROW` per turnover after that;
- once full, *steer* to a short queue: the limit moves by the gap between
  ``queue_target`` x running and the engine's waiting queue (averaged over half a turnover;
  a fall of the running count over :data:`RUNNING_TURNOVERS`) times :data:`GAIN` per
  turnover when the queue is short, :data:`GAIN_DOWN` when it is long, and holds while the
  queue is within :data:`DEADBAND` of its target.

Why it does not oscillate: the limit acts on the queue at once (an admitted sample queues in
the engine within milliseconds), but the queue is read through a half-turnover average, a
lag; an integrator of gain one per turnover behind that lag is damped (ratio about 0.7), as
long as the average spans several readings (a reading that replaced the average, as one
every 0.1 s did for samples of 0.3 s, made each noisy reading a step: a 31% swing on a loaded
machine). One reading never weighs more than half the average (a stalled loop's late reading
is not a trend), and the deadband keeps the queue's own noise (samples finishing in bursts,
coming back from tools) from moving the limit once it has settled.

A sample waiting on a tool holds no KV and no engine slot, so the signals do not count it:
with tool waits the limit grows until the engine, not the number of samples, is the
bottleneck.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
import time
from typing import Any

import structlog

from pipeline._concurrency.slots import FifoSlots
from pipeline._data.config import AdaptiveConcurrency

_logger = structlog.get_logger("pipeline")

SLOW_START = 2.0
"""Growth of the limit per turnover until the engine is first full."""
GROW = 1.1
"""Growth of the limit per turnover once it has been (gentle: it stays near the edge)."""
SHRINK = 0.9
"""Factor applied when the engine thrashes (preempts)."""
GAIN = 1.0
"""Share of a shortfall of the engine's queue (below its target) closed per turnover."""
GAIN_DOWN = 0.1
"""Share of an excess of the engine's queue (above its target) closed per turnover: a
queue that runs dry costs throughput at once, one too long only waiting, so the limit comes
down slowly (it would otherwise follow the running count down and up again as long
sequences come and go)."""
DEADBAND = 0.2
"""The limit holds while the engine's queue is within this share of its target."""
RUNNING_TURNOVERS = 4.0
"""A fall of the running count, which sets the queue target, is averaged over this many
turnovers."""
READS_PER_TURNOVER = 8
"""The engine's load is read this often per turnover (at most every ``interval_s``)."""
MIN_INTERVAL_S = 0.01
"""Never read the load more often than this."""
ABSORBED = 0.5
"""Growth holds for :data:`RUNNING_TURNOVERS` turnovers (and slow start ends) when the
engine's requests grew by less than this share of the limit's growth over the last half
turnover (both relative)."""
LAG_S = 0.02
"""A wake-up later than one interval and this after its due time is a sign of an overloaded
loop."""
HISTORY = 4096
"""Limit changes the controller remembers (a long run steers every few readings)."""

async def read_load(engine: object) -> Any:
    """``engine.load()`` (awaited when it is a coroutine: servers read ``/metrics``), or None
    when the engine has no such method or it failed."""
    load = getattr(engine, "load", None)
    if not callable(load):
        return None
    try:
        value = load()
        if inspect.isawaitable(value):
            value = await value
    except Exception as exc:  # a metrics scrape that failed is no signal, never an error
        _logger.debug("engine_load_failed", error=repr(exc))
        return None
    return value


class ConcurrencyController:
    """The adaptive limit of one pipeline's slots (the module doc has the rule).

    The slots keep their size until the engine gives a first load signal; from then on the
    limit stays within ``options``' bounds.

    Attributes:
        limit: the limit now (the slots' size once the engine gave a signal).
        decision: what the last reading decided: ``grow``, ``steer``, ``shrink``, ``hold``
            or ``fixed`` (the engine gives no load signal; the limit stays
            ``max_concurrency``).
        last_change: the last change of the limit: ``(monotonic time, from, to, why)``.
        history: ``(monotonic time, limit)`` at each change, the last :data:`HISTORY` of
            them, for benchmarks and tests.
    """

    def __init__(self, slots: FifoSlots, options: AdaptiveConcurrency) -> None:
        self.slots = slots
        self.options = options
        self.limit = float(slots.size)
        self.decision = "hold"
        self.signals = False
        self.kv_usage: float | None = None
        self.running = 0
        self.waiting = 0
        self.max_running: int | None = None
        self.preemptions = 0
        self._preemptions: int | None = None
        self._preempt_rate = 0.0
        self.turnover_s: float | None = None
        self._ran_s: float | None = None
        self._completed = 0
        self._rate: float | None = None
        self._in_use: float | None = None
        self.last_change: tuple[float, int, int, str] | None = None
        self._last_read: float | None = None
        self._late_s = 0.0  # how late the controller woke for this reading (see run)
        self._interval = options.interval_s
        self._probe: tuple[float, float, float] | None = None
        self._held_until = -math.inf
        self._in_engine = 0.0
        self._last_shrink = -math.inf
        self._pushed_back = False
        self._avg: tuple[float, float] | None = None
        self.history: collections.deque[tuple[float, int]] = collections.deque(
            [(time.monotonic(), slots.size)], maxlen=HISTORY)

    def sample_ran(self, seconds: float) -> None:
        """A sample held its slot ``seconds`` (one of the two turnover estimates)."""
        self._completed += 1
        if self._ran_s is None:
            self._ran_s = seconds
        else:
            self._ran_s += 0.05 * (seconds - self._ran_s)

    def _turnover(self, dt: float) -> None:
        # Two estimates of how long a sample holds a slot, the larger taken: the running
        # mean of the samples that completed, which early in a batch counts only the short
        # ones (they finish first), and Little's law, slots in use over completions per
        # second, which counts the time a sample spends admitted but not yet in the engine
        # (a loop slowed by a loaded machine): steps sized by a short estimate outran the
        # engine's answer and overshot the limit x3 on heavy-tailed replies.
        done, self._completed = self._completed, 0
        if dt <= 0:
            return
        weight = min(0.5, dt / (self.turnover_s or 10 * self.options.interval_s))
        rate = done / dt
        self._rate = rate if self._rate is None else self._rate + weight * (rate - self._rate)
        used = float(self.slots.in_use)
        self._in_use = used if self._in_use is None else (
            self._in_use + weight * (used - self._in_use))
        little = self._in_use / self._rate if self._rate else None
        estimates = [e for e in (self._ran_s, little) if e is not None]
        if estimates:
            self.turnover_s = max(estimates)

    def interval(self) -> float:
        """Seconds until the next reading: :data:`READS_PER_TURNOVER` per turnover, at most
        ``interval_s``."""
        if self.turnover_s is None:
            return self.options.interval_s
        return min(self.options.interval_s,
                   max(MIN_INTERVAL_S, self.turnover_s / READS_PER_TURNOVER))

    def update(self, load: Any, now: float) -> None:
        """Apply the rule (module doc) to one reading of the engine's load."""
        dt = 0.0 if self._last_read is None else now - self._last_read
        self._last_read = now
        self._turnover(dt)
        kv = getattr(load, "kv_usage", None)
        cap = getattr(load, "max_running", None)
        if load is None or (kv is None and cap is None):
            self.decision = "fixed"
            return
        if not self.signals:  # the first signal: from now on the limit is within bounds
            self.signals = True
            self._set(self.limit, "the engine's load is known: the limit within "
                      f"[{self.options.min_concurrency}, {self.options.max_concurrency}]")
        self.kv_usage, self.max_running = kv, cap
        self.waiting = int(getattr(load, "waiting", 0) or 0)
        running = self.running = int(getattr(load, "running", 0) or 0)
        total = getattr(load, "preemptions", None)
        preempted = (0 if total is None or self._preemptions is None
                     else max(0, total - self._preemptions))
        if total is not None:
            self._preemptions = total
            self.preemptions += preempted
        turnover = self.turnover_s or 10 * self.options.interval_s
        options = self.options
        # Averages: one reading between two scheduler steps (a sequence just finished, its
        # successor not admitted yet) is not a trend, and one reading after a stall never
        # weighs more than half. The queue over half a turnover (what the limit acts on);
        # the running count, which sets the target, over RUNNING_TURNOVERS: it moves with
        # the mix of long and short sequences in the KV cache, and a target that followed
        # it would carry that noise into the limit (x2: a sample not running is queued).
        # The running count rises as fast as the queue's average (slow start doubles it per
        # turnover: a target that lagged would stop the growth) and falls as slowly.
        if self._avg is None:
            self._avg = (float(self.waiting), float(running))
        else:
            fast = min(0.5, dt / (turnover / 2))
            slow = fast if running > self._avg[1] else min(
                0.5, dt / (RUNNING_TURNOVERS * turnover))
            self._avg = (self._avg[0] + fast * (self.waiting - self._avg[0]),
                         self._avg[1] + slow * (running - self._avg[1]))
        waiting_avg, running_avg = self._avg
        weight = 1.0 if self._in_engine <= 0 else min(0.5, dt / (turnover / 2))
        self._in_engine += weight * (self.waiting + running - self._in_engine)
        target = options.queue_target * max(1.0, running_avg)
        # Full: no room for one more sequence now, or a queue longer than the target (the
        # head of the queue does not fit the KV left: the engine is backed up all the same).
        full = ((kv is not None and kv >= options.kv_high)
                or (cap is not None and running >= cap)
                or waiting_avg > target)
        # The share of a turnover since the last reading, at most half: a late reading (a
        # stalled loop) or a short first estimate of the turnover cannot move the limit by
        # more than half a turnover's worth at once.
        step = min(dt / turnover, 0.5)
        # A reading a whole interval late: the event loop is overloaded (a loaded machine, a
        # stage that blocks it), so admitted samples reach the engine late and its queue
        # runs short for want of CPU, not of samples: growing then only winds the limit up
        # (x2.4 in a minute on a 2-core machine at load 11, unwound slowly after).
        # Lateness is the sleep's overshoot only, not the time the load read takes: a
        # server's /metrics scrape alone took longer than the 0.05 s interval of a test
        # here, and counted as lag it held the limit at its start for the whole batch.
        lagging = self._late_s > self._interval + LAG_S or self._unabsorbed(now, turnover)
        # Preemptions per running sequence per turnover, averaged like the queue: a count
        # per reading depended on how often the load was read, and a few preemptions are
        # the engine's normal way of filling its KV cache (it admits until full, then evicts
        # the youngest as contexts grow); shrinking on them fought the steering (a 10%
        # sawtooth with tool waits) for no throughput: only repeated recompute is thrashing.
        rate = preempted / dt if dt > 0 else 0.0
        self._preempt_rate += min(0.5, dt / (turnover / 2)) * (rate - self._preempt_rate)
        thrash = self._preempt_rate * turnover / max(1.0, running_avg)
        if running == 0 and not preempted:
            self.decision = "hold"  # nothing runs yet: a queue now is requests in transit
            return
        if thrash > options.preempt_high:
            if now - self._last_shrink < turnover / 2:
                self.decision = "hold"
                return
            self._last_shrink = now
            self._pushed_back = True
            self.decision = "shrink"
            self._set(self.limit * SHRINK,
                      f"{thrash:.1f} preemptions per running sequence per turnover")
        elif full or (self._pushed_back and waiting_avg > 0):
            self._pushed_back = True
            gap = target - waiting_avg
            if gap > 0 and lagging:
                self.decision = "hold"  # the samples wait for the CPU, not for a slot
                return
            if (gap > 0 and self.slots.free > 0) or abs(gap) <= DEADBAND * target:
                # Room to spare already (the demand is the limit), or the queue near its
                # target: its own noise is no reason to move.
                self.decision = "hold"
                return
            self.decision = "steer"
            self._set(self.limit + (GAIN if gap > 0 else GAIN_DOWN) * gap * step,
                      f"engine queue {waiting_avg:.0f}, target {target:.0f} "
                      f"({options.queue_target:g} x {running_avg:.0f} running)")
        elif self.slots.free <= 0 and not lagging:
            self.decision = "grow"
            self._set(self.limit * (GROW if self._pushed_back else SLOW_START) ** step,
                      "every slot in use, the engine has room ("
                      + ("" if kv is None else f"KV {kv:.2f}, ")
                      + f"{running}{'' if cap is None else f'/{cap}'} running)")
        else:
            self.decision = "hold"

    def _unabsorbed(self, now: float, turnover: float) -> bool:
        """True while growth is held because the engine did not take what the last growth
        admitted: half a turnover after a probe, with the limit grown by a tenth or more,
        the engine's requests (running and waiting, averaged) must have grown by at least
        :data:`ABSORBED` of that share. A sample admitted goes to the engine at once, or
        after its tool call, so the engine's share of the admitted samples holds as the
        limit grows; samples that the pipeline's own loop cannot get to the engine in time
        (a loop that is the bottleneck: its CPU shared, a stage that computes) never
        arrive, and the limit wound up x12 on them (256 -> 3,038 at 2 ms of CPU a sample,
        the engine a fifth full)."""
        if now < self._held_until:
            return True
        in_engine = self._in_engine
        if self._probe is None or self._probe[2] <= 0:
            self._probe = (now, float(self.slots.size), in_engine)
            return False
        since, size, before = self._probe
        if now - since < turnover / 2:
            return False
        self._probe = None
        grown = self.slots.size / size - 1
        gained = in_engine / before - 1
        if grown >= 0.1 and gained < ABSORBED * grown:
            # As far as this pipeline can feed it, the engine is full: gentle growth from
            # now on, and none for a while.
            self._held_until = now + RUNNING_TURNOVERS * turnover
            self._pushed_back = True
            self.decision = "hold"
            self.last_change = (now, int(size), self.slots.size,
                                f"hold: {grown:.0%} more slots, {gained:+.0%} requests in the "
                                "engine: samples wait for the CPU, not the engine")
            return True
        return False

    def _set(self, limit: float, why: str) -> None:
        self.limit = min(max(limit, self.options.min_concurrency), self.options.max_concurrency)
        size = int(self.limit)
        if size != self.slots.size:
            now = time.monotonic()
            self.last_change = (now, self.slots.size, size, f"{self.decision}: {why}")
            self.slots.resize(size)
            self.history.append((now, size))

    def state(self) -> dict[str, Any]:
        """The controller's state as plain data (progress line, dumps, metrics)."""
        change = None
        if self.last_change is not None:
            at, old, new, why = self.last_change
            change = f"{old}->{new} {time.monotonic() - at:.1f}s ago ({why})"
        return {"limit": self.slots.size, "min": self.options.min_concurrency,
                "max": self.options.max_concurrency, "in_use": self.slots.in_use,
                "decision": self.decision,
                "kv_usage": None if self.kv_usage is None else round(self.kv_usage, 3),
                "engine_running": self.running, "engine_waiting": self.waiting,
                "engine_max_running": self.max_running, "preemptions": self.preemptions,
                "turnover_s": None if self.turnover_s is None else round(self.turnover_s, 3),
                "changes": len(self.history) - 1, "last_change": change}

    def summary(self, since: float) -> dict[str, float]:
        """The limit's mean, min and max since ``since`` (time-weighted), and preemptions."""
        points = [(t, n) for t, n in self.history if t >= since]
        before = [n for t, n in self.history if t < since]
        if before:
            points.insert(0, (since, before[-1]))
        end = time.monotonic()
        spans = [(n, (points[i + 1][0] if i + 1 < len(points) else end) - t)
                 for i, (t, n) in enumerate(points)]
        total = sum(w for _, w in spans)
        mean = (sum(n * w for n, w in spans) / total) if total > 0 else float(self.slots.size)
        values = [n for n, _ in spans] or [self.slots.size]
        return {"limit_mean": mean, "limit_min": float(min(values)),
                "limit_max": float(max(values)), "limit_final": float(self.slots.size),
                "preemptions": float(self.preemptions)}

    async def run(self, engine: object) -> None:
        """Read the engine's load (every :meth:`interval`) and apply the rule, until
        cancelled."""
        while True:
            load = await read_load(engine)
            self.update(load, time.monotonic())
            self._interval = self.interval()
            due = time.monotonic() + self._interval
            await asyncio.sleep(self._interval)
            self._late_s = time.monotonic() - due
