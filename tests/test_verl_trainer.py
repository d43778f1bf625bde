"""verl 0.9.1's own trainer code on our batches (DataProto path, no Ray).

Every check runs verl's functions, never copies: the agent-loop worker's post-processing
(``AgentLoopWorker._agent_loop_postprocess`` and ``_postprocess``, on a worker whose
attributes are set by hand instead of from a full trainer config), ``DataProto.concat``, the
manager's performance metrics, ``compute_advantage`` (GRPO and our registered estimator),
``compute_policy_loss_vanilla`` + ``agg_loss``, ``compute_data_metrics``, ``extract_reward``
and ``AgentLoopOutput.as_dict``. The batch is a multi-turn tool batch on the real tiny model
with a token-less failed sample, failures after generation and a timed-out sample; a second
batch comes from the tiny MoE model with routed experts.
"""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("verl")
torch = pytest.importorskip("torch")

from _model_fixtures import ForcedText  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopManager,
    AgentLoopOutput,
    AgentLoopWorker,
)
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.metric_utils import compute_data_metrics  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402
from verl.trainer.ppo.reward import extract_reward  # noqa: E402

from pipeline import BuildPrompt, Generate, Loop, Pipeline, Status, artifacts  # noqa: E402
from pipeline.batch import (  # noqa: E402
    GRPO_MASKED,
    from_verl_batch,
    group_advantages,
    to_verl_batch,
    to_verl_outputs,
)
from pipeline.engines import TransformersEngine  # noqa: E402
from pipeline.integrations.verl import register_estimators  # noqa: E402
from pipeline.stages import CallTools  # noqa: E402
from pipeline.tools import FunctionTool, calculator_tool, make_registry, tool_schema  # noqa: E402

pytest_plugins = ["_model_fixtures"]

P, R = 384, 160  # verl's rollout.prompt_length / response_length for these batches
N = 4


