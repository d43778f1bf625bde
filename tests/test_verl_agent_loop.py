"""Our agent loop inside verl 0.9.1's own rollout workers, on a local Ray (2 CPUs, 127.0.0.1).

Only the inference server is a stand-in (``_verl_server.StandInServer``: verl's server
``generate`` signature over our TransformersEngine on the tiny model). Everything else is
verl's: its load balancer actor and ``LLMServerClient``, ``AgentLoopWorker.generate_sequences``
(DataProto path) and the V1 ``AgentLoopWorkerTQ`` with a local TransferQueue, both loading
our agent loop from an ``agent_loop_config_path`` YAML through ``hydra.utils.instantiate``.
One Ray cluster, one server and one TransferQueue for the module.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("verl")
pytest.importorskip("transfer_queue")
torch = pytest.importorskip("torch")

import _verl_server  # noqa: E402

from pipeline import ConfigError  # noqa: E402
from pipeline.integrations.verl import register_agent_loop, register_estimators  # noqa: E402

pytest_plugins = ["_model_fixtures"]
pytestmark = [
    pytest.mark.xdist_group("ray"),  # one Ray cluster at a time (tests/conftest.py)
    # the first test sets up the module's Ray actor, TransferQueue and torch warm-up: past
    # the suite's 120 s once beside other work (three workers, two cores)
    pytest.mark.timeout(300),
]

P, R = 384, 160  # rollout.prompt_length / response_length
N = 2  # rollouts per prompt
TIMEOUT_S = 8.0  # the agent's sample_timeout_s; the SLOW sample needs 40 x SLOW_STEP_S
SLOW_STEP_S = 0.3  # 12 s: past the timeout; the others have 8 s (5 s timed all six out in
# one fresh-clone CI run, the vLLM group restarting an engine on the other core)

BROKEN = {  # YAML entry -> a factory that fails one way (issue 33 item 9)
    "missing_module": "_verl_no_such_module.make",
    "import_raises": "_verl_import_raises.make",
    "import_dep": "_verl_import_dep.make",
    "import_exits": "_verl_import_exits.make",
    "factory_raises": "_verl_agents.raising_factory",
    "factory_exits": "_verl_agents.exits_factory",
    "returns_none": "_verl_agents.returns_none",
    "returns_stage": "_verl_agents.returns_stage",
    "async_factory": "_verl_agents.async_factory",
    "returns_mapping": "_verl_agents.returns_mapping",
    "misses_a_provider": "_verl_agents.misses_a_provider",
}

AGENTS_YAML = f"""\
- name: tool_agent
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.tool_agent
  factory_kwargs: {{max_turns: 2}}
  sample_timeout_s: {TIMEOUT_S}
  sampling: {{max_tokens: 40}}
  judges: true
  reward_extra_keys: [acc]
- name: typo_agent
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.tool_agnet
- name: custom_reward
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.custom_reward
  sampling: {{max_tokens: 8}}
  reward_extra_keys: [acc, n]
- name: custom_reward_off
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.custom_reward
  sampling: {{max_tokens: 8}}
  judges: false
- name: nested_judge
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.nested_judge
  sampling: {{max_tokens: 40}}  # the forced call ends (a cut turn would leave the Loop)
- name: plain_failing
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.plain_failing
  sampling: {{max_tokens: 8}}
- name: silent_sometimes
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.silent_sometimes
  sampling: {{max_tokens: 8}}
- name: score_only
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.score_only
- name: routed
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.routed
  sampling: {{max_tokens: 40}}
- name: tools
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: _verl_agents.routed
  sampling: {{max_tokens: 40}}
""" + "".join(f"""- name: {name}
  _target_: pipeline.integrations.verl.PipelineAgentLoop
  factory: {factory}
""" for name, factory in BROKEN.items())


def verl_config(model_dir, agents_yaml):
    """verl's generated PPO trainer config with the few fields a rollout worker reads."""
    import verl
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config",
                                      "_generated_ppo_trainer.yaml"))
    rollout = cfg.actor_rollout_ref.rollout
    rollout.name, rollout.prompt_length, rollout.response_length, rollout.n = "vllm", P, R, N
    rollout.agent.agent_loop_config_path = str(agents_yaml)
    rollout.agent.default_agent_loop = "tool_agent"
    cfg.actor_rollout_ref.model.path = str(model_dir)
    cfg.data.max_prompt_length, cfg.data.max_response_length = P, R
    return cfg


