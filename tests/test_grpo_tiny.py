"""The GRPO loop of ``scenarios/grpo_tiny.py``, piece by piece, on the shipped tiny policy with
the in-process transformers engine: an iteration changes the trainer's weights and the engine
then samples with them, masked samples get no advantage and no gradient, and the
engine-vs-trainer logprob gap on a real forward pass is small only when the processing matches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pytest_asyncio import fixture as async_fixture  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from pipeline import Pipeline, RolloutSample, SamplingParams, collate  # noqa: E402
from pipeline.engines import WeightSync, make_engine  # noqa: E402
from pipeline.models import tiny_policy_dir  # noqa: E402
from pipeline.observability import (  # noqa: E402
    TensorBoardSink,
    TrajectoryWriter,
    read_trajectories,
)
from scenarios import arith_tools, grpo_tiny  # noqa: E402

pytestmark = pytest.mark.asyncio(loop_scope="module")

CFG = grpo_tiny.Config(prompts=8, n=4, lr=3e-3, threads=1)


@async_fixture(scope="module", loop_scope="module")
async def policy() -> Any:
    """The engine (weight-synced TransformersEngine) and its tokenizer; one per module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine
    engine, tokenizer = await make_engine("transformers", model_dir=tiny_policy_dir(),
                                          notify=lambda _: None,
                                          options={"max_batch_size": 64, "max_model_len": 2048})
    yield engine, tokenizer
    await engine.aclose()
    torch.set_num_threads(threads)


def trainer_model() -> Any:
    return AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir()),
                                                dtype=torch.float32).eval()


async def engine_weights(engine: Any) -> dict[str, Any]:
    return await engine.call_in_worker(
        lambda model: {k: v.detach().clone() for k, v in model.state_dict().items()})


async def rollouts(engine: Any, tokenizer: Any, *, count: int = 4, n: int = 2,
                   **sampling: Any) -> list[RolloutSample]:
    pipeline = Pipeline(arith_tools.stages(), engine=engine, tokenizer=tokenizer,
                        tools=arith_tools.tools(), progress_log_s=None,
                        config={"seed": 3, "sampling": {**grpo_tiny.sampling(CFG), **sampling}})
    result = await pipeline.run_batch(arith_tools.rows(count, seed=77), n=n)
    assert all(not s.masked for s in result.samples)
    return result.samples


async def test_an_iteration_updates_the_weights_and_the_engine_samples_with_them(
        policy, tmp_path: Path):
    engine, tokenizer = policy
    assert isinstance(engine, WeightSync)
    model = trainer_model()
    model.load_state_dict(await engine_weights(engine))  # whatever the engine runs now
    before = {k: v.clone() for k, v in model.state_dict().items()}
    version = engine.policy_version
    ids = tokenizer.encode("Ava has 12 apples and buys 3 boxes with 4 apples in each.")
    probe = SamplingParams(max_tokens=16, seed=5)
    old = await engine.generate(ids, probe, "probe-old")

    optimizer = torch.optim.AdamW(model.parameters(), lr=CFG.lr, weight_decay=0.0)
    writer = TrajectoryWriter(tmp_path / "iter_{step:04d}.jsonl", tokenizer=tokenizer)
    with TensorBoardSink(tmp_path / "tb") as board:
        rollout = Pipeline(arith_tools.stages(), engine=engine, tokenizer=tokenizer,
                           tools=arith_tools.tools(), progress_log_s=None,
                           config={"seed": 1, "sampling": grpo_tiny.sampling(CFG)})
        record = await grpo_tiny.iteration(1, CFG, rollout, engine, model, optimizer,
                                           tokenizer, board, writer)
    writer.close()

    assert record["trained_samples"] > 0 and record["policy_version"] == version
    assert record["gap_max"] < 1e-3  # the engine sampled what the trainer computes
    assert engine.policy_version == version + 1
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(torch.equal(v, model.state_dict()[k])
                           for k, v in (await engine_weights(engine)).items())
    new = await engine.generate(ids, probe, "probe-new")
    assert new.policy_version == version + 1
    # same seed and prompt: if the tokens agree, their logprobs now come from other weights
    common = next((i for i, (a, b) in enumerate(zip(old.token_ids, new.token_ids, strict=False))
                   if a != b), min(len(old.token_ids), len(new.token_ids)))
    assert old.token_ids != new.token_ids or max(
        abs(a - b) for a, b in zip(old.logprobs[:common], new.logprobs[:common], strict=True)
    ) > 1e-4
    # and what the engine samples now has the updated trainer's logprobs
    fresh = await rollouts(engine, tokenizer, count=2, n=2)
    assert {s.policy_version for s in fresh} == {version + 1}
    batch = collate(fresh, pad_token_id=tokenizer.pad_token_id, max_prompt_len=1024,
                    max_response_len=512, pad_to="longest")
    trainer = grpo_tiny.token_logprobs(model, batch, 1.0)
    assert grpo_tiny.logprob_gap(batch["rollout_log_probs"], trainer,
                                 batch["response_mask"])["max"] < 1e-3
    dumped = read_trajectories(tmp_path / "iter_0001.jsonl", strict=True)
    assert len(dumped.samples) == CFG.prompts * CFG.n and len(dumped.ends) == 1