def call_text(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def where(item) -> tuple[int, int]:
    return item.data.extra["row"], item.sample_index


async def fail_before_prompt(item, ctx):
    if where(item) == (1, 1):
        raise RuntimeError("sandbox never started")  # no token at all


async def fail_after(item, ctx):
    if where(item) in ((0, 3), (2, 1), (2, 2), (2, 3)):
        raise RuntimeError("judge service down")


async def judge(item, ctx):
    row, k = where(item)
    score = 1.0 if k == 0 else 0.0
    item.artifacts[artifacts.REWARD] = score
    extra = {"acc": bool(score)} if item.data.data_source == "a" else {"length": row}
    item.artifacts[artifacts.REWARD_PAYLOAD] = {"score": score, **extra}


class Script:
    """Turn 0 is forced to a tool call (``wait`` for row 1's third sample, which times out);
    later turns are sampled freely."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, request_id: str, prompt_ids) -> ForcedText | None:
        uid, turn = request_id.rsplit("-", 1)
        if turn != "0":
            return None
        text = self.tokenizer.decode(prompt_ids)
        slow = "Q1" in text and uid.endswith("-2")
        call = (call_text("wait", "{}") if slow
                else call_text("calculator", '{"expression": "6 * 7"}'))
        return ForcedText([self.tokenizer.encode(call)], self.tokenizer.eos_token_id)


def tool_rows() -> list[dict[str, Any]]:
    tools = [tool_schema(calculator_tool()), {"type": "function", "function": {
        "name": "wait", "description": "Waits.", "parameters": {"type": "object",
                                                                 "properties": {}}}}]
    return [{"messages": [{"role": "user", "content": f"Q{i}: what is 6 * 7?"}],
             "tools": tools, "data_source": "a" if i == 0 else "b", "extra": {"row": i}}
            for i in range(3)]


@pytest.fixture(scope="module")
def tool_batch(engine_model, tiny_tokenizer):
    async def wait() -> str:
        await asyncio.sleep(300)
        return "done"

    tools = make_registry([calculator_tool(),
                           FunctionTool(name="wait", fn=wait, timeout_s=600)])
    engine = TransformersEngine(engine_model, tiny_tokenizer, max_model_len=1024,
                                processor_factory=Script(tiny_tokenizer))
    pipe = Pipeline([fail_before_prompt, BuildPrompt(),
                     Loop([Generate(), CallTools()], max_turns=2), fail_after, judge],
                    engine=engine, tokenizer=tiny_tokenizer, tools=tools,
                    sample_timeout_s=12, sampling={"max_tokens": 40})

    async def go():
        try:
            return await pipe.run_batch(tool_rows(), n=N)
        finally:
            await engine.aclose()

    result = asyncio.run(go())
    status = {where(it): s.status for it, s in zip(result.items, result.samples, strict=True)}
    assert status[(1, 2)] == Status.TIMEOUT and status[(1, 1)] == Status.FAILED
    assert not result.samples[4 + 1].prompt_ids and not result.samples[4 + 1].response_ids
    assert all(s.tool_turns >= 1 for s in result.samples if s.status == Status.COMPLETED)
    return result


def bare_worker(tokenizer) -> AgentLoopWorker:
    """verl's worker class with only what its post-processing reads (no trainer config)."""
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.rollout_config = SimpleNamespace(prompt_length=P, response_length=R)
    worker.tokenizer, worker.processor = tokenizer, None
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    return worker


def verl_postprocess(worker, outputs, raw_prompts, inputs=None) -> DataProto:
    async def each():
        return [await worker._agent_loop_postprocess(o, False, raw_prompt=p)
                for o, p in zip(outputs, raw_prompts, strict=True)]
    return worker._postprocess(asyncio.run(each()), input_non_tensor_batch=inputs)


def assert_same(ours: DataProto, theirs: DataProto, skip: set[str] = frozenset()) -> None:
    assert set(ours.batch.keys()) == set(theirs.batch.keys())
    for key in theirs.batch.keys():
        assert torch.equal(ours.batch[key], theirs.batch[key].to(ours.batch[key].dtype)), key
    assert set(ours.non_tensor_batch) - skip == set(theirs.non_tensor_batch)
    for key, column in theirs.non_tensor_batch.items():
        for a, b in zip(ours.non_tensor_batch[key].tolist(), column.tolist(), strict=True):
            assert a == b or repr(a) == repr(b), (key, a, b)  # (NaN != NaN)
    assert ours.meta_info == theirs.meta_info


def test_our_batch_equals_verls_worker_postprocessing_of_our_outputs(tool_batch,
                                                                     tiny_tokenizer):
    pad = tiny_tokenizer.pad_token_id
    outputs = to_verl_outputs(tool_batch.samples, items=tool_batch.items, pad_token_id=pad)
    assert all(isinstance(o, AgentLoopOutput) for o in outputs)
    raw = [list(it.data.messages) for it in tool_batch.items]
    theirs = verl_postprocess(bare_worker(tiny_tokenizer), outputs, raw)
    ours = to_verl_batch(tool_batch.samples, items=tool_batch.items, pad_token_id=pad,
                         max_prompt_len=P, max_response_len=R, uid_key=None)
    assert_same(ours, theirs, skip={"rollout_overlong"})
    assert ours.non_tensor_batch["multi_modal_inputs"].tolist() == [{}] * len(outputs)
    statuses = ours.non_tensor_batch["rollout_status"].tolist()
    assert statuses.count("timeout") == 1 and statuses.count("failed") == 5


def test_token_less_failed_sample_survives_as_dict(tool_batch, tiny_tokenizer):
    outputs = to_verl_outputs(tool_batch.samples, pad_token_id=tiny_tokenizer.pad_token_id)
    empty = outputs[4 + 1]
    assert empty.response_ids == [tiny_tokenizer.pad_token_id] and empty.response_mask == [0]
    fields = empty.as_dict()  # verl's V1 worker calls this on every output
    assert fields["rm_scores"].tolist() == [0.0] and fields["rollout_log_probs"].tolist() == [0.0]
    for output in outputs:
        metrics = output.as_dict()["metrics"]
        assert set(metrics) == {"generate_sequences", "tool_calls", "compute_score",
                                "num_preempted"}


def test_two_workers_outputs_concat_and_feed_the_managers_metrics(tool_batch, tiny_tokenizer):
    pad = tiny_tokenizer.pad_token_id
    samples, items = tool_batch.samples, tool_batch.items
    halves = [slice(0, N), slice(N, 3 * N)]  # data source "a" (acc) and "b" (length)

    def worker_batch(part, budget, keys=None):
        return to_verl_batch(samples[part], items=items[part], pad_token_id=pad,
                             max_prompt_len=P, max_response_len=budget,
                             reward_extra_keys=keys)
    with pytest.raises(AssertionError, match="'length' is not present"):  # verl's own check
        DataProto.concat([worker_batch(h, R) for h in halves])  # unpinned: columns differ
    keys = ["acc", "length", "score"]
    outs = [worker_batch(h, R, keys) for h in halves]
    merged = DataProto.concat(outs)
    assert len(merged) == len(samples)
    timing = AgentLoopManager.__new__(AgentLoopManager)._performance_metrics(
        [o.meta_info["metrics"] for o in outs], merged)
    assert timing["agent_loop/num_preempted/max"] == -1
    assert timing["agent_loop/generate_sequences/max"] > 0
    assert timing["agent_loop/tool_calls/max"] > 0
    reward, extra = extract_reward(merged)
    assert set(extra) == set(keys) and reward.shape == (len(samples), R)
    assert np.isnan(extra["acc"][N + 1])  # data source "b" has no acc: NaN, never missing


def test_overlong_counts_never_reach_meta_info(tool_batch, tiny_tokenizer):
    samples, items = tool_batch.samples, tool_batch.items
    budget = max(len(s.response_ids) for s in samples[:N]) - 1
    keys = ["acc", "length", "score"]
    outs = [to_verl_batch(samples[p], items=items[p], pad_token_id=tiny_tokenizer.pad_token_id,
                          max_prompt_len=P, max_response_len=budget, reward_extra_keys=keys)
            for p in (slice(0, N), slice(N, 3 * N))]
    over = [int(o.non_tensor_batch["rollout_overlong"].sum()) for o in outs]
    assert over[0] >= 1 and over[0] != over[1]
    merged = DataProto.concat(outs)  # asserted "Conflicting values" before
    assert int(merged.non_tensor_batch["rollout_overlong"].sum()) == sum(over)


def trainer_batch(samples, items, pad) -> DataProto:
    data = to_verl_batch(samples, items=items, pad_token_id=pad, max_prompt_len=P,
                         max_response_len=R)
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    return data


def first_token_advantage(data: DataProto) -> np.ndarray:
    adv = data.batch["advantages"]
    mask = data.batch["response_mask"]
    first = mask.argmax(dim=1)
    return (adv[torch.arange(len(adv)), first] * (mask.sum(1) > 0)).numpy()


def test_grpo_masked_estimator_agrees_with_group_advantages(tool_batch, tiny_tokenizer):
    register_estimators()

    samples, items = tool_batch.samples, tool_batch.items
    pad = tiny_tokenizer.pad_token_id
    ours = group_advantages(samples)
    algo = OmegaConf.create({"norm_adv_by_std_in_grpo": True})
    masked = compute_advantage(trainer_batch(samples, items, pad), adv_estimator=GRPO_MASKED,
                               config=algo)
    got = first_token_advantage(masked)
    diff = float(np.abs(got - ours).max())
    print(f"grpo_masked vs group_advantages: max abs diff {diff:.3g}")
    assert diff < 1e-5, diff
    np.testing.assert_allclose(ours[:3], [1.1547, -0.57735, -0.57735], atol=1e-4)
    assert ours[2 * N] == 0.0  # group 2 has one valid sample: no signal
    plain = first_token_advantage(compute_advantage(trainer_batch(samples, items, pad),
                                                    adv_estimator="grpo", config=algo))
    np.testing.assert_allclose(plain[:3], [1.5, -0.5, -0.5], atol=1e-4)  # failure counted as 0
    assert plain[2 * N] == pytest.approx(1.5, abs=1e-4)  # three failures counted as 0
    valid = [i for i, s in enumerate(samples) if not s.masked]
    dropped = first_token_advantage(compute_advantage(
        trainer_batch(samples, items, pad).select_idxs(valid), adv_estimator="grpo",
        config=algo))  # dropping masked rows is not enough: a group of one gets mean 0 / std 1
    assert dropped[valid.index(2 * N)] == pytest.approx(1.0, abs=1e-4)
    adv = masked.batch["advantages"]
    assert not adv[masked.batch["response_mask"].sum(1) == 0].any()


def test_policy_loss_ignores_masked_samples_and_metrics_run(tool_batch, tiny_tokenizer):
    register_estimators()

    samples, items = tool_batch.samples, tool_batch.items
    data = compute_advantage(trainer_batch(samples, items, tiny_tokenizer.pad_token_id),
                             adv_estimator=GRPO_MASKED,
                             config=OmegaConf.create({"norm_adv_by_std_in_grpo": True}))
    old = data.batch["rollout_log_probs"]
    new = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0))
    loss_cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2,
                                 "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                                 "global_batch_info": {}})
    vanilla = core_algos.get_policy_loss_fn("vanilla")

    def loss(rows):
        pg_loss, _ = vanilla(old[rows], new[rows], data.batch["advantages"][rows],
                             data.batch["response_mask"][rows], "token-mean", loss_cfg)
        return float(pg_loss)

    valid = [i for i, s in enumerate(samples) if not s.masked]
    # float32 sums over different row sets differ in their last bits (1.3e-6 relative seen)
    assert loss(list(range(len(samples)))) == pytest.approx(loss(valid), rel=1e-5)
    for mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        every = core_algos.agg_loss(data.batch["advantages"], data.batch["response_mask"], mode)
        kept = core_algos.agg_loss(data.batch["advantages"][valid],
                                   data.batch["response_mask"][valid], mode)
        assert float(every) == pytest.approx(float(kept), rel=1e-6, abs=1e-9), mode
    metrics = compute_data_metrics(data, use_critic=False)
    assert metrics["num_turns/max"] >= 4 and metrics["response_length/max"] > 0
    assert metrics["critic/score/max"] == 1.0


