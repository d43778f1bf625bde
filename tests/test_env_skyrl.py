"""skyrl-gym's own environments (gsm8k, gsm8k_multi_turn) run through GymEnvironment on the
real tiny model: token-exact trajectories, rewards exactly as the environment computes them,
per-step rewards in verl's turn_scores column.

The tiny model has random weights: a logits processor forces each turn's text (a wrong
formatted answer, then the right one), so the environment's rewards are known in advance."""

from __future__ import annotations

import pytest
from _model_fixtures import ForcedText

from pipeline import Pipeline, Status, artifacts
from pipeline._text.render import render
from pipeline.batch import to_verl_outputs
from pipeline.stages import GymEnvironment

skyrl_gym = pytest.importorskip("skyrl_gym")
from skyrl_gym.envs.gsm8k import utils as gsm8k_utils  # noqa: E402

pytest_plugins = ["_model_fixtures"]

TURNS = {0: "Twenty plus twenty one. #### 41", 1: "Sorry: #### 42"}


def forced(tokenizer):
    def factory(request_id, prompt_ids):
        turn = int(request_id.rsplit("-", 1)[1])
        return ForcedText([tokenizer.encode(TURNS[turn])], tokenizer.eos_token_id)
    return factory


def row(env_id: str) -> dict:
    return {"messages": [{"role": "user", "content": "What is 20 + 22? End with '#### N'."}],
            "ground_truth": "42",
            "extra": {"env_class": env_id, "reward_spec": {"ground_truth": "42"},
                      "extra_info": {"max_turns": 3}}}


def make_skyrl_env(item):
    extra = item.data.extra
    return skyrl_gym.make(extra["env_class"], extras={"reward_spec": extra["reward_spec"],
                                                      "extra_info": extra["extra_info"]})


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


async def test_multi_turn_gsm8k_token_exact_with_the_environments_rewards(make_engine,
                                                                          tokenizer):
    env = GymEnvironment(make_skyrl_env)
    engine = make_engine(processor_factory=forced(tokenizer))
    rollout = Pipeline(env.stages(max_turns=3), engine=engine, tokenizer=tokenizer,
                       sampling={"max_tokens": 32}, sample_timeout_s=60)
    result = await rollout.run_batch([row("gsm8k_multi_turn")], n=2)
    assert [s.status for s in result.samples] == [Status.COMPLETED] * 2
    # what the environment itself scores for these two answers, by its own function
    expected = [gsm8k_utils.compute_score(TURNS[0], "42", method="strict",
                                          format_score=0.2 / 3, score=1.0),
                gsm8k_utils.compute_score(TURNS[1], "42", method="strict",
                                          format_score=0.2 / 3, score=1.0)]
    assert expected == [pytest.approx(0.2 / 3), 1.0]
    for sample, item in zip(result.samples, result.items, strict=True):
        assert item.artifacts[artifacts.EXTRA_FIELDS]["turn_scores"] == expected
        assert sample.reward == pytest.approx(sum(expected))
        messages = item.artifacts[artifacts.MESSAGES]
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[2].content.startswith("Please provide your step-by-step reasoning")
        # token-exact: model tokens are exactly what was forced (mask 1); the observation is
        # the template's tokens (mask 0); together they are the template's rendering
        ids, mask = sample.response_ids, sample.response_mask
        model = [t for t, m in zip(ids, mask, strict=True) if m == 1]
        assert model == [*tokenizer.encode(TURNS[0]), tokenizer.eos_token_id,
                         *tokenizer.encode(TURNS[1]), tokenizer.eos_token_id]
        assert 0 in mask and sample.logprobs is not None
        assert all(lp == 0.0 for lp, m in zip(sample.logprobs, mask, strict=True) if m == 0)
        chat = [{"role": m.role, "content": m.content} for m in messages]
        full = render(tokenizer, chat, None, add_generation_prompt=False)
        assert tokenizer.decode([*sample.prompt_ids, *ids]) == full.rstrip("\n")
    outputs = to_verl_outputs(result.samples, items=result.items, use_verl=False)
    assert [o["extra_fields"]["turn_scores"] for o in outputs] == [expected] * 2


async def test_single_turn_gsm8k_is_one_step(make_engine, tokenizer):
    env = GymEnvironment(make_skyrl_env)
    engine = make_engine(processor_factory=forced(tokenizer))
    rollout = Pipeline(env.stages(max_turns=3), engine=engine, tokenizer=tokenizer,
                       sampling={"max_tokens": 32}, sample_timeout_s=60)
    result = await rollout.run_batch([row("gsm8k")], n=1)
    (sample,), (item,) = result.samples, result.items
    assert sample.status == Status.COMPLETED and sample.reward == 0.0  # "#### 41" is wrong
    assert item.artifacts[artifacts.EXTRA_FIELDS]["turn_scores"] == [0.0]
    assert item.artifacts[artifacts.TURNS] == 1 and 0 not in sample.response_mask