@pytest.fixture(scope="module")
def verl_env(tmp_path_factory, tiny_model_dir, ray_cluster):
    register_estimators()  # imports verl without its import-time warnings
    import transfer_queue
    from verl.workers.rollout.router import get_router_handle

    model_dir = tiny_model_dir
    agents_yaml = tmp_path_factory.mktemp("verl") / "agents.yaml"
    agents_yaml.write_text(AGENTS_YAML)
    ray = ray_cluster  # the session's cluster (tests/conftest.py)
    ray.cloudpickle.register_pickle_by_value(sys.modules["_verl_server"])
    server = None
    try:
        server = ray.remote(_verl_server.StandInServer).options(num_cpus=0).remote(
            str(model_dir), slow_step_s=SLOW_STEP_S)  # starts while TransferQueue does
        transfer_queue.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
        ray.get(server.generate.remote([1, 2, 3], {"max_tokens": 4}, "warm-up"))  # torch's
        # first steps take seconds: the samples' timeouts must not pay for them
        balancer = get_router_handle(servers={"stand-in:0": server})
        ray.get(balancer.get_all_servers.remote())  # its process has started
        yield SimpleNamespace(ray=ray, tq=transfer_queue, server=server, balancer=balancer,
                              config=verl_config(model_dir, agents_yaml))
        transfer_queue.close()
    finally:
        if server is not None:
            ray.kill(server)


def client(env):
    from verl.workers.rollout.llm_server import LLMServerClient

    return LLMServerClient(config=env.config, load_balancer_handle=env.balancer)


def rows(n_prompts=3):
    return [{"raw_prompt": [{"role": "user", "content": f"Q{i}: what is 6 * 7?"}],
             "data_source": "arith", "reward_model": {"ground_truth": "42"},
             "extra_info": {"row": i}, "index": i}
            for i in range(n_prompts)]


def dataproto(data, agent):
    from verl.protocol import DataProto

    cols = {k: [r[k] for r in data] for k in data[0]}
    non_tensors = {}
    for key, values in cols.items():
        column = np.empty(len(values), dtype=object)
        column[:] = values
        non_tensors[key] = column
    non_tensors["index"] = np.array(cols["index"], dtype=np.int64)
    non_tensors["uid"] = np.array([f"p{r['index']}-{os.urandom(3).hex()}" for r in data],
                                  dtype=object)
    non_tensors["agent_name"] = np.array([agent] * len(data), dtype=object)
    batch = DataProto.from_dict(non_tensors=non_tensors, meta_info={"global_steps": 7})
    return batch.repeat(N, interleave=True)  # as RayPPOTrainer does before generating


def k_of(statuses):
    """Within each group (consecutive rows), which rollout ended how."""
    return [statuses[i:i + N] for i in range(0, len(statuses), N)]


def slow_call_stopped(env, started):
    """The SLOW request's server coroutine was cancelled at the sample's timeout and no
    engine step ran after it."""
    calls = [c for c in env.ray.get(env.server.slow_calls.remote()).values()
             if c["start"] >= started]
    assert len(calls) == 1, calls
    call = calls[0]
    assert call["how"] == "cancelled", call
    assert call["steps"] < call["max_tokens"]
    assert call["end"] - call["start"] < TIMEOUT_S + 2.0
    time.sleep(2.5 * SLOW_STEP_S)  # a call still running would have taken another step
    again = next(c for c in env.ray.get(env.server.slow_calls.remote()).values()
                 if c["start"] >= started)
    assert again["steps"] == call["steps"]
    assert env.ray.get(env.server.inflight.remote()) == 0


def first_token_advantages(scores, mask, uids, estimator):
    """verl's GRPO estimator on one score per row (at the row's last token), as the
    trainer hands it ``token_level_rewards``; returns each row's advantage (0 if masked)."""
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    last = (mask.shape[1] - 1 - torch.flip(mask, [1]).argmax(dim=1)).clamp(min=0)
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    adv, _ = estimator(token_level_rewards=rewards, response_mask=mask,
                       index=np.array(uids, dtype=object))
    return [float(adv[i][mask[i].bool()][0]) if mask[i].any() else 0.0 for i in range(len(adv))]


