"""The in-process engine's core watch (``pipeline.engines._vllm_restart.CoreWatch``) on its
own: one restart task shared by every request of a dead core, the restart budget, a failed
restart, the watch finding a dead idle core, cancelled waiters, ``aclose`` during a restart,
the step clock that finds a hung core.
The real vLLM engine core is killed in tests/test_vllm_engine.py; here the core is a flag,
so the orderings that are hard to hit there are exercised in milliseconds."""

from __future__ import annotations

import asyncio

import pytest

from pipeline import ConfigError, EngineError
from pipeline.engines._vllm_restart import CoreWatch, StepClock

pytestmark = pytest.mark.timeout(30)


class Core:
    """A core that dies when told and whose replacement takes ``start_s``."""

    def __init__(self, start_s: float = 0.05, fail: bool = False) -> None:
        self.dead: str | None = None
        self.starts = 0
        self.start_s = start_s
        self.fail = fail

    async def replace(self) -> None:
        await asyncio.sleep(self.start_s)
        if self.fail:
            raise RuntimeError("no memory left for the engine")
        self.starts += 1
        self.dead = None


def watch_of(core: Core, **kwargs: object) -> CoreWatch:
    return CoreWatch("in-process vLLM engine (tiny)", is_dead=lambda: core.dead,
                     replace=core.replace, **kwargs)  # type: ignore[arg-type]


async def test_the_requests_of_one_dead_core_share_one_restart():
    core = Core()
    watch = watch_of(core, interval_s=60)
    core.dead = "EngineCore exited with SIGKILL"
    await asyncio.gather(*(watch.recovered(0, core.dead) for _ in range(8)))
    assert core.starts == 1 and watch.generation == 1 and watch.restarts == 1
    await watch.recovered(0, "late report of the same death")  # already replaced: no restart
    assert core.starts == 1 and len(watch.restart_s) == 1 and watch.restart_s[0] >= 0.05
    await watch.aclose()


async def test_a_death_past_max_restarts_is_final_and_names_the_engine():
    core = Core()
    watch = watch_of(core, max_restarts=1, interval_s=60)
    await watch.recovered(0, "first")
    with pytest.raises(EngineError, match=r"in-process vLLM engine \(tiny\).*died again "
                                          r"\(second\) after 1 restart.*max_restarts=1"):
        await watch.recovered(1, "second")
    with pytest.raises(EngineError, match="max_restarts=1"):
        await watch.ready()  # every later request fails the same way
    assert core.starts == 1


async def test_restart_off_and_a_failed_restart_are_final():
    off = watch_of(Core(), restart=False, interval_s=60)
    with pytest.raises(EngineError, match=r"died \(boom\); restart=False"):
        await off.recovered(0, "boom")
    failing = watch_of(Core(fail=True), interval_s=60)
    with pytest.raises(EngineError, match="could not be restarted: RuntimeError: no memory"):
        await failing.recovered(0, "boom")
    assert failing.failure is not None and failing.restarts == 0


async def test_the_watch_restarts_a_dead_idle_core():
    core = Core()
    watch = watch_of(core, interval_s=0.01)
    watch.start()
    core.dead = "EngineCore exited with SIGKILL"
    for _ in range(300):
        if core.starts:
            break
        await asyncio.sleep(0.01)
    assert core.starts == 1 and watch.generation == 1
    await watch.aclose()


async def test_a_cancelled_waiter_leaves_the_restart_running_and_aclose_waits_for_it():
    core = Core(start_s=0.3)
    watch = watch_of(core, interval_s=60)
    waiter = asyncio.ensure_future(watch.recovered(0, "boom"))
    await asyncio.sleep(0.05)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert core.starts == 0
    await watch.aclose()  # waits through the restart in progress
    assert core.starts == 1
    with pytest.raises(EngineError, match="closed"):
        await watch.recovered(1, "after close")


@pytest.mark.parametrize(("kwargs", "field"), [({"max_restarts": -1}, "max_restarts"),
                                                ({"max_restarts": True}, "max_restarts"),
                                                ({"interval_s": 0}, "health_interval_s")])
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        watch_of(Core(), **kwargs)
    assert info.value.field == field


def test_the_step_clock_counts_only_time_with_work_and_no_step():
    clock = StepClock(stall_s=5.0)
    assert clock.stalled(steps=1, busy=True, now=0.0) is None
    assert clock.stalled(steps=1, busy=True, now=4.0) is None
    assert clock.stalled(steps=2, busy=True, now=9.0) is None  # it stepped: the clock restarts
    assert clock.stalled(steps=2, busy=True, now=13.0) is None
    assert clock.stalled(steps=2, busy=True, now=14.5) == pytest.approx(5.5)
    assert clock.stalled(steps=2, busy=False, now=30.0) is None  # idle: no step is expected
    assert clock.stalled(steps=2, busy=True, now=34.0) is None  # counted from the idle look
    assert StepClock(None).stalled(steps=0, busy=True, now=1e9) is None
    with pytest.raises(ConfigError) as info:
        StepClock(0)
    assert info.value.field == "stall_s"