def test_from_verl_batch_maps_rows_and_uids_in_verls_order(tool_batch, tiny_tokenizer):
    # verl's own repeat: uid per prompt, each row n times (interleaved), then shuffled
    prompts = DataProto.from_dict(tensors={"dummy_tensor": torch.zeros(3, 1, dtype=torch.uint8)},
                                  non_tensors={
        "raw_prompt": np.array([r["messages"] for r in tool_rows()] + [None], dtype=object)[:3],
        "uid": np.array(["u0", "u1", "u2"], dtype=object),
        "index": np.array([7, 8, 9]),
        "agent_name": np.array(["tool_agent"] * 3, dtype=object),
        "data_source": np.array(["a", "b", "b"], dtype=object),
        "reward_model": np.array([{"ground_truth": "42"}] * 3, dtype=object),
        "extra_info": np.array([{"split": "train"}] * 3, dtype=object),
        "tools_kwargs": np.array([{}] * 3, dtype=object)})
    repeated = prompts.repeat(repeat_times=2, interleave=True)
    order = [0, 2, 1, 4, 3, 5]  # one uid's rows not adjacent
    shuffled = repeated.select_idxs(order)
    items = from_verl_batch(shuffled, config={"seed": 3})
    uids = shuffled.non_tensor_batch["uid"].tolist()
    assert [it.group_id for it in items] == uids
    assert [it.uid for it in items] == ["u0-0", "u1-0", "u0-1", "u2-0", "u1-1", "u2-1"]
    assert len({it.sampling.seed for it in items}) == len(items)
    first = items[0].data
    assert first.messages == tool_rows()[0]["messages"] and first.ground_truth == "42"
    assert first.extra["agent_name"] == "tool_agent" and first.extra["index"] == 7
    assert first.extra["extra_info"] == {"split": "train"}

    async def reply(item, ctx):  # stand-in rollout: one token per sample, reward by position
        item.artifacts[artifacts.PROMPT_IDS] = [5, 6]
        item.artifacts[artifacts.RESPONSE_IDS] = [7]
        item.artifacts[artifacts.RESPONSE_MASK] = [1]
        item.artifacts[artifacts.REWARD] = float(item.sample_index)
    result = asyncio.run(Pipeline([reply]).run_batch(items))
    out = to_verl_batch(result.samples, items=result.items, pad_token_id=0, max_prompt_len=4,
                        max_response_len=2)
    assert out.non_tensor_batch["uid"].tolist() == uids
    # the trainer's own union with its input batch (same uid values, same input columns)
    merged = shuffled.union(out)
    assert merged.non_tensor_batch["index"].tolist() == [7, 8, 7, 9, 8, 9]
    assert merged.non_tensor_batch["raw_prompt"][0] == tool_rows()[0]["messages"]


