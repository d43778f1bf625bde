"""The snapshot API and its renderers, in process: await chains, grouping, samples, threads."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

from pipeline import BuildPrompt, Pipeline
from pipeline.diagnostics import TaskDumper, capture_snapshot, render_json, render_text
from pipeline.diagnostics._snapshot import track_task_ages
from pipeline.testing import ByteTokenizer, SimulatedEngine


def _task(snap, name):
    [info] = [t for t in snap.tasks if t.name == name]
    return info


async def test_await_chain_names_frames_and_what_each_task_waits_on():
    never = asyncio.Event()
    lock = asyncio.Lock()
    await lock.acquire()

    async def ticks() -> AsyncIterator[int]:
        await asyncio.sleep(30)
        yield 1

    async def consume_agen() -> None:
        async for _ in ticks():
            pass

    async def inner_wait() -> None:
        await never.wait()

    async def outer_wait() -> None:
        await inner_wait()

    async def want_lock() -> None:
        async with lock:
            pass

    async def gathered() -> None:
        await asyncio.gather(never.wait(), asyncio.sleep(30))

    waited_on = asyncio.create_task(outer_wait(), name="outer")
    async def await_task() -> None:
        await waited_on

    names = {"agen": consume_agen(), "lock": want_lock(), "gather": gathered(),
             "awaits-task": await_task()}
    tasks = [asyncio.create_task(coro, name=name) for name, coro in names.items()]
    await asyncio.sleep(0.01)
    try:
        snap = capture_snapshot(reason="test")
        outer = _task(snap, "outer")
        assert [f.name.rsplit(".", 1)[-1] for f in outer.chain] == ["outer_wait", "inner_wait",
                                                                      "wait"]
        assert outer.awaiting is not None
        assert outer.awaiting.startswith("Event.wait() on <asyncio.locks.Event")
        assert outer.state == "pending" and outer.sample_uid is None
        # through the async generator's asend object into its frame
        agen = _task(snap, "agen")
        assert [f.name.rsplit(".", 1)[-1] for f in agen.chain][-2:] == ["ticks", "sleep"]
        assert "sleep(delay=30" in (agen.awaiting or "")
        assert "Lock.acquire() on <asyncio.locks.Lock" in (_task(snap, "lock").awaiting or "")
        assert "gather of 2 (2 pending)" in (_task(snap, "gather").awaiting or "")
        assert "task 'outer'" in (_task(snap, "awaits-task").awaiting or "")
        # the test itself is the running task on this loop
        [loop] = [lp for lp in snap.loops if lp.loop_id == id(asyncio.get_running_loop())]
        assert loop.current_task == asyncio.current_task().get_name()
    finally:
        for t in [*tasks, waited_on]:
            t.cancel()
        await asyncio.gather(*tasks, waited_on, return_exceptions=True)
        lock.release()


async def test_ten_thousand_identical_stuck_tasks_render_as_one_group():
    track_task_ages(asyncio.get_running_loop())
    never = asyncio.Event()

    async def stuck() -> None:
        await never.wait()

    tasks = [asyncio.create_task(stuck(), name=f"stuck-{i}") for i in range(10_000)]
    await asyncio.sleep(0)
    try:
        snap = capture_snapshot()
        groups = [g for g in snap.task_groups() if g.names[0].startswith("stuck-")]
        assert len(groups) == 1 and groups[0].count == 10_000
        assert groups[0].age_min_s is not None and groups[0].age_max_s is not None
        text = render_text(snap)
        assert text.count("10000 x pending") == 1
        [line] = [ln for ln in text.splitlines() if ln.startswith("10000 x pending")]
        assert line.endswith(", ... (9995 more)") and line.count("stuck-") == 5
        assert len(text.splitlines()) < 100  # not one line per task
        data = json.loads(render_json(snap))
        [group] = [g for g in data["task_groups"] if g["count"] == 10_000]
        assert len(group["names"]) == 10_000 and group["chain"][-1]["name"] == "Event.wait"
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_snapshot_lists_inflight_samples_with_stage_and_times():
    never = asyncio.Event()

    class Stuck:
        name = "stuck_stage"

        async def run(self, item, ctx) -> None:
            await never.wait()

    pipe = Pipeline([BuildPrompt(offload=False), Stuck()], engine=SimulatedEngine(),
                    tokenizer=ByteTokenizer())
    batch = asyncio.create_task(pipe.run_batch([{"prompt": "a"}, {"prompt": "b"}], n=2))
    for _ in range(200):
        if len(pipe.inflight()) == 4 and all(s.stage == "stuck_stage" for s in pipe.inflight()):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    try:
        snap = capture_snapshot()
        assert len(snap.samples) == 4
        for sample in snap.samples:
            assert sample.stage == "stuck_stage" and sample.task_state == "pending"
            assert sample.in_stage_s is not None and 0.04 < sample.in_stage_s <= sample.running_s
            assert sample.location is not None and sample.location.name.endswith("Stuck.run")
            assert "Event.wait() on" in (sample.awaiting or "")
        assert len({s.group_id for s in snap.samples}) == 2
        text = render_text(snap)
        assert "by stage: stuck_stage=4" in text
        for sample in snap.samples:
            assert f"uid={sample.uid} group={sample.group_id} stage=stuck_stage" in text
        limited = render_text(snap, max_samples=1)
        assert "... 3 more: stuck_stage=3" in limited
    finally:
        batch.cancel()
        await asyncio.gather(batch, return_exceptions=True)
    assert capture_snapshot().samples == ()


def test_snapshot_has_every_threads_stack():
    started = threading.Event()
    release = threading.Event()

    def parked_worker() -> None:
        started.set()
        release.wait(10)

    worker = threading.Thread(target=parked_worker, name="parked")
    worker.start()
    started.wait(5)
    try:
        snap = capture_snapshot()
        [info] = [t for t in snap.threads if t.name == "parked"]
        assert any(f.name.endswith(".parked_worker") for f in info.stack)
        assert any(t.name == "MainThread" for t in snap.threads)
        assert "thread parked ident=" in render_text(snap)
    finally:
        release.set()
        worker.join(5)


async def test_snapshot_from_another_thread_while_the_loop_churns_tasks():
    """Tasks come and go on the loop while a thread snapshots: no errors, no crash."""
    stop = threading.Event()
    results: list[object] = []

    def snapshots() -> None:
        while not stop.is_set():
            results.append(capture_snapshot(loops=[loop]))

    loop = asyncio.get_running_loop()
    thread = threading.Thread(target=snapshots)
    thread.start()
    try:
        # Churn for at least 0.5 s and until the thread has taken 3 snapshots (a capture can
        # take 0.5 s on a loaded machine late in a long test session), within 20 s.
        start = time.monotonic()
        while time.monotonic() - start < 20 and (
                time.monotonic() - start < 0.5 or len(results) < 3):
            batch = [asyncio.create_task(asyncio.sleep(0)) for _ in range(200)]
            await asyncio.gather(*batch)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
    assert len(results) >= 2
    assert all(not snap.errors for snap in results)  # type: ignore[attr-defined]


def test_render_json_round_trips_the_sections():
    snap = capture_snapshot(reason="json")
    data = json.loads(render_json(snap, indent=2))
    assert data["reason"] == "json" and data["pid"] == snap.pid
    assert set(data) >= {"loops", "samples", "task_groups", "threads", "errors", "task_count"}
    assert data["threads"][0]["stack"]


async def test_dump_from_a_thread_writes_the_file(tmp_path):
    with TaskDumper(tmp_path, signum=None, trigger_socket=False) as dumper:
        path = await asyncio.to_thread(dumper.dump, "from a thread")
    assert path.parent == tmp_path and path.name.startswith("tasks-")
    text = path.read_text()
    assert "reason=from a thread" in text
    assert json.loads(path.with_suffix(".json").read_text())["reason"] == "from a thread"
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically
