"""collate and the group helpers, on samples from a real Pipeline run (simulated engine).

Samples come from ``Pipeline.run_batch`` with BuildPrompt, Generate and a reward stage; some
samples fail, time out or are aborted by stages that really raise or hang. Only edge cases
(routing arrays, misaligned data) are built by hand.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from pipeline import (
    BuildPrompt,
    ContractError,
    Generate,
    Pipeline,
    RolloutSample,
    SampleAborted,
    SimulatedEngine,
    Status,
    artifacts,
)
from pipeline.batch import collate, group_advantages, group_indices, summarize_groups
from pipeline.testing import ByteTokenizer, capture_logs

PAD = ByteTokenizer.pad_token_id
MODES = ["ok", "ok", "fail", "hang", "abort", "early"]


async def early(item, ctx):
    """Fails before the prompt is built when the row says so (a sample with no tokens)."""
    if item.data.extra["modes"].get(str(item.sample_index)) == "early":
        raise RuntimeError("failed before the prompt was built")


async def misbehave(item, ctx):
    """Fails, hangs past the deadline, or aborts after generating, as the row says."""
    mode = item.data.extra["modes"].get(str(item.sample_index))
    if mode == "fail":
        raise ValueError("tool crashed")
    if mode == "hang":
        await asyncio.sleep(30)
    if mode == "abort":
        raise SampleAborted("trainer paused")


async def reward(item, ctx):
    """A reward that differs between samples: the parity of the response's token sum."""
    item.artifacts[artifacts.REWARD] = float(sum(item.artifacts[artifacts.RESPONSE_IDS]) % 2)


async def run_batch(num_rows: int = 4, n: int = 6, max_tokens: int = 24):
    rows = [{"messages": [{"role": "user", "content": "question " + "x" * (3 * i)}],
             "extra": {"modes": {str(k): mode for k, mode in enumerate(MODES)} if i % 2 else {}}}
            for i in range(num_rows)]
    pipe = Pipeline([early, BuildPrompt(offload=False), Generate(), misbehave, reward],
                    engine=SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0, seed=3),
                    tokenizer=ByteTokenizer(), sample_timeout_s=0.3,
                    sampling={"max_tokens": max_tokens})
    return await pipe.run_batch(rows, n=n)


@pytest.fixture(scope="module")
def batch():
    return asyncio.run(run_batch())


def test_fixture_has_every_status(batch):
    statuses = {s.status for s in batch.samples}
    assert statuses == {Status.COMPLETED, Status.FAILED, Status.TIMEOUT, Status.ABORTED}
    assert any(not s.prompt_ids for s in batch.samples)  # the "early" failures


def test_collate_layout_matches_every_sample(batch):
    samples = batch.samples
    out = collate(samples, pad_token_id=PAD, max_prompt_len=64, max_response_len=32,
                  return_tensors="np")
    width_p, width_r = 64, 32
    assert out["prompts"].shape == (len(samples), width_p)
    assert out["responses"].shape == (len(samples), width_r)
    assert not out["overlong"].any()
    for i, s in enumerate(samples):  # output order is input order
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert out["prompts"][i, width_p - p:].tolist() == s.prompt_ids
        assert (out["prompts"][i, :width_p - p] == PAD).all()
        assert out["responses"][i, :r].tolist() == s.response_ids
        assert (out["responses"][i, r:] == PAD).all()
        assert out["input_ids"][i].tolist() == out["prompts"][i].tolist() + out[
            "responses"][i].tolist()
        attn = out["attention_mask"][i]
        if p + r:
            assert attn.tolist() == [0] * (width_p - p) + [1] * (p + r) + [0] * (width_r - r)
            assert out["position_ids"][i, width_p - p:width_p + r].tolist() == list(range(p + r))
        expected_mask = [0] * r if s.masked else s.response_mask
        assert out["response_mask"][i, :r].tolist() == expected_mask
        assert not out["response_mask"][i, r:].any()
        if s.logprobs is not None:
            assert np.allclose(out["rollout_log_probs"][i, :r], s.logprobs, atol=1e-6)
        assert not out["rollout_log_probs"][i, r:].any()
        assert out["masked"][i] == s.masked == (s.status is not Status.COMPLETED)
        scores = out["rm_scores"][i]
        if s.masked:
            assert not scores.any()
        else:
            assert scores[r - 1] == s.reward and scores.sum() == s.reward


def test_masked_samples_carry_no_loss_but_keep_their_tokens(batch):
    out = collate(batch.samples, pad_token_id=PAD, max_prompt_len=64, max_response_len=32,
                  return_tensors="np")
    masked = out["masked"]
    assert masked.sum() == sum(s.status is not Status.COMPLETED for s in batch.samples) > 0
    assert not out["response_mask"][masked].any()
    assert not out["rm_scores"][masked].any()
    partial = [i for i, s in enumerate(batch.samples) if s.masked and s.response_ids]
    assert partial, "failed/timeout/aborted samples after Generate keep their response"
    assert all(out["attention_mask"][i].sum() > 0 for i in partial)


def test_a_sample_without_tokens_gets_one_attended_pad(batch):
    out = collate(batch.samples, pad_token_id=PAD, max_prompt_len=64, max_response_len=32,
                  return_tensors="np")
    empty = [i for i, s in enumerate(batch.samples) if not s.prompt_ids and not s.response_ids]
    assert empty
    for i in empty:
        assert out["attention_mask"][i].tolist() == [0] * 64 + [1] + [0] * 31
        assert out["input_ids"][i, 64] == PAD and out["masked"][i]


def test_overlong_samples_are_cut_masked_flagged_and_counted(batch):
    samples = batch.samples
    max_p, max_r = 30, 12
    with capture_logs() as logs:
        out = collate(samples, pad_token_id=PAD, max_prompt_len=max_p, max_response_len=max_r,
                      return_tensors="np")
    over = [len(s.prompt_ids) > max_p or len(s.response_ids) > max_r for s in samples]
    assert any(over) and not all(over)
    assert out["overlong"].tolist() == over
    assert out["prompts"].shape == (len(samples), max_p)  # still one row per sample, in order
    events = [e for e in logs if e["event"] == "collate_overlong"]
    assert len(events) == 1 and events[0]["count"] == sum(over)
    assert events[0]["log_level"] == "warning"
    for i, s in enumerate(samples):
        if not over[i]:
            assert out["masked"][i] == s.masked
            continue
        assert out["masked"][i] and not out["response_mask"][i].any()
        assert not out["rm_scores"][i].any()
        kept_p = s.prompt_ids[-max_p:]  # the prompt keeps its end, the response its start
        assert out["prompts"][i, max_p - len(kept_p):].tolist() == kept_p
        assert out["responses"][i, :min(max_r, len(s.response_ids))].tolist() == (
            s.response_ids[:max_r])


def test_pad_to_longest_uses_the_batch_lengths_within_the_budget(batch):
    samples = batch.samples
    longest_p = max(len(s.prompt_ids) for s in samples)
    longest_r = max(len(s.response_ids) for s in samples)
    out = collate(samples, pad_token_id=PAD, max_prompt_len=500, max_response_len=500,
                  pad_to="longest", return_tensors="np")
    assert out["prompts"].shape[1] == longest_p and out["responses"].shape[1] == longest_r
    capped = collate(samples, pad_token_id=PAD, max_prompt_len=500, max_response_len=10,
                     pad_to="longest", return_tensors="np")
    assert capped["responses"].shape[1] == 10 and capped["overlong"].any()


def test_torch_tensors_equal_the_numpy_arrays(batch):
    torch = pytest.importorskip("torch")
    kwargs = {"pad_token_id": PAD, "max_prompt_len": 64, "max_response_len": 32}
    arrays = collate(batch.samples, return_tensors="np", **kwargs)
    tensors = collate(batch.samples, **kwargs)
    assert set(arrays) == set(tensors)
    for key, array in arrays.items():
        assert isinstance(tensors[key], torch.Tensor)
        assert tensors[key].numpy().tolist() == array.tolist()
    assert tensors["input_ids"].dtype == torch.int64
    assert tensors["masked"].dtype == torch.bool
    assert tensors["rollout_log_probs"].dtype == torch.float32


def test_importing_pipeline_batch_does_not_import_torch():
    code = "import sys, pipeline.batch; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "False"


# ----- hand-built edge cases: the all-or-none rules -----------------------------------------


def sample(uid: str, *, status: Status = Status.COMPLETED, prompt=(5, 6, 7),
           response=(8, 9), routes=None, reward: float | None = 1.0,
           logprobs: list[float] | None = None, group: str = "g") -> RolloutSample:
    masked = status is not Status.COMPLETED
    return RolloutSample(
        uid=uid, group_id=group, index=0, prompt_ids=list(prompt), response_ids=list(response),
        response_mask=[1] * len(response), logprobs=logprobs, reward=None if masked else reward,
        status=status, finish_reason="stop" if not masked else "error", masked=masked,
        exit_reason="done", routed_experts=routes)


