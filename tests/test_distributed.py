"""RayRolloutPool on a real local Ray cluster (127.0.0.1, num_cpus=2), one cluster and one
two-worker pool for the module: order and counts against a one-process run, groups kept on one
worker, streaming, a worker SIGKILLed mid-batch, a sample that kills every worker it runs on,
over-sampling across workers, one dump gathered from both workers while one loop is blocked,
and a tool's rate held for the whole fleet.

Samples that must be caught mid-flight wait for a flag file the test creates, so no step
depends on how fast a loaded machine runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from _waits import until

ray = pytest.importorskip("ray")

from pipeline import (  # noqa: E402
    AgentRolloutItem,
    BuildPrompt,
    Generate,
    Pipeline,
    SimulatedEngine,
    Status,
)
from pipeline.diagnostics import install_task_dumper  # noqa: E402
from pipeline.distributed import RayRolloutPool  # noqa: E402
from pipeline.testing import ByteTokenizer  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (tests/conftest.py)


# -- what the workers run (pickled by value: the workers cannot import this module) ------------


def make_pipeline() -> Pipeline:
    return Pipeline([BuildPrompt(), Generate(), where_and_wait],
                    engine=SimulatedEngine(latency_s=0.002), tokenizer=ByteTokenizer(),
                    sampling={"max_tokens": 8}, sample_timeout_s=120)


async def where_and_wait(item: AgentRolloutItem, ctx: Any) -> None:
    """Record the worker's pid; on request, say it started and wait for a flag file
    (blocking the loop with time.sleep when asked to), or kill its own process."""
    extra = item.data.extra
    item.artifacts["extra_fields"] = {"pid": os.getpid()}
    if extra.get("kill_worker"):
        os.kill(os.getpid(), signal.SIGKILL)
    flag = extra.get("wait_for")
    if flag is None:
        return
    Path(extra["started_dir"], f"{item.uid}@{os.getpid()}").touch()  # noqa: ASYNC240
    while not os.path.exists(flag):  # noqa: ASYNC240
        if extra.get("block_loop"):
            time.sleep(0.05)  # noqa: ASYNC251 - blocks the worker's event loop on purpose
        else:
            await asyncio.sleep(0.05)
    limit = extra.get("rate_limit")
    if limit:
        bucket = ctx.resources.limiters.get("fleet-api", rate=limit, capacity=1)
        for _ in range(extra["calls"]):
            await bucket.acquire(key=item.group_id)
            item.artifacts["extra_fields"].setdefault("grants", []).append(time.time())


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> None:
    """The session's Ray cluster (tests/conftest.py), with this module pickled by value."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(cluster: None) -> AsyncIterator[RayRolloutPool]:
    async with RayRolloutPool(2, make_pipeline, replace_timeout_s=90) as started:
        yield started


def waiting_rows(tmp: Path, count: int, **extra: Any) -> list[dict[str, Any]]:
    (tmp / "started").mkdir(exist_ok=True)
    return [{"prompt": f"question {i}", "extra": {"wait_for": str(tmp / "go"),
                                                 "started_dir": str(tmp / "started"), **extra}}
            for i in range(count)]


def started(tmp: Path) -> int:
    return len(list((tmp / "started").iterdir()))


# -- tests ------------------------------------------------------------------------------------


async def test_import_pipeline_does_not_import_ray() -> None:
    code = "import sys, pipeline, pipeline.cli; assert 'ray' not in sys.modules, 'ray imported'"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    assert await proc.wait() == 0


async def test_same_samples_as_one_process_in_input_order_groups_on_one_worker(
        pool: RayRolloutPool) -> None:
    local = make_pipeline()
    items = local.make_items([{"prompt": f"what is {i} + {i}?"} for i in range(12)], n=4)
    fleet = await pool.run_batch([item.model_copy(deep=True) for item in items])
    alone = await local.run_batch([item.model_copy(deep=True) for item in items])
    assert [s.uid for s in fleet.samples] == [i.uid for i in items]  # input order
    assert [i.uid for i in fleet.items] == [i.uid for i in items]
    assert fleet.stats.by_status == {"completed": 48}
    for a, b in zip(fleet.samples, alone.samples, strict=True):  # seeded: the same tokens
        assert (a.prompt_ids, a.response_ids, a.logprobs) == (b.prompt_ids, b.response_ids,
                                                             b.logprobs)
    pids: dict[str, set[int]] = {}
    for sample in fleet.samples:
        pids.setdefault(sample.group_id, set()).add(sample.extra_fields["pid"])
    assert all(len(p) == 1 for p in pids.values())  # a group stays on one worker
    worker_pids = {w.pid for w in pool.workers}
    assert set().union(*pids.values()) == worker_pids and len(worker_pids) == 2


