"""Samples whose stages never wait do not hold the event loop for a whole batch: the runner
yields once a loop iteration has run stages for longer than ``SLICE_S``."""

from __future__ import annotations

import asyncio
import time

from pipeline import Pipeline, Status
from pipeline._runner.slice import SLICE_S, LoopSlice, loop_slice
from pipeline.testing import ByteTokenizer

pytest_plugins = ["_model_fixtures"]


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def score(item, ctx) -> None:  # never awaits: a synchronous reward function
    busy(0.0001)
    item.artifacts["reward"] = 1.0


async def test_a_timer_runs_while_a_batch_of_non_waiting_stages_is_running():
    samples = 2000  # at least 0.2 s of stage work, 40 slices
    pipe = Pipeline([score, score], tokenizer=ByteTokenizer(), max_concurrency=256)
    done_when_timer_ran: list[int] = []
    loop = asyncio.get_running_loop()
    loop.call_later(0.001, lambda: done_when_timer_ran.append(pipe.samples_done))
    result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(samples)])
    assert result.stats.by_status == {"completed": samples}
    assert all(s.status is Status.COMPLETED and s.reward == 1.0 for s in result.samples)
    # Without slices the whole batch ran in one loop iteration and the timer came last.
    assert done_when_timer_ran and done_when_timer_ran[0] < samples // 2


async def test_the_slice_clock_restarts_each_loop_iteration():
    clock = loop_slice(asyncio.get_running_loop())
    assert clock is loop_slice(asyncio.get_running_loop())  # one clock per loop
    await asyncio.sleep(0)  # a fresh iteration
    assert not clock.spent()  # the first check of an iteration starts the clock
    busy(SLICE_S * 1.5)
    assert clock.spent()
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the marker ran: a new iteration, a new clock
    assert not clock.spent()


async def test_other_callbacks_hogging_each_iteration_do_not_spend_the_samples_slice():
    """An engine's output handling (an in-process vLLM frontend) runs milliseconds of its own
    work in every loop iteration; the slice counts the samples' own time, so parked samples
    still go in growing batches instead of one an iteration."""
    stop = asyncio.Event()
    iterations = 0

    async def output_handler() -> None:  # SIMULATED: 6 ms of foreign work per iteration
        nonlocal iterations
        while not stop.is_set() and iterations < 5000:
            iterations += 1
            busy(0.006)
            await asyncio.sleep(0)

    samples = 400
    handler = asyncio.create_task(output_handler())
    try:
        pipe = Pipeline([score, score], tokenizer=ByteTokenizer(), max_concurrency=samples)
        result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(samples)])
    finally:
        stop.set()
        await handler
    assert result.stats.by_status == {"completed": samples}
    # 400 samples of 0.2 ms are 80 ms of own work: a few dozen iterations at most. Counting
    # the handler's time as theirs let one sample go per iteration (one per 6 ms).
    assert iterations < samples // 4


async def test_samples_that_time_out_while_parked_end_as_timeouts_and_leave_nothing_parked():
    async def slow_score(item, ctx) -> None:  # 2 ms of CPU, never awaits
        busy(0.002)
        item.artifacts["reward"] = 1.0

    pipe = Pipeline([slow_score, slow_score], tokenizer=ByteTokenizer(), max_concurrency=64,
                    sample_timeout_s=0.05)
    result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(200)])
    statuses = {s.status for s in result.samples}
    assert statuses <= {Status.COMPLETED, Status.TIMEOUT}
    assert Status.TIMEOUT in statuses  # 0.8 s of work cannot fit 0.05 s deadlines
    for sample in result.samples:
        if sample.status is Status.TIMEOUT:
            assert sample.masked and "timed out" in sample.error
    clock = loop_slice(asyncio.get_running_loop())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not clock._parked  # cancelled turns were dropped, granted ones passed on


async def test_parked_samples_go_in_admission_order_not_parking_order():
    clock = LoopSlice()
    released: list[int] = []

    async def sample(admission: int) -> None:
        clock.spent()  # as the runner checks (the first check marks the iteration)
        await clock.wait_turn(admission)
        released.append(admission)

    tasks = [asyncio.create_task(sample(a)) for a in (7, 2, 9, 1, 5)]
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    # The oldest admitted goes first (a sample further along before a newly started one).
    assert released == [1, 2, 5, 7, 9]
    assert not clock.saturated


