"""Adaptive concurrency: the controller that sets how many samples one pipeline admits from the
engine's own load (``PipelineConfig.adaptive_concurrency``; :mod:`pipeline._runner.flow`
decides when it runs).

The rule. The *turnover* is how long a sample holds its slot, by Little's law (slots in use
over completions per second, on the loop's clock): the engine feels a new limit only as
samples finish, so every rate is per turnover, and the load is read
:data:`READS_PER_TURNOVER` times per turnover (at most every ``interval_s``). Per reading:

- *steer* the engine's waiting queue (averaged over half a turnover) to ``queue_target`` x
  its running sequences (averaged over :data:`RUNNING_TURNOVERS` once the engine is full):
  the limit moves by the gap per turnover, counted in samples
  (x admitted samples per request in the engine, at most :data:`SPREAD_MAX`: a sample on a
  tool holds no KV and is not in the engine), and holds within :data:`DEADBAND` of it;
- while the engine has *room* (KV below ``kv_high``, running below its cap, no preemption
  for half a turnover) its queue is requests in transit and counts as empty: the gap is
  then the whole target, so the limit doubles per turnover until the engine is full;
- growth is clocked by completions (as TCP's slow start is by acks): one more slot per
  sample completed, so at most x2 per real turnover, and none before the first completion;
- *shrink* by :data:`SHRINK` when the engine thrashes (more than ``preempt_high``
  preemptions per running sequence per turnover), at most once per half turnover (it
  steers in between);
- never lower while more samples hold slots than the limit allows (a lower limit acts only
  as samples finish), and never higher while a slot is free (the demand is below the limit)
  or the pipeline's own loop is the bottleneck (see :meth:`ConcurrencyController._lagging`).

Why it holds still: the limit acts on the queue at once (an admitted sample queues in the
engine within milliseconds), but the queue is read through a half-turnover average, a lag;
an integrator of gain one per turnover behind that lag is damped, as long as the average
spans several readings (one that replaced the average, one reading every 0.1 s for samples
of 0.3 s, made each noisy reading a step: a 31% swing). One reading never weighs more than
half the average, and the deadband keeps the queue's own noise (samples finishing in bursts,
coming back from tools, long sequences filling the KV cache and the running count falling by
a fifth, the queue rising as much) from moving the limit once it has settled: any queue keeps
the engine busy, so half the target either way costs nothing (at 20% the limit followed the
running count of heavy-tailed replies, a 27% swing). Measured on virtual time
(``benchmarks/flow_control.py``, docs/guides/flow-control.md).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import math
import time
from collections.abc import Callable
from typing import Any

import structlog

from pipeline._concurrency.slots import FifoSlots
from pipeline._data.config import AdaptiveConcurrency

_logger = structlog.get_logger("pipeline")

SHRINK = 0.9
"""Factor applied when the engine thrashes (preempts)."""
GAIN = 1.0
"""Share of the gap between the engine's queue and its target closed per turnover, both
ways. (A tenth on the way down, as before, took most of a batch to come down from a start
ten times the engine's size: a swing of 31% over its second half.)"""
SPREAD_MAX = 4.0
"""Growth counts at most this many admitted samples per request in the engine."""
DEADBAND = 0.5
"""The limit holds while the engine's queue is within this share of its target (either
way)."""
RUNNING_TURNOVERS = 4.0
"""A fall of the running count, which sets the queue target, is averaged over this many
turnovers."""
READS_PER_TURNOVER = 8
"""The engine's load is read this often per turnover (at most every ``interval_s``)."""
MIN_INTERVAL_S = 0.01
"""Never read the load more often than this."""
ABSORBED = 0.5
"""Growth holds for :data:`HOLD_TURNOVERS` turnovers when the engine's requests grew by less
than this share of the limit's growth over the last turnover (both relative)."""
HOLD_TURNOVERS = 2.0
"""Growth the engine did not take holds growth for this many turnovers."""
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
        self._completed = 0
        self._done = 0
        self._acked = 0  # completions growth has not spent yet
        self._watched_s = 0.0
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
        self._last_preempted = -math.inf  # when the engine last preempted (loop clock)
        self._avg: tuple[float, float] | None = None
        # The clock of the loop the controller runs on (the default loop's is
        # time.monotonic; a virtual-time loop's advances only with its timers, so that a
        # simulated benchmark measures the engine model and the rule, not the host's CPU).
        self.clock: Callable[[], float] = time.monotonic
        self.history: collections.deque[tuple[float, int]] = collections.deque(
            [(self.clock(), slots.size)], maxlen=HISTORY)

    def sample_done(self) -> None:
        """A sample completed and gave its slot back (counted for the turnover)."""
        self._completed += 1
        self._done += 1

    def _turnover(self, dt: float) -> None:
        # How long a sample holds a slot, by Little's law: slots in use over completions per
        # second, both averaged over about a turnover, on the controller's own clock. It
        # counts the time a sample spends admitted but not yet in the engine and out on its
        # tools; the completed samples' mean (the earlier second estimate) counts only the
        # short ones early in a batch, and was read off the wall clock.
        done, self._completed = self._completed, 0
        self._acked = min(self._acked + done, max(1, self.slots.size))  # a limit's worth
        if dt <= 0:
            return
        # Averaged over a turnover, or over all the time watched while that is shorter: a
        # first estimate made of the first few completions (far too long with many samples
        # admitted at once: 133 s for 1.4 s ones) would otherwise slow its own correction.
        self._watched_s += dt
        window = min(self.turnover_s or math.inf, self._watched_s)
        weight = min(0.5, dt / window) if self._rate else 1.0
        rate = done / dt
        self._rate = rate if self._rate is None else self._rate + weight * (rate - self._rate)
        used = float(self.slots.in_use)
        self._in_use = used if self._in_use is None else (
            self._in_use + weight * (used - self._in_use))
        little = self._in_use / self._rate if self._rate else None
        if little is not None:
            self.turnover_s = little

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
        if self._avg is None:
            self._avg = (float(self.waiting), float(running))
        else:
            fast = min(0.5, dt / (turnover / 2))
            # The running count rises at the queue's pace while the engine fills or the
            # batch settles (until a limit's worth of samples completed: a start from
            # nothing read 1-10 running for seconds and shrank the limit as if 25 sequences
            # thrashed), over RUNNING_TURNOVERS once it is full.
            settling = self._filling(load) or self._done < self.slots.in_use
            slow = fast if running > self._avg[1] and settling else min(
                0.5, dt / (RUNNING_TURNOVERS * turnover))
            self._avg = (self._avg[0] + fast * (self.waiting - self._avg[0]),
                         self._avg[1] + slow * (running - self._avg[1]))
        waiting_avg, running_avg = self._avg
        weight = 1.0 if self._in_engine <= 0 else min(0.5, dt / (turnover / 2))
        self._in_engine += weight * (self.waiting + running - self._in_engine)
        target = options.queue_target * max(1.0, running_avg)
        # Room: one more sequence fits now. A queue then is requests in transit (admitted
        # at the engine's next step, or after its prefill budget), not a full engine: at a
        # batch's start it read as "full" and ended the growth after one reading.
        # Not within half a turnover of a preemption either: a preempted sequence frees its
        # KV and goes back to the queue, so the next reading shows KV below kv_high and a
        # queue, which read as room grew the limit into the preemptions (on an H200, a 1 GiB
        # cache holding ~210 requests: 1,168 admitted, twice fixed 256's preemptions).
        if preempted:
            self._last_preempted = now
        room = self._filling(load) and now - self._last_preempted >= turnover / 2
        # With room, the gap is what runs now (the slow average would slow the climb);
        # once full, the target is the slow average: the running count moves by half as
        # long sequences come and go, and a target that rose with it at once swung the
        # limit 27% on heavy-tailed replies.
        gap = (options.queue_target * max(1.0, running, running_avg) if room
               else target - waiting_avg)
        # The share of a turnover since the last reading, at most half: a late reading (a
        # stalled loop) or a short first estimate of the turnover cannot move the limit by
        # more than half a turnover's worth at once.
        step = min(dt / turnover, 0.5)
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
        elif (thrash > options.preempt_high or gap < 0) and self.slots.in_use > self.slots.size:
            # A lower limit takes effect only as samples finish (none is evicted): while
            # more are admitted than it allows, the queue has not felt it yet, and lowering
            # it further took it from 1,024 to 129 against a queue that had not moved.
            self.decision = "hold"
        elif thrash > options.preempt_high and now - self._last_shrink >= turnover / 2:
            # (Between two shrinks the queue steers as usual: holding then, while a queue
            # of 900 thrashed, left a start of 1,024 coming down x0.9 per half turnover.)
            self._last_shrink = now
            self.decision = "shrink"
            self._set(self.limit * SHRINK,
                      f"{thrash:.1f} preemptions per running sequence per turnover")
        elif abs(gap) <= DEADBAND * target:
            self.decision = "hold"  # the queue near its target: its own noise moves nothing
        elif gap > 0 and (self.slots.free > 0 or self._lagging(now, turnover)):
            self.decision = "hold"  # the demand is below the limit, or the loop is busy
        else:
            # In samples: each admitted sample is in the engine only part of its time (the
            # rest on its tools), so moving the engine's queue by ``gap`` takes ``gap``
            # times admitted samples per engine request (at most SPREAD_MAX).
            spread = min(SPREAD_MAX, max(1.0, self.slots.in_use / max(1.0, self._in_engine)))
            change = GAIN * gap * spread * step
            if change > 0:
                # Growth is clocked by completions, as TCP's slow start is by acks: one more
                # slot per sample completed since growth last spent them, so at most x2 per
                # real turnover even before the turnover is known. Before the first
                # completion its estimate was a default second: on an H200 (samples of
                # ~5 s) the limit doubled each second, from 64 past 1,000, before the KV
                # cache (which holds prompts only at admission) showed it full.
                change = min(change, float(self._acked))
                self._acked = max(0, self._acked - math.ceil(change))
            self.decision = "grow" if gap > 0 else "steer"
            self._set(self.limit + change,
                      f"engine queue {0 if room else waiting_avg:.0f}, target {target:.0f} "
                      f"({options.queue_target:g} x {running_avg:.0f} running"
                      + ("" if kv is None else f", KV {kv:.2f}") + ")")

    def _filling(self, load: Any) -> bool:
        """Whether the engine has room for one more sequence now (KV below ``kv_high``,
        running below its cap)."""
        kv, cap = getattr(load, "kv_usage", None), getattr(load, "max_running", None)
        return ((kv is None or kv < self.options.kv_high)
                and (cap is None or int(getattr(load, "running", 0) or 0) < cap))

    def _lagging(self, now: float, turnover: float) -> bool:
        """No growth while the pipeline's own loop is the bottleneck: admitted samples then
        reach the engine late and its queue runs short for want of CPU, not of samples, and
        growing only winds the limit up (x2.4 in a minute on a 2-core machine at load 11).
        Two signs: a reading a whole interval late (the sleep's overshoot only, not the time
        the load read takes: a server's /metrics scrape alone outlasted a 0.05 s interval),
        or growth the engine did not take (:meth:`_unabsorbed`)."""
        return self._late_s > self._interval + LAG_S or self._unabsorbed(now, turnover)

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
        in_engine = float(self.running + self.waiting)
        if self._done < self.slots.in_use:
            # Until a limit's worth of samples has completed, the mix of samples in the
            # engine and on their tools is still settling (at the start every sample is in
            # its first turn): a falling share is no sign of a busy loop then.
            return False
        if self._probe is None or self._probe[2] <= 0:
            self._probe = (now, float(self.slots.size), in_engine)
            return False
        since, size, before = self._probe
        if now - since < turnover:
            return False
        self._probe = None
        grown = self.slots.size / size - 1
        gained = in_engine / before - 1
        if grown >= 0.1 and gained < ABSORBED * grown:
            # As far as this pipeline can feed it, the engine is full: no growth for a
            # while.
            self._held_until = now + HOLD_TURNOVERS * turnover
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
            now = self.clock()
            self.last_change = (now, self.slots.size, size, f"{self.decision}: {why}")
            self.slots.resize(size)
            self.history.append((now, size))

    def state(self) -> dict[str, Any]:
        """The controller's state as plain data (progress line, dumps, metrics)."""
        change = None
        if self.last_change is not None:
            at, old, new, why = self.last_change
            change = f"{old}->{new} {self.clock() - at:.1f}s ago ({why})"
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
        end = self.clock()
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
        self.clock = asyncio.get_running_loop().time
        if len(self.history) == 1:  # no change yet: its start on the loop's clock
            self.history[0] = (self.clock(), self.history[0][1])
        while True:
            load = await read_load(engine)
            self.update(load, self.clock())
            self._interval = self.interval()
            due = self.clock() + self._interval
            await asyncio.sleep(self._interval)
            self._late_s = self.clock() - due