def routes_for(length: int, layers: int = 2, topk: int = 2, start: int = 1) -> np.ndarray:
    values = np.arange(start, start + length * layers * topk) % 7 + 1
    return values.reshape(length, layers, topk).astype(np.int16)


def test_routed_experts_absent_when_no_sample_has_them():
    out = collate([sample("a"), sample("b")], pad_token_id=0, max_prompt_len=4,
                  max_response_len=4, return_tensors="np")
    assert "routed_experts" not in out


def test_routed_experts_aligned_with_input_ids_and_masked_ones_zero_filled():
    full = routes_for(5)  # prompt 3 + response 2
    short = routes_for(4, start=3)  # the last sampled token was never routed
    samples = [sample("a", routes=full), sample("b", routes=short),
               sample("c", status=Status.FAILED),  # masked, no routing: zero-filled
               sample("d", status=Status.TIMEOUT, routes=routes_for(9))]  # masked, bad length
    out = collate(samples, pad_token_id=0, max_prompt_len=4, max_response_len=4,
                  return_tensors="np")
    routed = out["routed_experts"]
    assert routed.shape == (4, 8, 2, 2) and routed.dtype == np.int16
    assert (routed[0, 1:6] == full).all()  # the prompt starts at column 4 - 3 = 1
    assert not routed[0, :1].any() and not routed[0, 6:].any()
    assert (routed[1, 1:5] == short).all() and not routed[1, 5:].any()
    assert not routed[2].any() and not routed[3].any()


def test_a_completed_sample_missing_routed_experts_is_a_contract_error():
    samples = [sample("keep", routes=routes_for(5)), sample("lost-routing-7")]
    with pytest.raises(ContractError, match=r"lost-routing-7.*no routed_experts"):
        collate(samples, pad_token_id=0, max_prompt_len=4, max_response_len=4,
                return_tensors="np")


@pytest.mark.parametrize(("routes", "message"), [
    (routes_for(5, layers=3), r"\[num_layers, topk\]"),
    (routes_for(6), "covers 6 tokens"),
    (np.zeros((5, 2, 2), dtype=np.float32), "integer array"),
])
def test_inconsistent_routed_experts_are_contract_errors(routes, message):
    samples = [sample("a", routes=routes_for(5)), sample("bad", routes=routes)]
    with pytest.raises(ContractError, match=f"sample bad: .*{message}"):
        collate(samples, pad_token_id=0, max_prompt_len=4, max_response_len=4,
                return_tensors="np")


def test_overlong_sample_gets_zero_routing():
    samples = [sample("a", routes=routes_for(5)),
               sample("long", response=range(8, 20), routes=routes_for(15))]
    out = collate(samples, pad_token_id=0, max_prompt_len=4, max_response_len=4,
                  return_tensors="np")
    assert out["overlong"].tolist() == [False, True]
    assert out["routed_experts"][0].any() and not out["routed_experts"][1].any()


def test_logprobs_and_rewards_are_all_or_none():
    ok = sample("a", logprobs=[-0.5, -0.25])
    with pytest.raises(ContractError, match=r"sample nolp .*no logprobs"):
        collate([ok, sample("nolp")], pad_token_id=0, max_prompt_len=4, max_response_len=4,
                return_tensors="np")
    with pytest.raises(ContractError, match=r"sample noreward .*no reward"):
        collate([ok, sample("noreward", logprobs=[0.0, 0.0], reward=None)], pad_token_id=0,
                max_prompt_len=4, max_response_len=4, return_tensors="np")
    out = collate([ok, sample("f", status=Status.ABORTED)], pad_token_id=0, max_prompt_len=4,
                  max_response_len=4, return_tensors="np")
    assert out["rollout_log_probs"][1].tolist() == [0.0] * 4
    none = collate([sample("a", reward=None), sample("b", reward=None)], pad_token_id=0,
                   max_prompt_len=4, max_response_len=4, return_tensors="np")
    assert "rm_scores" not in none and "rollout_log_probs" not in none


