"""Asynchronous RL through RayRolloutPool (issue 37) on a real local Ray cluster (127.0.0.1,
num_cpus=2), one two-worker pool for the module, each worker running the simulated engine
(capacity mode, named as simulated: per-token versions, a "keep" pause freezes its decoder).

The pool's weight update reaches every worker while their samples are mid-generation (tokens
before it carry the old version, after it the new one, across the process boundary), the
driver's staleness bound holds over the pool, a worker whose update raises fails the call by
name while every engine is resumed, and closing leaves no worker process behind.

Samples that must be caught mid-flight signal through files (the engine's responder writes
one when a request starts decoding; a held sample waits for a flag file), so no step depends
on how fast a loaded machine runs beyond a long generation's margin.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from _waits import until

ray = pytest.importorskip("ray")

from pipeline import (  # noqa: E402
    AgentRolloutItem,
    AsyncRollout,
    BuildPrompt,
    Generate,
    Pipeline,
    SamplingParams,
    SimulatedEngine,
)
from pipeline.distributed import RayRolloutPool, WeightUpdateFailed  # noqa: E402
from pipeline.testing import ByteTokenizer  # noqa: E402

pytestmark = [pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.xdist_group("ray")]  # one Ray cluster at a time (tests/conftest.py)

EOS = ByteTokenizer().eos_token_id


# -- what the workers run (pickled by value: the workers cannot import this module) ------------


def reply(prompt_ids: list[int], rng: Any) -> list[int]:
    """Reply length and a start signal from the prompt's own text (``long <dir>`` / ``short``):
    a long reply writes a file into <dir> when it starts decoding."""
    text = ByteTokenizer().decode(prompt_ids)
    if "long " in text:
        where = text.split("long ", 1)[1].split()[0]
        Path(where, f"{os.getpid()}-{time.monotonic_ns()}").touch()
        return [*([65] * 599), EOS]
    return [*([66] * 19), EOS]


class WeighingEngine(SimulatedEngine):
    """The simulated engine, remembering what the last state dict it got adds up to."""

    weights_sum: int | None = None

    async def update_weights(self, state_dict: Any = None, path: Any = None, *,
                             version: int | None = None) -> int:
        if state_dict is not None:
            self.weights_sum = sum(state_dict["layer.weight"])
        return await super().update_weights(state_dict, path, version=version)


async def record(item: AgentRolloutItem, ctx: Any) -> None:
    """Record the worker's pid and its engine's weights; a row marked ``hold`` waits for its
    flag file (a straggler whose tokens are all sampled and whose group finishes late)."""
    item.artifacts["extra_fields"] = {"pid": os.getpid(),
                                      "weights": ctx.resources.engine.weights_sum}
    flag = item.data.extra.get("hold")
    while flag is not None and not os.path.exists(flag):  # noqa: ASYNC110, ASYNC240
        await asyncio.sleep(0.02)


def make_pipeline() -> Pipeline:
    engine = WeighingEngine(max_running=8, token_time_s=0.003, responder=reply,
                             eos_token_id=EOS)
    return Pipeline([BuildPrompt(), Generate(), record], engine=engine,
                    tokenizer=ByteTokenizer(), sampling=SamplingParams(max_tokens=1000, seed=1),
                    sample_timeout_s=120)


async def fail_on(pid: int, engine: Any) -> int:
    """A ``load`` that raises in the worker whose pid is ``pid`` and updates the others."""
    if os.getpid() == pid:
        raise RuntimeError("checkpoint shard missing")
    return int(await engine.update_weights(version=(engine.policy_version or 0) + 1))


async def load_forever(started: str, engine: Any) -> int:
    """A ``load`` that says it started and never ends (a hung checkpoint read)."""
    Path(started, str(os.getpid())).touch()  # noqa: ASYNC240
    await asyncio.sleep(3600)
    return 99


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(ray_cluster: Any) -> None:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pool(cluster: None) -> AsyncIterator[RayRolloutPool]:
    async with RayRolloutPool(2, make_pipeline) as started:
        yield started


def versions(group: Any) -> list[int]:
    return [v for s in group.samples for v in s.token_versions if v >= 0]


# -- tests ------------------------------------------------------------------------------------


async def test_an_update_mid_generation_versions_each_token_on_every_worker(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    before = pool.policy_version
    rows = [{"prompt": f"long {tmp_path} {i}"} for i in range(4)]
    rollout = AsyncRollout(pool, rows, n=2, batch_groups=2, max_inflight=4, max_staleness=1)
    groups = []
    async with rollout:
        pids = {w.pid for w in pool.workers}
        # every worker has requests decoding (600 tokens, 1.8 s at least): update then
        await until(lambda: {int(p.name.split("-")[0]) for p in tmp_path.iterdir()} == pids, 60,
                    what="both workers decoding")
        await asyncio.sleep(0.2)
        new = await rollout.update_weights(state_dict={"layer.weight": list(range(1000))})
        assert new == before + 1 == pool.policy_version == rollout.version
        assert set(rollout.report.worker_stall_s[0]) == {w.worker_id for w in pool.workers}
        while batch := await rollout.next_batch():
            groups += batch
    report = rollout.report
    assert len(groups) == 4 and report.groups_started == 4 and report.undelivered == 0
    assert report.by_status == {"completed": 8}  # nothing lost
    mixed: set[int] = set()
    for group in groups:
        for sample in group.samples:
            seen = [v for v in sample.token_versions if v >= 0]
            assert len(seen) == 600 and seen == sorted(seen)  # old weights' tokens first
            assert set(seen) <= {before, new}
            if set(seen) == {before, new}:
                mixed.add(sample.extra_fields["pid"])
                assert sample.extra_fields["weights"] == sum(range(1000))  # via the store
    assert mixed == pids  # a partial rollout on each worker, its versions intact


async def test_eta_0_over_the_pool_is_the_synchronous_loop(pool: RayRolloutPool) -> None:
    start = pool.policy_version
    rows = [{"prompt": f"short {i}"} for i in range(6)]
    async with AsyncRollout(pool, rows, n=2, batch_groups=2, max_inflight=6,
                            max_staleness=0) as rollout:
        for step in range(3):
            batch = await rollout.next_batch()
            assert len(batch) == 2
            assert set().union(*map(versions, batch)) == {start + step}
            assert rollout.report.groups_started == 2 * (step + 1)
            await rollout.update_weights()
        assert await rollout.next_batch() == []
    assert rollout.report.delivered == {0: 6} and rollout.report.set_aside == {}


async def test_a_straggler_past_eta_is_set_aside_over_the_pool(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    """Row 0's tokens are sampled under version v; it finishes after two updates: lag 2."""
    flag = tmp_path / "release"
    rows = [{"prompt": f"short {i}", "extra": {"hold": str(flag)} if i == 0 else {}}
            for i in range(6)]
    rollout = AsyncRollout(pool, rows, n=1, batch_groups=1, max_inflight=3, max_staleness=1)
    delivered = []
    async with rollout:
        for _ in range(2):
            delivered += [(rollout.version, g) for g in await rollout.next_batch()]
            await rollout.update_weights()
        flag.touch()
        while batch := await rollout.next_batch():
            delivered += [(rollout.version, g) for g in batch]
            await rollout.update_weights()
    report = rollout.report
    assert all(version - min(versions(g)) <= 1 for version, g in delivered)
    assert report.set_aside == {2: 1}
    assert report.set_aside_groups[0].items[0].data.extra.get("hold")
    assert report.groups_started == 6 == sum(report.delivered.values()) + 1