async def test_a_big_batch_finishes_samples_while_it_is_still_starting_others():
    """The engine calls of a big batch's first samples return while later samples are still
    being started; those samples finish then, and the batch starts no more samples while the
    loop has more to run than its slice: samples in flight stay far below the batch. Before,
    the new samples queued ahead of the returning ones and every sample of the batch was in
    flight (its deadline running) before the first finished."""
    samples = 3000

    async def build(item, ctx) -> None:  # CPU work of a prompt build, never awaits
        busy(0.0001)

    async def engine_call(item, ctx) -> None:  # SIMULATED: a 10 ms engine call
        await asyncio.sleep(0.01)

    pipe = Pipeline([build, engine_call, score], tokenizer=ByteTokenizer(),
                    max_concurrency=samples, sample_timeout_s=600)
    result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(samples)])
    assert result.stats.by_status == {"completed": samples}
    starts = sorted(item.started_at for item in result.items)
    ends = sorted(item.ended_at for item in result.items)
    assert ends[0] < starts[-1]  # the first sample finished before the last one started
    # Most samples in flight at once: the starts up to each end, minus the ends before it.
    events = sorted([(t, 1) for t in starts] + [(t, -1) for t in ends])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak < samples // 2


async def test_a_sample_waiting_for_the_loop_before_its_first_stage_is_not_started_yet():
    """A sample that finds the loop saturated before its first stage waits for its turn
    before its stages begin: its deadline and latency start then, as they start once it has
    a concurrency slot. Each sample here needs 2 ms; the batch needs 1 s. Before, a chunk's
    samples waited for their turn with their deadlines running, and about half timed out."""
    async def hog(item, ctx) -> None:  # 2 ms of CPU, never awaits
        busy(0.002)
        item.artifacts["reward"] = 1.0

    samples = 500
    pipe = Pipeline([hog], tokenizer=ByteTokenizer(), max_concurrency=samples,
                    sample_timeout_s=0.15)
    result = await pipe.run_batch([{"prompt": f"q{i}"} for i in range(samples)])
    assert result.stats.by_status == {"completed": samples}


async def test_producers_held_back_by_a_saturated_loop_wait_once_each(monkeypatch):
    """verl's agent loop runs thousands of one-sample batches at once: while the loop is
    saturated, each of their producers waits for it once, instead of asking again in every
    loop iteration."""
    from pipeline._runner.producer import Producer

    calls = 0
    start_chunk = Producer._start_chunk

    def counted(self: Producer) -> None:
        nonlocal calls
        calls += 1
        start_chunk(self)

    monkeypatch.setattr(Producer, "_start_chunk", counted)

    async def hog(item, ctx) -> None:  # 2 ms of CPU, never awaits
        busy(0.002)

    pipe = Pipeline([hog, hog], tokenizer=ByteTokenizer(), max_concurrency=300)
    saturating = asyncio.create_task(pipe.run_batch([{"prompt": f"q{i}"} for i in range(300)]))
    clock = loop_slice(asyncio.get_running_loop())
    for _ in range(1000):  # bounded: until its samples park
        await asyncio.sleep(0)
        if clock.saturated:
            break
    assert clock.saturated
    one_sample_batches = 100
    results = await asyncio.gather(
        *(pipe.run_batch([{"prompt": f"one {i}"}]) for i in range(one_sample_batches)),
        saturating)
    assert all(r.stats.by_status == {"completed": len(r.samples)} for r in results)
    # Each one-sample producer: its first try, then once more when the loop had room (the
    # saturating batch's own producer asks once per chunk or wait). Asking every iteration
    # made it hundreds per producer.
    assert calls <= 3 * one_sample_batches + 20
    assert not clock._starters


def test_per_loop_state_goes_with_its_loop(tiny_tokenizer):
    import gc

    import pipeline._runner.slice as slices
    import pipeline._text.encode as encode
    from pipeline import BuildPrompt

    gc.collect()
    before = len(slices._SLICES), len(encode._ENCODERS)  # loops other tests still hold
    pipe = Pipeline([BuildPrompt(), score], tokenizer=tiny_tokenizer)
    for _ in range(5):  # each asyncio.run makes and closes a loop
        asyncio.run(pipe.run_batch([{"prompt": "hello"}], n=2))
    gc.collect()
    assert len(slices._SLICES) <= before[0] and len(encode._ENCODERS) <= before[1]
    assert len(pipe._loops) == 0  # its slots and deadline windows per loop
