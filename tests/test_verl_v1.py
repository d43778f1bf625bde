"""verl 0.9.1's V1 (TransferQueue) worker post-processing on our outputs, on a local Ray.

verl's default trainer path (``trainer.use_v1``) puts each agent-loop output into
TransferQueue through ``AgentLoopWorkerTQ._agent_loop_postprocess``: ``as_dict()`` (which
writes ``rm_scores[-1]`` and keeps only explicitly set metrics), the sequence tensors and a
status tag. One Ray cluster (2 CPUs, 127.0.0.1) and one TransferQueue storage unit for the
module; the worker class is verl's, with the attributes its post-processing reads set by hand.
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")
torch = pytest.importorskip("torch")

from pipeline import BuildPrompt, Generate, Pipeline, SimulatedEngine, artifacts  # noqa: E402
from pipeline.batch import to_verl_outputs  # noqa: E402
from pipeline.integrations.verl import register_estimators  # noqa: E402
from pipeline.testing import ByteTokenizer  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time (tests/conftest.py)


async def fail_early(item, ctx):
    if item.sample_index == 1:
        raise RuntimeError("sandbox never started")  # a token-less failed sample


async def judge(item, ctx):
    item.artifacts[artifacts.REWARD] = float(item.sample_index == 0)
    item.artifacts[artifacts.REWARD_PAYLOAD] = {"score": float(item.sample_index == 0),
                                                "acc": item.sample_index == 0}


@pytest.fixture(scope="module")
def tq(ray_cluster):
    """TransferQueue on the session's Ray cluster (tests/conftest.py)."""
    register_estimators()  # imports verl without its import-time warnings
    import transfer_queue

    transfer_queue.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    yield transfer_queue
    transfer_queue.close()


def test_v1_worker_stores_every_sample_with_scores_and_metrics(tq):
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    pipe = Pipeline([fail_early, BuildPrompt(offload=False), Generate(), judge],
                    engine=SimulatedEngine(latency_s=0.001, latency_sigma=0, tail_prob=0),
                    tokenizer=ByteTokenizer(), sampling={"max_tokens": 8})
    result = asyncio.run(pipe.run_batch([{"prompt": "hi"}, {"prompt": "bye"}], n=3))
    assert not result.samples[1].response_ids  # failed before its prompt was built
    outputs = to_verl_outputs(result.samples, items=result.items, pad_token_id=0)

    worker = AgentLoopWorkerTQ.__ray_metadata__.modified_class.__new__(
        AgentLoopWorkerTQ.__ray_metadata__.modified_class)
    worker.processor, worker.reward_loop_worker_handles = None, None
    worker.distillation_enabled = False
    keys = []

    async def put_all():
        for sample, output in zip(result.samples, outputs, strict=True):
            await worker._agent_loop_postprocess(
                output, False, uid=sample.group_id, session_id=sample.uid[-1], global_steps=3,
                raw_prompt=[{"role": "user", "content": "hi"}])
            keys.append(f"{sample.group_id}_{sample.uid[-1]}_0")
    asyncio.run(put_all())

    listed = tq.kv_list(partition_id="train")["train"]
    assert set(keys) <= set(listed)
    assert all(listed[k]["status"] == "success" for k in keys)
    data = tq.kv_batch_get(keys=keys, partition_id="train",
                           select_fields=["rm_scores", "response_mask", "metrics",
                                          "extra_fields", "num_turns"])
    for i, sample in enumerate(result.samples):
        scores = data["rm_scores"][i]
        assert float(scores.sum()) == (0.0 if sample.masked else sample.reward)
        assert (not sample.masked) == bool(data["response_mask"][i].sum())
    metrics = list(data["metrics"])
    assert all(set(m) == {"generate_sequences", "tool_calls", "compute_score", "num_preempted"}
               for m in metrics)  # as_dict keeps only fields set explicitly
    assert all(m["num_preempted"] == -1 for m in metrics)
    extras = list(data["extra_fields"])
    assert {tuple(sorted(e["reward_extra_info"])) for e in extras} == {("acc", "score")}
    assert [e["rollout_status"] for e in extras] == [s.status.value for s in result.samples]