async def test_closing_the_driver_mid_stream_ends_every_sample(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    rows = [{"prompt": f"long {tmp_path} {i}"} for i in range(6)]
    rollout = AsyncRollout(pool, rows, n=2, batch_groups=2, max_inflight=4)
    async with rollout:
        await until(lambda: len(list(tmp_path.iterdir())) >= 2, 60, what="requests decoding")
    report = rollout.report
    assert report.undelivered == report.groups_started == 4
    assert sum(report.by_status.values()) == 8 and report.by_status.get("aborted", 0) > 0
    assert all(w.load == 0 for w in pool.workers)


async def test_a_worker_whose_update_raises_fails_the_call_by_name_and_none_stays_paused(
        pool: RayRolloutPool) -> None:
    bad = pool.workers[0]
    good = pool.workers[1]
    before = pool.policy_version
    with pytest.raises(WeightUpdateFailed) as err:
        await pool.update_weights(load=functools.partial(fail_on, bad.pid))
    message = str(err.value)
    assert bad.worker_id in message and "checkpoint shard missing" in message
    assert good.worker_id not in err.value.failed and bad.worker_id in err.value.failed
    assert err.value.updated == {good.worker_id: before + 1}
    assert pool.policy_version == before
    # both engines take requests again (a paused one would hold its samples forever)
    result = await asyncio.wait_for(
        pool.run_batch([{"prompt": f"short {i}"} for i in range(8)], n=2), 60)
    assert result.stats.by_status == {"completed": 16}
    assert {s.extra_fields["pid"] for s in result.samples} == {bad.pid, good.pid}
    # one version for all again
    update = await pool.update_weights({"layer.weight": [3, 4]}, version=before + 5)
    assert update.version == pool.policy_version == before + 5
    assert set(update.stall_s) == {bad.worker_id, good.worker_id}


async def test_cancelling_a_pool_update_resumes_every_engine(
        pool: RayRolloutPool, tmp_path: Path) -> None:
    before = pool.policy_version
    update = asyncio.ensure_future(
        pool.update_weights(load=functools.partial(load_forever, str(tmp_path))))
    await until(lambda: len(list(tmp_path.iterdir())) == 2, 60, what="both workers loading")
    update.cancel()
    with pytest.raises(asyncio.CancelledError):
        await update
    assert pool.policy_version == before
    result = await asyncio.wait_for(
        pool.run_batch([{"prompt": f"short {i}"} for i in range(8)], n=2), 60)
    assert result.stats.by_status == {"completed": 16}
    assert {s.policy_version for s in result.samples} == {before}
    assert len({s.extra_fields["pid"] for s in result.samples}) == 2


async def test_a_replacement_worker_gets_the_last_update_before_it_takes_work(
        pool: RayRolloutPool) -> None:
    dead = pool.workers[0]
    assert dead.pid is not None
    os.kill(dead.pid, signal.SIGKILL)
    await until(lambda: pool.workers[0].alive and pool.workers[0].pid != dead.pid, 60,
                what="a replacement worker")
    result = await pool.run_batch([{"prompt": f"short {i}"} for i in range(8)], n=2)
    assert {s.extra_fields["pid"] for s in result.samples} == {w.pid for w in pool.workers}
    assert {s.policy_version for s in result.samples} == {pool.policy_version}
    assert {s.extra_fields["weights"] for s in result.samples} == {7}


async def test_closing_the_pool_leaves_no_worker_running(pool: RayRolloutPool) -> None:
    pids = [w.pid for w in pool.workers]
    await pool.aclose()

    def gone(pid: int | None) -> bool:
        assert pid is not None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    await until(lambda: all(gone(pid) for pid in pids), 30, what="the workers' processes to exit")
    await until(lambda: ray.available_resources().get("CPU", 0)
                >= ray.cluster_resources().get("CPU", 0), 30, what="every CPU freed")
