"""GymEnvironment's failure semantics on the simulated engine: a step that raises or hangs
fails its sample with a readable error, the sample deadline ends a hung step, close runs once
on every outcome, a close that raises is recorded and never the outcome; gymnasium-style tuples
and async environments work like skyrl-gym's dicts."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import pytest

from pipeline import ConfigError, Pipeline, SimulatedEngine, Status, artifacts
from pipeline.stages import GymEnvironment
from pipeline.testing import ByteTokenizer

ROWS = [{"prompt": "count to three"}]


class Counter:
    """A three-step environment: reward 1 per step, done at the third; records closes."""

    closed: ClassVar[list[int]] = []
    release: ClassVar[threading.Event] = threading.Event()
    unblocked: ClassVar[list[bool]] = []

    def __init__(self, behaviour: str = "ok") -> None:
        self.behaviour, self.steps = behaviour, 0

    def init(self, prompt):
        return prompt, {}

    def step(self, action: str):
        self.steps += 1
        if self.behaviour == "raises" and self.steps == 2:
            raise KeyError("board state lost")
        if self.behaviour == "hangs" and self.steps == 2:
            # A plain method blocking its worker thread until the test lets it go.
            Counter.unblocked.append(Counter.release.wait(30))
        return {"observations": [{"role": "user", "content": f"step {self.steps} seen"}],
                "reward": 1.0, "done": self.steps >= 3, "metadata": {"steps": self.steps}}

    def close(self):
        Counter.closed.append(self.steps)
        if self.behaviour == "close_raises":
            raise OSError("could not delete the container")


class AsyncGymnasium:
    """gymnasium's shapes: ``reset() -> (obs, info)``, 5-tuple steps; async methods."""

    def __init__(self) -> None:
        self.closed = False

    async def reset(self):
        return "Say anything.", {}

    async def step(self, action):
        await asyncio.sleep(0)
        return "again", 0.25, False, True, {"truncated": True}  # truncated ends the episode

    async def close(self):
        self.closed = True


TOKENIZER = ByteTokenizer()


def answer(prompt_ids, rng):
    """The simulated model's every turn: a short text and eos."""
    return [*TOKENIZER.encode("ok"), TOKENIZER.eos_token_id]


def pipeline_for(env: GymEnvironment, **options) -> Pipeline:
    engine = SimulatedEngine(latency_s=0.001, responder=answer)
    return Pipeline(env.stages(max_turns=5), engine=engine, tokenizer=TOKENIZER,
                    sampling={"max_tokens": 8}, **options)


@pytest.fixture(autouse=True)
def _fresh_ledger():
    Counter.closed, Counter.unblocked = [], []
    Counter.release = threading.Event()
    yield
    Counter.release.set()


async def test_completed_episode_sums_step_rewards_and_closes_once():
    result = await pipeline_for(GymEnvironment(lambda item: Counter())).run_batch(ROWS, n=3)
    assert [s.status for s in result.samples] == [Status.COMPLETED] * 3
    assert Counter.closed == [3, 3, 3]
    for sample, item in zip(result.samples, result.items, strict=True):
        assert sample.reward == 3.0
        assert item.artifacts[artifacts.EXTRA_FIELDS]["turn_scores"] == [1.0, 1.0, 1.0]
        assert [m["steps"] for m in item.artifacts["env_metadata"]] == [1, 2, 3]


async def test_step_that_raises_fails_the_sample_readably_and_close_runs():
    env = GymEnvironment(lambda item: Counter("raises"))
    result = await pipeline_for(env).run_batch(ROWS, n=2)
    assert [s.status for s in result.samples] == [Status.FAILED] * 2
    for item in result.items:
        assert item.error is not None and "board state lost" in str(item.error)
        assert "env_step" in str(item.error)
    assert Counter.closed == [2, 2] and env._envs == {}


async def test_step_that_hangs_ends_at_the_step_timeout_and_close_runs():
    env = GymEnvironment(lambda item: Counter("hangs"), step_timeout_s=0.3)
    result = await pipeline_for(env).run_batch(ROWS, n=2)
    assert Counter.unblocked == []  # the batch ended while the steps were still blocked
    Counter.release.set()  # before the test's loop closes, which waits for its threads
    assert [s.status for s in result.samples] == [Status.FAILED] * 2
    assert all("did not return within 0.3s" in str(item.error) for item in result.items)
    assert sorted(Counter.closed) == [2, 2]


async def test_sample_deadline_during_a_hung_step_times_out_and_close_runs():
    env = GymEnvironment(lambda item: Counter("hangs"), step_timeout_s=30)
    result = await pipeline_for(env, sample_timeout_s=0.4).run_batch(ROWS, n=2)
    Counter.release.set()
    assert [s.status for s in result.samples] == [Status.TIMEOUT] * 2
    assert sorted(Counter.closed) == [2, 2]


async def test_close_that_raises_is_recorded_never_the_outcome():
    result = await pipeline_for(GymEnvironment(lambda item: Counter("close_raises"))).run_batch(
        ROWS, n=1)
    (sample,), (item,) = result.samples, result.items
    assert sample.status == Status.COMPLETED and sample.reward == 3.0
    failed = [r for r in item.records if r.phase == "cleanup" and r.status == "failed"]
    assert len(failed) == 1 and "could not delete the container" in failed[0].error_message


async def test_gymnasium_shapes_and_async_methods():
    made: list[AsyncGymnasium] = []

    async def make(item):
        made.append(AsyncGymnasium())
        return made[-1]

    result = await pipeline_for(GymEnvironment(make, reward="last")).run_batch(ROWS, n=2)
    assert [s.status for s in result.samples] == [Status.COMPLETED] * 2
    for sample, item in zip(result.samples, result.items, strict=True):
        assert item.artifacts[artifacts.MESSAGES][0].content == "Say anything."
        assert sample.reward == 0.25 and item.artifacts[artifacts.TURNS] == 1
    assert all(env.closed for env in made)


def test_bad_arguments_name_the_field():
    with pytest.raises(ConfigError) as exc:
        GymEnvironment(lambda item: Counter(), step_timeout_s=0)
    assert exc.value.field == "step_timeout_s"
    with pytest.raises(ConfigError) as exc:
        GymEnvironment(lambda item: Counter(), reward="mean")
    assert exc.value.field == "reward"
    with pytest.raises(ConfigError) as exc:
        GymEnvironment("gsm8k")
    assert exc.value.field == "make_env"