def misses_a_provider() -> Pipeline:
    return Pipeline([Generate()], engine=SimulatedEngine(latency_s=0.002),
                    tokenizer=ByteTokenizer())


async def test_a_factory_whose_stage_list_misses_a_provider_fails_the_start(
        cluster: None) -> None:
    """Issue 35 item 2: the worker's Pipeline is refused when it is built, and the error that
    reaches the driver names the artifact, the stage that needs it and its provider."""
    pool = RayRolloutPool(1, misses_a_provider)
    try:
        with pytest.raises(Exception, match=r"stage 'generate' needs the artifact "
                                            r"'prompt_ids'.*BuildPrompt"):
            await pool.start()
    finally:
        await pool.aclose()


async def test_stream_hands_over_samples_while_others_still_run(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    fast = [{"prompt": f"fast {i}"} for i in range(6)]
    slow = waiting_rows(tmp_path, 2)
    got: list[str] = []
    async with pool.stream(fast + slow, n=2) as samples:
        async for sample, item in samples:
            got.append(item.data.messages[0]["content"])
            if len(got) == 12:  # every fast sample arrived while the slow ones wait
                assert all(text.startswith("fast") for text in got)
                assert started(tmp_path) == 4
                (tmp_path / "go").touch()
            assert sample.status is Status.COMPLETED
    assert len(got) == 16
    groups = []
    (tmp_path / "go").unlink()
    async with pool.stream_groups(waiting_rows(tmp_path, 1) + fast[:3], n=3) as stream:
        async for group in stream:
            groups.append(group)
            if len(groups) == 3:
                (tmp_path / "go").touch()
    assert [len(g.samples) for g in groups] == [3, 3, 3, 3]
    assert groups[-1].items[0].data.messages[0]["content"] == "question 0"
    assert [s.uid for s in groups[0].samples] == sorted(s.uid for s in groups[0].samples)


async def test_the_driver_keeps_no_item_or_sample_it_handed_over(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    # A stream over the fleet may run for a long time (or for an AsyncRollout's whole life):
    # the driver keeps an item only until its sample is back (a lost worker's are run again
    # from it) and nothing it yielded, or memory and the collector's walk grow with every
    # sample ever produced. The slow group waits on the flag, so the stream is still running.
    local = make_pipeline()
    rows = [{"prompt": f"fast {i}"} for i in range(4)] + waiting_rows(tmp_path, 1)
    items = local.make_items(rows, n=2)
    sent = [weakref.ref(item) for item in items]
    stream = pool.stream(items)
    del items
    taken: list[tuple[weakref.ref[object], weakref.ref[object]]] = []
    async with stream as samples:
        async for sample, item in samples:
            taken.append((weakref.ref(sample), weakref.ref(item)))
            del sample, item
            if len(taken) == 8:  # every fast sample is back; the slow pair still runs
                assert [i for i, pair in enumerate(taken)
                        if any(ref() is not None for ref in pair)] == []
                assert [i for i, ref in enumerate(sent) if ref() is not None] == [8, 9]
                (tmp_path / "go").touch()
    assert len(taken) == 10
    (tmp_path / "go").unlink()
    items = local.make_items(rows[:2] + rows[4:], n=2)
    sent = [weakref.ref(item) for item in items]
    groups = pool.stream_groups(items)
    del items
    got: list[weakref.ref[object]] = []
    async with groups as stream_of_groups:
        async for group in stream_of_groups:
            got.extend(weakref.ref(x) for x in (*group.samples, *group.items))
            del group
            if len(got) == 8:  # both fast groups are back; the slow one still runs
                assert [i for i, ref in enumerate(got) if ref() is not None] == []
                assert [i for i, ref in enumerate(sent) if ref() is not None] == [4, 5]
                (tmp_path / "go").touch()
    assert len(got) == 12


async def test_over_sampling_aborts_the_rest_on_every_worker(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    rows = [{"prompt": "quick"}, *waiting_rows(tmp_path, 3)]
    result = await pool.run_batch(rows, n=4, num_needed=4)
    assert result.stats.by_status == {"completed": 4, "aborted": 12}
    assert [s.status for s in result.samples[:4]] == [Status.COMPLETED] * 4
    assert all("enough" in (s.error or "") for s in result.samples[4:])


async def test_worker_sigkilled_mid_batch_loses_nothing(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    rows = waiting_rows(tmp_path, 6)
    batch = asyncio.create_task(pool.run_batch(rows, n=2))
    await until(lambda: started(tmp_path) == 12, 60, what="every sample to start")
    victim = pool.workers[0]
    os.kill(victim.pid, signal.SIGKILL)
    await until(lambda: not pool.workers[0].alive, 60, what="the pool to see the death")
    (tmp_path / "go").touch()
    result = await asyncio.wait_for(batch, 120)
    assert result.stats.by_status == {"completed": 12}
    assert victim.pid not in {s.extra_fields["pid"] for s in result.samples}
    assert started(tmp_path) > 12  # the lost samples really ran again
    await until(lambda: pool.workers[0].alive, 90, what="the replacement")
    assert pool.workers[0].worker_id == "worker-0.1" and pool.workers[0].pid != victim.pid
    again = await pool.run_batch([{"prompt": "after"}], n=4)
    assert again.stats.by_status == {"completed": 4}


async def test_a_sample_that_kills_its_worker_is_retried_once_then_failed(
        pool: RayRolloutPool) -> None:
    before = pool.replacements
    result = await pool.run_batch([{"prompt": "poison", "extra": {"kill_worker": True}}], n=2)
    assert result.stats.by_status == {"failed": 2}
    for sample in result.samples:
        assert sample.masked and "lost with worker worker-" in (sample.error or "")
        assert "workers tried: worker-" in (sample.error or "")
    await until(lambda: all(w.alive for w in pool.workers), 120, what="both replacements")
    assert pool.replacements == before + 2


async def test_one_dump_names_both_workers_while_one_loop_is_blocked(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    await until(lambda: all(w.alive for w in pool.workers), 120, what="live workers")
    rows = (waiting_rows(tmp_path, 1, block_loop=True) + waiting_rows(tmp_path, 1))
    rows[1]["prompt"] = "question 1"
    batch = asyncio.create_task(pool.run_batch(rows, n=1))
    await until(lambda: started(tmp_path) == 2, 60, what="both samples to start")
    await asyncio.sleep(1.5)  # the blocked loop's heartbeat goes unanswered meanwhile
    dumper = install_task_dumper(directory=tmp_path / "dumps")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pipeline.cli", "dump", str(os.getpid()), "--dir",
            str(tmp_path / "dumps"), "--timeout", "60",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
    finally:
        dumper.close()
        (tmp_path / "go").touch()
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert f"rollout task dump: pid={os.getpid()}" in text  # the driver itself
    sections = text.split("== ray workers ==")[1]
    for worker in pool.workers:
        assert f"--- {worker.worker_id} (pid {worker.pid}) ---" in sections
    assert sections.count("== samples in flight: 1 ==") == 2
    assert sections.count("stage=where_and_wait") == 2
    assert "heartbeat_unanswered_s=" in sections  # the blocked loop, seen from outside
    assert "time.sleep" in sections or "in where_and_wait" in sections
    result = await asyncio.wait_for(batch, 60)
    assert result.stats.by_status == {"completed": 2}


async def test_a_tools_rate_holds_for_the_whole_fleet(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    await until(lambda: all(w.alive for w in pool.workers), 120, what="live workers")
    rate, calls = 20.0, 6
    (tmp_path / "go").touch()
    rows = waiting_rows(tmp_path, 4, rate_limit=rate, calls=calls)
    start = time.time()
    result = await pool.run_batch(rows, n=2)
    assert result.stats.by_status == {"completed": 8}
    assert {s.extra_fields["pid"] for s in result.samples} == {w.pid for w in pool.workers}
    grants = sorted(t for s in result.samples for t in s.extra_fields["grants"])
    assert len(grants) == 8 * calls
    # Counted from before the bucket existed: never more than capacity + rate * elapsed,
    # fleet-wide (one bucket per worker would have allowed twice the rate).
    for n, t in enumerate(grants, 1):
        assert n <= 1 + rate * (t - start) + 1e-6, (n, t - start)
    stats = (await pool.limiter_stats())["fleet-api"]
    assert stats.tokens == 8 * calls and stats.leaked == 0
    assert len(stats.keys) == 4  # fair across the prompts' groups, fleet-wide