def test_moe_batch_routes_go_through_verls_postprocessing(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from pipeline.models import ensure_tiny_moe_model

    model_dir = ensure_tiny_moe_model(tmp_path_factory.mktemp("moe") / "tiny-moe")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    engine = TransformersEngine(model, tokenizer, capture_routes=True)

    async def fail_one(item, ctx):
        if item.sample_index == 1:
            raise RuntimeError("tool crashed")

    async def score(item, ctx):
        item.artifacts[artifacts.REWARD] = float(item.sample_index)

    pipe = Pipeline([BuildPrompt(), Generate(), fail_one, score], engine=engine,
                    tokenizer=tokenizer, sampling={"max_tokens": 6})

    async def go():
        try:
            return await pipe.run_batch([{"prompt": "hi"}, {"prompt": "a fox"}], n=2)
        finally:
            await engine.aclose()
    result = asyncio.run(go())
    pad = tokenizer.pad_token_id
    outputs = to_verl_outputs(result.samples, items=result.items, pad_token_id=pad)
    raw = [list(it.data.messages) for it in result.items]
    theirs = verl_postprocess(bare_worker(tokenizer), outputs, raw)
    ours = to_verl_batch(result.samples, items=result.items, pad_token_id=pad,
                         max_prompt_len=P, max_response_len=R, uid_key=None)
    assert_same(ours, theirs, skip={"rollout_overlong"})
    routed = ours.batch["routed_experts"]
    assert routed.shape[:2] == (4, P + R) and routed.any()
    assert [s.masked for s in result.samples] == [False, True, False, True]
    assert re.fullmatch(r"torch\.int\d+", str(routed.dtype))
