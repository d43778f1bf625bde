"""The simulated engine's capacity model (slots, KV budget, step clock) and its weight sync."""

from __future__ import annotations

import asyncio
import random

import pytest

from pipeline import ConfigError, SamplingParams
from pipeline.engines import EngineLoad, SimulatedEngine, WeightSync

EOS = 0


def fixed_reply(length: int):
    """A responder whose reply is ``length`` tokens, the last one eos."""
    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [*([7] * (length - 1)), EOS]
    return respond


def sampling(max_tokens: int = 1000) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=1)


async def watch(engine: SimulatedEngine, seen: list[EngineLoad], stop: asyncio.Event) -> None:
    while not stop.is_set():
        seen.append(engine.load())
        await asyncio.sleep(0.001)


async def test_at_most_max_running_decode_and_the_rest_wait() -> None:
    engine = SimulatedEngine(max_running=4, token_time_s=0.002, responder=fixed_reply(10),
                             eos_token_id=EOS)
    seen: list[EngineLoad] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(engine, seen, stop))
    loop = asyncio.get_running_loop()
    started = loop.time()
    gens = await asyncio.gather(*(engine.generate([1, 2, 3], sampling(), f"r{i}")
                                  for i in range(12)))
    elapsed = loop.time() - started
    stop.set()
    await watcher
    assert all(len(g.token_ids) == 10 and g.finish_reason == "stop" for g in gens)
    assert max(s.running for s in seen) == 4
    assert max(s.waiting for s in seen) == 8
    # three waves of (1 prefill + 10 decode) steps: far longer than one request's 22 ms
    assert elapsed >= 3 * 11 * 0.002 * 0.9
    final = engine.load()
    assert (final.running, final.waiting, final.sampled_tokens) == (0, 0, 120)
    assert final.preemptions == 0
    assert final.slot_s == pytest.approx(12 * 11 * 0.002)
    await engine.aclose()


async def test_kv_budget_preempts_the_youngest_and_every_request_still_finishes() -> None:
    # 4 sequences of 4 + 40 tokens need 176 KV slots; the budget holds 100.
    engine = SimulatedEngine(max_running=4, token_time_s=0.001, kv_capacity_tokens=100,
                             responder=fixed_reply(40), eos_token_id=EOS)
    seen: list[EngineLoad] = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch(engine, seen, stop))
    gens = await asyncio.gather(*(engine.generate([1, 2, 3, 4], sampling(), f"r{i}")
                                  for i in range(4)))
    stop.set()
    await watcher
    assert [len(g.token_ids) for g in gens] == [40] * 4
    assert engine.load().preemptions > 0
    assert all(s.kv_usage is not None and s.kv_usage <= 1.0 for s in seen)
    assert engine.scheduler is not None and engine.scheduler.kv_used == 0
    await engine.aclose()


async def test_a_request_larger_than_the_kv_budget_fails_with_an_engine_error() -> None:
    engine = SimulatedEngine(max_running=2, kv_capacity_tokens=20, responder=fixed_reply(30),
                             eos_token_id=EOS)
    with pytest.raises(Exception, match="needs 32 KV slots"):
        await engine.generate([1, 2], sampling(), "big")
    await engine.aclose()


async def test_keep_pause_freezes_decoding_and_tokens_after_the_update_carry_the_new_version(
) -> None:
    engine = SimulatedEngine(max_running=2, token_time_s=0.002, responder=fixed_reply(60),
                             eos_token_id=EOS)
    assert isinstance(engine, WeightSync)
    request = asyncio.create_task(engine.generate([1, 2], sampling(), "long"))
    for _ in range(1000):
        if engine.load().sampled_tokens >= 10:
            break
        await asyncio.sleep(0.002)
    await engine.pause("keep")
    frozen_at = engine.load().sampled_tokens
    assert await engine.update_weights() == 1
    await asyncio.sleep(0.03)
    assert engine.load().sampled_tokens == frozen_at  # nothing sampled while paused
    held = asyncio.create_task(engine.generate([5], sampling(), "new"))
    await asyncio.sleep(0.01)
    assert not held.done() and engine.calls == 1  # new requests wait for resume
    await engine.resume()
    gen, new = await asyncio.gather(request, held)
    assert gen.token_versions == [0] * frozen_at + [1] * (60 - frozen_at)
    assert gen.policy_version == 0 and 10 <= frozen_at < 60
    # one version for every token: no per-token list, the generation's version says it
    assert new.token_versions is None and new.policy_version == 1
    await engine.aclose()


@pytest.mark.parametrize("capacity", [True, False], ids=["capacity", "latency"])
async def test_abort_pause_ends_requests_in_flight_and_wait_pause_waits(capacity: bool) -> None:
    options = ({"max_running": 4, "token_time_s": 0.002} if capacity
               else {"latency_s": 0.05, "latency_sigma": 0.0, "tail_prob": 0.0})
    engine = SimulatedEngine(responder=fixed_reply(50), eos_token_id=EOS, **options)
    running = [asyncio.create_task(engine.generate([1], sampling(), f"a{i}")) for i in range(3)]
    await asyncio.sleep(0.02)
    await engine.pause("abort")
    gens = [await r for r in running]
    assert all(g.finish_reason == "abort" for g in gens)
    if capacity:  # what was sampled before the abort comes back
        assert all(0 < len(g.token_ids) < 50 and len(g.logprobs) == len(g.token_ids)
                   and g.policy_version == 0 for g in gens)
    await engine.resume()
    waited = asyncio.create_task(engine.generate([1], sampling(), "w"))
    await asyncio.sleep(0.01)
    await engine.pause("wait")
    assert waited.done() and waited.result().finish_reason == "stop"
    await engine.resume()
    await engine.aclose()


async def test_latency_model_versions_follow_the_update_time_within_a_request() -> None:
    engine = SimulatedEngine(latency_s=0.1, latency_sigma=0.0, tail_prob=0.0,
                             responder=fixed_reply(10), eos_token_id=EOS)
    request = asyncio.create_task(engine.generate([1], sampling(), "r"))
    await asyncio.sleep(0.045)
    await engine.update_weights(version=5)
    gen = await request
    # tokens sampled before the update (the first ones) carry the old version, the rest the
    # new one; where the split falls depends on when the loop ran the update
    versions = gen.token_versions
    assert versions is not None and versions == sorted(versions)
    assert versions[0] == 0 and versions[-1] == 5 and set(versions) == {0, 5}
    assert gen.policy_version == 0
    await engine.aclose()


async def test_a_cancelled_caller_frees_its_slot_and_kv() -> None:
    engine = SimulatedEngine(max_running=1, token_time_s=0.002, kv_capacity_tokens=1000,
                             responder=fixed_reply(200), eos_token_id=EOS)
    first = asyncio.create_task(engine.generate([1, 2, 3], sampling(), "first"))
    second = asyncio.create_task(engine.generate([1], sampling(max_tokens=3), "second"))
    await asyncio.sleep(0.02)
    assert engine.load().waiting == 1
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    gen = await second
    assert len(gen.token_ids) == 3 and engine.aborted[-1] == "first"
    assert engine.scheduler is not None and engine.scheduler.kv_used == 0
    await engine.aclose()
    assert engine.scheduler._task is None


@pytest.mark.parametrize(("option", "value"), [
    ("max_running", 0), ("token_time_s", 0), ("kv_capacity_tokens", -5),
    ("prefill_tokens_per_step", 1.5), ("max_running", True)])
def test_bad_capacity_options_name_the_field(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=option) as info:
        SimulatedEngine(**{"max_running": 2, option: value})  # type: ignore[arg-type]
    assert info.value.field == option