def test_misaligned_samples_and_bad_budgets_are_refused():
    bad = sample("skew")
    bad.response_mask = [1]
    with pytest.raises(ContractError, match="sample skew: response_mask has 1 entries"):
        collate([bad], pad_token_id=0, max_prompt_len=4, max_response_len=4)
    with pytest.raises(ContractError, match="logprobs has 1 entries"):
        collate([sample("lp", logprobs=[0.0])], pad_token_id=0, max_prompt_len=4,
                max_response_len=4)
    from pipeline import ConfigError

    with pytest.raises(ConfigError, match="max_prompt_len"):
        collate([sample("a")], pad_token_id=0, max_prompt_len=0, max_response_len=4)


# ----- groups ------------------------------------------------------------------------------


def test_group_indices_follow_the_pipeline_groups(batch):
    groups = group_indices(batch.samples)
    assert len(groups) == 4 and all(len(v) == 6 for v in groups.values())
    assert list(groups) == list(dict.fromkeys(s.group_id for s in batch.samples))
    for group_id, indices in groups.items():
        assert {batch.samples[i].group_id for i in indices} == {group_id}


def test_group_advantages_by_hand():
    rewards = [1.0, 0.0, 1.0, 0.0]
    samples = [sample(f"a{i}", reward=r, group="A") for i, r in enumerate(rewards)]
    samples += [sample("b0", reward=3.0, group="B"),  # a lone valid sample: no baseline
                sample("b1", status=Status.TIMEOUT, group="B")]
    samples += [sample("c0", reward=2.0, group="C"), sample("c1", reward=4.0, group="C"),
                sample("c2", status=Status.FAILED, group="C")]
    adv = group_advantages(samples, eps=0.0)
    std_a = np.std(rewards, ddof=1)
    assert np.allclose(adv[:4], (np.array(rewards) - 0.5) / std_a)
    assert adv[4] == 0 and adv[5] == 0  # B: one valid sample; the masked one gets 0
    assert np.allclose(adv[6:8], [-1 / np.sqrt(2), 1 / np.sqrt(2)]) and adv[8] == 0
    counted = group_advantages(samples, include_masked=True, masked_reward=0.0, eps=0.0)
    values = np.array([2.0, 4.0, 0.0])
    assert np.allclose(counted[6:8], (values[:2] - values.mean()) / values.std(ddof=1))
    assert counted[8] == 0 and counted[4] != 0  # B now has two counted samples
    assert np.allclose(group_advantages(samples, scale=False)[:4], np.array(rewards) - 0.5)


def test_group_advantages_honour_the_collate_mask(batch):
    out = collate(batch.samples, pad_token_id=PAD, max_prompt_len=64, max_response_len=12,
                  return_tensors="np")
    adv = group_advantages(batch.samples, masked=out["masked"])
    assert not adv[out["masked"]].any()
    assert adv.dtype == np.float32 and adv.shape == (len(batch.samples),)
    with pytest.raises(ContractError, match="unmasked but has no reward"):
        group_advantages([sample("a"), sample("nope", reward=None)])


def test_summarize_groups_flags_uninformative_groups():
    samples = [sample("a0", reward=1.0, group="same"), sample("a1", reward=1.0, group="same"),
               sample("b0", status=Status.FAILED, group="dead"),
               sample("b1", status=Status.TIMEOUT, group="dead"),
               sample("c0", reward=0.0, group="good"), sample("c1", reward=1.0, group="good"),
               sample("c2", status=Status.ABORTED, group="good")]
    summary = {g.group_id: g for g in summarize_groups(samples)}
    assert summary["same"].zero_variance and not summary["same"].all_masked
    assert summary["dead"].all_masked and summary["dead"].reward_mean is None
    good = summary["good"]
    assert good.informative and good.num_valid == 2 and good.indices == (4, 5, 6)
    assert good.reward_mean == 0.5 and good.reward_std == 0.5
    assert [g.informative for g in summary.values()] == [False, False, True]
    cut = summarize_groups(samples, masked=[False] * 5 + [True, False])
    assert not {g.group_id: g for g in cut}["good"].informative  # one valid sample left


def test_an_empty_batch_collates_to_empty_tensors():
    out = collate([], pad_token_id=0, max_prompt_len=4, max_response_len=3, return_tensors="np")
    assert out["input_ids"].shape == (0, 7) and out["masked"].shape == (0,)
    assert "rm_scores" not in out and "routed_experts" not in out
    assert group_advantages([]).shape == (0,) and summarize_groups([]) == []