def check_grpo(scores, mask, uids):
    """The failed and timed-out samples carry no loss; verl's GRPO counts them as reward 0,
    ours leaves them out."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from pipeline.batch import masked_grpo_advantage

    verl_adv = first_token_advantages(scores, mask, uids, compute_grpo_outcome_advantage)
    ours = first_token_advantages(scores, mask, uids, masked_grpo_advantage)
    # groups: Q0 [0, 1]; Q1 [failed, 1]; Q2 [timed out, 1]
    assert verl_adv[0] == pytest.approx(-0.7071, abs=1e-3)
    assert verl_adv[1] == pytest.approx(0.7071, abs=1e-3)
    assert verl_adv[3] == pytest.approx(0.7071, abs=1e-3)  # the failure counted as a 0
    assert ours[:2] == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    assert ours[3] == 0.0 and ours[5] == 0.0  # alone in their group once masked ones leave
    assert verl_adv[2] == verl_adv[4] == ours[2] == ours[4] == 0.0  # masked: no loss


def test_dataproto_worker_runs_our_stage_list_with_isolation(verl_env):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(verl_env.config, llm_client=client(verl_env))
    batch = dataproto(rows(), "tool_agent")
    started = time.time()
    out = asyncio.run(worker.generate_sequences(batch))  # verl's gather: one raise fails all
    wall = time.time() - started
    nt = out.non_tensor_batch
    assert len(out) == 3 * N and list(nt["uid"]) == list(batch.non_tensor_batch["uid"])
    statuses = k_of(list(nt["rollout_status"]))
    assert statuses == [["completed", "completed"], ["failed", "completed"],
                        ["timeout", "completed"]]
    assert list(nt["agent"]) == ["tool_agent"] * 6
    mask = out.batch["response_mask"]
    masked = [bool(m) for m in nt["rollout_masked"]]
    assert masked == [False, False, True, False, True, False]
    assert all(bool(mask[i].any()) != masked[i] for i in range(6))
    assert all(t >= 4 for t, m in zip(nt["__num_turns__"], masked, strict=True) if not m)
    scores = out.batch["rm_scores"].sum(dim=1).tolist()
    assert scores == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert out.meta_info["reward_extra_keys"] == ["acc"]
    assert [bool(a) for i, a in enumerate(nt["acc"]) if not masked[i]] == [False, True, True,
                                                                           True]
    assert np.isnan(nt["acc"][2]) and np.isnan(nt["acc"][4])
    assert "rollout_log_probs" in out.batch.keys()
    steps = list(nt["min_global_steps"]), list(nt["max_global_steps"])
    assert steps[0] == steps[1] == [7, 7, 7, 7, None, 7]  # the timed-out one never got a reply
    assert [m["num_preempted"] for m in out.meta_info["metrics"]] == [-1] * 6
    slow_call_stopped(verl_env, started)
    check_grpo(scores, mask, list(nt["uid"]))
    print(f"DataProto path: 6 samples in {wall:.1f}s (one waits out its {TIMEOUT_S}s timeout)")


def test_v1_worker_stores_every_sample_and_marks_no_group_failed(verl_env):
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils import tensordict_utils as tu

    tq = verl_env.tq
    worker = AgentLoopWorkerTQ.__ray_metadata__.modified_class(
        verl_env.config, llm_client=client(verl_env))
    data = rows()
    uids = [f"v1p{r['index']}-{os.urandom(3).hex()}" for r in data]
    columns = {k: np.array([r[k] for r in data] if k != "raw_prompt" else
                           [None] * len(data), dtype=object) for k in data[0]}
    for i, r in enumerate(data):
        columns["raw_prompt"][i] = r["raw_prompt"]
    columns["index"] = np.array([r["index"] for r in data], dtype=np.int64)
    columns["uid"] = np.array(uids, dtype=object)
    columns["agent_name"] = np.array(["tool_agent"] * len(data), dtype=object)
    batch = tu.get_tensordict(columns)
    tu.assign_non_tensor_data(batch, "global_steps", 7)
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": 7}] * 3)
    started = time.time()

    async def generate():
        await worker.generate_sequences(batch)  # fire and forget, as verl's manager calls it
        await asyncio.gather(*list(worker.background_tasks))
    asyncio.run(generate())
    wall = time.time() - started

    listed = tq.kv_list(partition_id="train")["train"]
    assert [listed[u]["status"] for u in uids] == ["finished"] * 3  # not "failure"
    keys = [f"{u}_{k}_0" for u in uids for k in range(N)]
    tags = [listed[key] for key in keys]
    assert all(t["status"] == "success" for t in tags)
    assert [t["min_global_steps"] for t in tags] == [7] * 6  # the V1 trainer casts to int
    assert [t["max_global_steps"] for t in tags] == [7] * 6
    got = tq.kv_batch_get(keys=keys, partition_id="train",
                          select_fields=["rm_scores", "response_mask", "extra_fields"])
    extras = list(got["extra_fields"])
    statuses = k_of([e["rollout_status"] for e in extras])
    assert statuses == [["completed", "completed"], ["failed", "completed"],
                        ["timeout", "completed"]]
    assert {e["agent"] for e in extras} == {"tool_agent"}
    assert all(set(e["reward_extra_info"]) == {"acc"} for e in extras)
    masks = [torch.as_tensor(m) for m in got["response_mask"]]
    scores = [float(torch.as_tensor(s).sum()) for s in got["rm_scores"]]
    assert scores == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert [bool(m.any()) for m in masks] == [True, True, False, True, False, True]
    slow_call_stopped(verl_env, started)
    mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    check_grpo(scores, mask, [u for u in uids for _ in range(N)])
    print(f"V1 path: 6 samples in {wall:.1f}s")


def test_a_yaml_entry_naming_a_missing_factory_fails_at_once(verl_env):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    before = verl_env.ray.get(verl_env.server.request_count.remote())
    worker = AgentLoopWorker(verl_env.config, llm_client=client(verl_env))
    with pytest.raises(Exception, match="typo_agent") as info:
        asyncio.run(worker.generate_sequences(dataproto(rows(1), "typo_agent")))
    assert "_verl_agents" in str(info.value) and "'tool_agnet'" in str(info.value)
    assert verl_env.ray.get(verl_env.server.request_count.remote()) == before


def test_registered_entry_without_judge_leaves_scoring_to_verl(verl_env):
    """``register_agent_loop`` (verl's registry of this process); no Judge: reward_score
    None for every sample; a turn cut at max_tokens is ``length`` though verl's server says
    ``completed``."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    with pytest.raises(ConfigError, match=r"plain_typo.*'_verl_agents' has no attribute "
                                          "'plain_agnet'"):
        register_agent_loop("plain_typo", "_verl_agents.plain_agnet")
    register_agent_loop("plain", "_verl_agents.plain_agent", sampling={"max_tokens": 8})
    worker = AgentLoopWorker(verl_env.config, llm_client=client(verl_env))
    out = asyncio.run(worker.generate_sequences(dataproto(rows(2), "plain")))
    nt = out.non_tensor_batch
    assert list(nt["rollout_status"]) == ["completed"] * 4
    assert list(nt["rollout_finish_reason"]) == ["length"] * 4  # forced call cut at 8 tokens
    assert "rm_scores" not in out.batch.keys()  # verl's reward loop scores them
    assert [int(m.sum()) for m in out.batch["response_mask"]] == [8] * 4
    assert list(nt["agent"]) == ["plain"] * 4


