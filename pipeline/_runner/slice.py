"""Time slices of the event loop for samples whose stages never wait.

A stage that does its work without awaiting anything real (a regex judge, a reward function,
a state fill) runs a whole sample in one go; a freed concurrency slot is taken by the next
sample in the same loop iteration, so a 4,000-sample judging batch ran in one iteration and
held the loop for 200 ms, starving timers, heartbeats, the proxy's HTTP handlers and the
watchdog. :func:`run_stage <pipeline._runner.stage.run_stage>` asks :meth:`LoopSlice.spent`
before each stage; once the current iteration has run the samples' own code for longer than
:data:`SLICE_S`, every sample that reaches a stage parks in a FIFO queue instead, so the
iteration ends and the loop's timers run.

The clock counts the samples' own time, not the iteration's: each check notes the time and
the task that made it. A task runs at most one step per iteration, so two checks of the same
task in one iteration have only that sample's own work between them and count in full. Two
checks of different samples may have other callbacks between them (an engine's output
handling, I/O handlers), which are not ours to slice: such a gap counts at most
:data:`FOREIGN_GAP_S`. Counting the whole iteration instead let an in-process vLLM frontend's
output handling (milliseconds every iteration) spend every slice, and the release batch then
shrank to one sample per iteration: 4,096 prompts took 4-10 s to submit instead of about 1.

The first check of an iteration starts its clock and schedules a marker with ``call_soon``,
which runs early in the next iteration. The marker lets parked samples go in a batch that
halves after an iteration whose samples ran past the slice and doubles after one that did not
(so a loop that only waits on I/O lets them all go within a few iterations), and keeps marking
iterations while any are parked. Parked samples cost nothing while they wait: waking every one
of 10,000 to yield again each iteration made a batch five times slower.

Parked samples go in the order their samples were admitted (:meth:`LoopSlice.admit`, when a
sample's stages begin), not the order they parked: a sample further along finishes before a
newer one starts its first stage. In the order they parked, a batch's new samples (a producer
starts them every iteration) queued ahead of the samples whose engine call had returned, so
samples finished only once the whole batch had started: each waited about as long as the
batch took to start (a median of 1.1 s for a 50 ms engine call in a 20,000-sample batch, and
17,583 of the 20,000 timed out at a 1 s deadline; ``benchmarks/scheduling.py``), and every
sample of the batch was held in flight at once. A producer also starts no new samples while
any are parked (:meth:`LoopSlice.when_unsaturated`), and a sample that finds the slice spent
before its first stage parks before its stages begin: its deadline and latency start once it
has its turn, as they start once it has a concurrency slot.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import time
import weakref
from collections.abc import Callable

SLICE_S = 0.005
"""How long one loop iteration may run the samples' own code before samples start parking
(seconds)."""

FOREIGN_GAP_S = 0.001
"""The most a gap between two different samples' checks in one iteration counts (seconds):
it holds the end of one sample's step, the start of the other's and whatever callbacks the
loop ran between them, which are not the samples' own work."""

FIRST_RELEASE = 64
"""Parked samples let go by the first marker after parking started."""


class LoopSlice:
    """The slice clock and parked samples of one event loop (shared by its pipelines). It
    holds no reference to its loop (nor to a task, which would hold the loop), so the loop's
    entry in the registry goes with the loop."""

    __slots__ = ("__weakref__", "_admitted", "_last", "_last_task", "_marked", "_own",
                 "_parked", "_parks", "_release_size", "_starters")

    def __init__(self) -> None:
        self._marked = False
        self._own = 0.0  # the samples' own time this iteration, as counted
        self._last = 0.0  # when the last check of this iteration was made
        self._last_task = 0  # id() of the task that made it; 0: none (the marker)
        self._release_size = FIRST_RELEASE
        self._admitted = itertools.count(1)
        self._parks = itertools.count()  # breaks ties: one sample may park in two stages
        self._parked: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._starters: collections.deque[Callable[[], None]] = collections.deque()

    def admit(self) -> int:
        """The next admission number: a sample's stages are beginning (lower goes first)."""
        return next(self._admitted)

    @property
    def saturated(self) -> bool:
        """Whether samples are parked: the loop runs more samples' code than it has time
        for, so starting new samples now would only add to the queue."""
        return bool(self._parked)

    def when_unsaturated(self, start: Callable[[], None]) -> None:
        """Call ``start`` (with ``call_soon``) once no sample is parked, in the order asked:
        how producers hold new samples back. Each waits here once, instead of checking again
        every iteration (thousands of one-sample producers, as verl's agent loop makes,
        would each add a callback to every iteration of a saturated loop)."""
        if self._parked:
            self._starters.append(start)
        else:
            asyncio.get_running_loop().call_soon(start)

    def spent(self, sample: object = None) -> bool:
        """Whether this loop iteration has run the samples' own code for longer than
        :data:`SLICE_S`. ``sample``: what tells the checking sample from others (the
        runner passes the sample's item, one object per sample, cheaper to get than its
        task; default: the current task)."""
        now = time.monotonic()
        task = id(asyncio.current_task() if sample is None else sample)
        if not self._marked:
            self._mark(now)
        else:
            gap = now - self._last
            self._own += gap if task == self._last_task else min(gap, FOREIGN_GAP_S)
        self._last, self._last_task = now, task
        return self._own > SLICE_S

    async def wait_turn(self, admission: int) -> None:
        """Park until a later iteration lets this sample go (lowest ``admission`` first, see
        :meth:`admit`); a sample cancelled after it was let go passes its turn on."""
        # The future awaited here, not through a helper coroutine with a pass-on callback:
        # that frame and a bound method made per parked sample were two more objects per
        # parked sample for the collector (thousands park at once in a large batch).
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._parked, (admission, next(self._parks), turn))
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release(1)
            raise

    def _mark(self, now: float) -> None:
        self._marked = True
        self._own = 0.0
        self._last, self._last_task = now, 0
        asyncio.get_running_loop().call_soon(self._next_iteration)

    def _next_iteration(self) -> None:
        self._marked = False
        if not self._parked:
            self._release_size = FIRST_RELEASE
            self._let_starters_go()
            return
        now = time.monotonic()
        # The last sample's step after its check, and maybe other callbacks: a foreign gap.
        own = self._own + min(now - self._last, FOREIGN_GAP_S)
        if own > SLICE_S:  # the last iteration's samples ran past their slice
            self._release_size = max(1, self._release_size // 2)
        else:
            self._release_size *= 2
        self._release(self._release_size)
        if self._parked:  # nobody else may check this iteration: keep them moving
            self._mark(now)
        else:
            self._let_starters_go()

    def _let_starters_go(self) -> None:
        # A marker is pending whenever samples are parked (each park follows a spent()
        # check, which marks the iteration, and every marker marks again while any are
        # parked), so the parked queue draining always passes through here.
        starters = self._starters
        if starters:
            loop = asyncio.get_running_loop()
            while starters:
                loop.call_soon(starters.popleft())

    def _release(self, count: int) -> None:
        parked = self._parked
        while count and parked:
            turn = heapq.heappop(parked)[2]
            if not turn.done():
                turn.set_result(None)
                count -= 1


_SLICES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopSlice] = (
    weakref.WeakKeyDictionary())


def loop_slice(loop: asyncio.AbstractEventLoop) -> LoopSlice:
    """The slice clock of ``loop``."""
    found = _SLICES.get(loop)
    if found is None:
        found = _SLICES[loop] = LoopSlice()
    return found