async def test_masked_samples_get_no_advantage_and_no_row(policy):
    engine, tokenizer = policy
    samples = await rollouts(engine, tokenizer, count=3, n=4)
    # real samples, rewards set so the outcome does not hang on the policy's luck: group 0
    # has a spread without its first (masked) sample, group 1 is all right, group 2 mixed
    rewards = [1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    samples = [s.model_copy(update={"reward": r, "masked": i == 0})
               for i, (s, r) in enumerate(zip(samples, rewards, strict=True))]

    batch, advantages, kept = grpo_tiny.training_batch(samples, tokenizer.pad_token_id)

    assert kept.tolist() == [False, True, True, True] + [False] * 4 + [True] * 4
    assert batch["input_ids"].shape[0] == len(advantages) == 7
    assert torch.equal(batch["responses"][0, :len(samples[1].response_ids)],
                       torch.tensor(samples[1].response_ids))
    assert not bool(batch["masked"].any())
    rest = torch.tensor([1.0, 0.0, 0.0])  # group 0 without the masked sample
    expected = (rest - rest.mean()) / (rest.std() + 1e-6)
    assert advantages[:3].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    # counted as a 0 instead, the masked sample would have changed its group's advantages
    counted = torch.tensor([0.0, 1.0, 0.0, 0.0])
    assert ((counted - counted.mean()) / (counted.std() + 1e-6))[1:].tolist() != pytest.approx(
        expected.tolist(), abs=1e-3)


@pytest.mark.parametrize(("engine_sampling", "trainer_temperature", "small"), [
    ({"temperature": 1.0}, 1.0, True),
    ({"temperature": 0.7}, 0.7, True),
    ({"temperature": 0.7}, 1.0, False),  # the trainer forgot the temperature
    ({"temperature": 1.0, "top_p": 0.5}, 1.0, False),  # the engine renormalised a nucleus
])
async def test_logprob_gap_on_a_real_forward_pass(policy, engine_sampling, trainer_temperature,
                                                  small):
    engine, tokenizer = policy
    model = trainer_model()
    model.load_state_dict(await engine_weights(engine))
    samples = await rollouts(engine, tokenizer, **engine_sampling)
    batch = collate(samples, pad_token_id=tokenizer.pad_token_id, max_prompt_len=1024,
                    max_response_len=512, pad_to="longest")
    trainer = grpo_tiny.token_logprobs(model, batch, trainer_temperature)
    gap = grpo_tiny.logprob_gap(batch["rollout_log_probs"], trainer, batch["response_mask"])
    assert gap["tokens"] == sum(sum(s.response_mask) for s in samples)
    if small:
        assert gap["max"] < 1e-3 and gap["mean"] < 1e-5
    else:
        assert gap["max"] > 0.05 and gap["mean"] > 1e-3