def r_rows(n_prompts=3, **columns):
    """Prompts ``R<i>`` (see ``_verl_agents``: ``R0``'s first rollout fails first)."""
    data = rows(n_prompts)
    for r in data:
        r["raw_prompt"] = [{"role": "user", "content": f"R{r['index']}: what is 6 * 7?"}]
        for key, values in columns.items():
            r[key] = values[r["index"]]
    return data


def generate(env, data, agent):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(env.config, llm_client=client(env))
    batch = dataproto(data, agent)
    if not isinstance(agent, str):
        batch.non_tensor_batch["agent_name"] = np.array(
            [a for a in agent for _ in range(N)], dtype=object)
    return asyncio.run(worker.generate_sequences(batch)).non_tensor_batch, batch


def test_item2_custom_stage_reward_reaches_verl(verl_env):
    """A bare async function stage writes ``artifacts.REWARD`` (no ``Judge``, no ``judges``
    option): verl's worker gets every score, a 0.0 included, as ``rm_scores`` and the pinned
    payload leaves as ``reward_extra_info``; the sample that failed before any other was
    scored gets 0.0 and NaN leaves, so the worker's batch stays whole."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(verl_env.config, llm_client=client(verl_env))
    out = asyncio.run(worker.generate_sequences(dataproto(r_rows(), "custom_reward")))
    nt = out.non_tensor_batch
    assert k_of(list(nt["rollout_status"])) == [["failed", "completed"]] + [
        ["completed", "completed"]] * 2
    assert "rm_scores" in out.batch.keys()
    assert out.batch["rm_scores"].sum(dim=1).tolist() == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert out.meta_info["reward_extra_keys"] == ["acc", "n"]
    assert np.isnan(nt["acc"][0]) and np.isnan(nt["n"][0])
    assert [bool(a) for a in nt["acc"][1:]] == [True, False, True, False, True]
    assert list(nt["n"][1:]) == [8] * 5

    out = asyncio.run(worker.generate_sequences(dataproto(r_rows(1), "score_only")))
    assert out.batch["rm_scores"].sum(dim=1).tolist() == [1.0, 1.0]  # no response tokens
    assert [int(m.sum()) for m in out.batch["response_mask"]] == [0, 0]


def test_item2_custom_stage_reward_reaches_verl_v1(verl_env):
    """The same entry through verl's V1 worker (TransferQueue): each stored sample has its
    ``rm_scores`` and the pinned ``reward_extra_info``; no prompt group is marked failed."""
    listed, got = v1_generate(verl_env, r_rows(), "custom_reward")
    assert set(listed) == {"finished"}
    scores = [float(torch.as_tensor(s).sum()) for s in got["rm_scores"]]
    assert scores == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    extras = list(got["extra_fields"])
    assert all(set(e["reward_extra_info"]) == {"acc", "n"} for e in extras)
    assert np.isnan(extras[0]["reward_extra_info"]["acc"])


def v1_generate(env, data, agent):
    """``data`` through verl's V1 worker; the prompts' statuses and the stored samples."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils import tensordict_utils as tu

    tq = env.tq
    worker = AgentLoopWorkerTQ.__ray_metadata__.modified_class(env.config,
                                                               llm_client=client(env))
    uids = [f"v1r{r['index']}-{os.urandom(3).hex()}" for r in data]
    columns = {k: np.empty(len(data), dtype=object) for k in data[0]}
    for key, column in columns.items():
        column[:] = [r[key] for r in data] if key != "raw_prompt" else [None] * len(data)
    for i, r in enumerate(data):
        columns["raw_prompt"][i] = r["raw_prompt"]
    columns["index"] = np.array([r["index"] for r in data], dtype=np.int64)
    columns["uid"] = np.array(uids, dtype=object)
    columns["agent_name"] = np.array([agent] * len(data), dtype=object)
    batch = tu.get_tensordict(columns)
    tu.assign_non_tensor_data(batch, "global_steps", 7)
    tq.kv_batch_put(keys=uids, partition_id="train",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": 7}] * len(data))

    async def run():
        await worker.generate_sequences(batch)
        await asyncio.gather(*list(worker.background_tasks))
    asyncio.run(run())
    listed = tq.kv_list(partition_id="train")["train"]
    keys = [f"{u}_{k}_0" for u in uids for k in range(N)]
    got = tq.kv_batch_get(keys=keys, partition_id="train",
                          select_fields=["rm_scores", "response_mask", "extra_fields"])
    return [listed[u]["status"] for u in uids], got


def test_item2_judges_false_overrides_a_carried_reward(verl_env):
    """``judges: false``: the stage list's own rewards stay home; verl's reward loop scores
    every sample (no ``rm_scores``, no reward-extra columns from us)."""
    out_nt, _ = generate(verl_env, r_rows(), "custom_reward_off")
    assert "acc" not in out_nt and "reward_extra_info" not in out_nt
    assert list(out_nt["rollout_status"]).count("failed") == 1


def test_item2_judge_nested_in_loop_and_route_reaches_verl(verl_env):
    """A ``Judge`` inside a ``Loop`` inside a ``Route``: every judged sample's 0.0 is handed
    over (0.0 is a score, not "none"), the early failure included."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(verl_env.config, llm_client=client(verl_env))
    out = asyncio.run(worker.generate_sequences(dataproto(r_rows(), "nested_judge")))
    nt = out.non_tensor_batch
    assert list(nt["rollout_status"]).count("completed") == 5
    assert out.batch["rm_scores"].sum(dim=1).tolist() == [0.0] * 6
    assert list(nt["agent"]) == ["nested_judge"] + ["solver"] * 5  # the Route's choice


def test_item2_stage_list_without_reward_leaves_scoring_to_verl(verl_env):
    """No stage scores: every output has ``reward_score=None`` (verl's reward loop scores
    them), the sample that failed first included (a 0.0 beside Nones would split the batch:
    verl builds ``rm_scores`` only when every sample has a score)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(verl_env.config, llm_client=client(verl_env))
    out = asyncio.run(worker.generate_sequences(dataproto(r_rows(), "plain_failing")))
    assert "rm_scores" not in out.batch.keys()
    assert list(out.non_tensor_batch["rollout_status"]).count("failed") == 1


def test_item2_unscored_sample_beside_scored_ones_is_masked(verl_env):
    """A stage list that scores all but one completed sample: that sample is masked with an
    error naming the entry and the ``judges`` option, the others keep their scores (never a
    silent 0.0, never a None that drops the whole worker's ``rm_scores``)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    worker = AgentLoopWorker(verl_env.config, llm_client=client(verl_env))
    out = asyncio.run(worker.generate_sequences(dataproto(r_rows(), "silent_sometimes")))
    nt = out.non_tensor_batch
    masked = [bool(m) for m in nt["rollout_masked"]]
    assert masked == [False, False, False, True, False, False]
    assert not bool(out.batch["response_mask"][3].any())
    assert out.batch["rm_scores"].sum(dim=1).tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_item9_route_in_an_entry_routes_on_the_row(verl_env):
    """A ``Route`` in an entry's stage list routes on the row's own ``agent`` column; without
    one on verl's ``agent_name`` when it names one of the Route's agents (several entries
    sharing one factory), else on the Route's default; never "unknown agent 'routed'"."""
    nt, _ = generate(verl_env, r_rows(agent=["tools", None, "tools"]), "routed")
    assert list(nt["rollout_status"]) == ["completed"] * 6  # None: the default
    assert list(nt["agent"]) == ["tools"] * 2 + ["short"] * 2 + ["tools"] * 2
    assert [t >= 4 for t in nt["__num_turns__"]] == [True] * 2 + [False] * 2 + [True] * 2

    nt, _ = generate(verl_env, r_rows(2), "routed")  # no agent column: the default
    assert list(nt["rollout_status"]) == ["completed"] * 4
    assert list(nt["agent"]) == ["short"] * 4

    nt, _ = generate(verl_env, r_rows(2), ["tools", "routed"])  # verl's agent_name
    assert list(nt["rollout_status"]) == ["completed"] * 4
    assert list(nt["agent"]) == ["tools"] * 2 + ["short"] * 2


@pytest.mark.parametrize(("entry", "says"), [
    ("missing_module", r"cannot import module '_verl_no_such_module'"),
    ("import_raises", r"importing '_verl_import_raises' raised RuntimeError: "
                      r"CUDA_VISIBLE_DEVICES is empty"),
    ("import_dep", r"importing '_verl_import_dep' raised ModuleNotFoundError: No module named "
                   r"'pipeline_no_such_dependency'"),
    ("import_exits", r"importing '_verl_import_exits' raised SystemExit: no config file"),
    ("factory_raises", r"raised ValueError: no API key for the judge"),
    ("factory_exits", r"raised SystemExit: 3"),
    ("returns_none", r"returned None, not a stage list or a Pipeline"),
    ("returns_stage", r"returned one stage, Generate 'generate'.*wrap it in a list"),
    ("async_factory", r"returned a coroutine.*plain function"),
    ("returns_mapping", r"returned \{'solver'.*not a stage list or a Pipeline \(a dict\)"),
    ("misses_a_provider", r"StageDefinitionError: stage 'generate' needs the artifact "
                          r"'prompt_ids'.*BuildPrompt"),
])
def test_item9_every_factory_failure_is_a_config_error_naming_the_entry(verl_env, entry, says):
    """Through verl's worker (YAML entry, ``hydra.utils.instantiate``): whatever way the
    factory fails, the error verl raises carries our ``ConfigError`` naming the entry and the
    cause, and no sample reaches the server."""
    import re

    before = verl_env.ray.get(verl_env.server.request_count.remote())
    with pytest.raises(BaseException) as info:
        generate(verl_env, r_rows(1), entry)
    chain, exc = [], info.value
    while exc is not None and len(chain) < 10:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    ours = [e for e in chain if isinstance(e, ConfigError)]
    assert ours, [repr(e) for e in chain]
    assert f"verl agent loop '{entry}'" in str(ours[0])
    assert re.search(says, str(ours[0])), str(ours[0])
    assert verl_env.ray.get(verl_env.server.request_count.remote()) == before
    if entry.startswith(("missing", "import")):  # resolved at registration already
        with pytest.raises(ConfigError, match=says):
            register_agent_loop(entry, BROKEN[entry])
