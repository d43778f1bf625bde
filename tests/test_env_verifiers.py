"""An environment built on ``verifiers`` 0.4.0, run through the proxy (issue 39).

verifiers pins ``mcp==2.0.0`` and ``openai<3`` (the project resolves mcp 2.3 and openai 3), so
it lives in an interpreter of its own, ``.venv-verifiers`` (scripts/setup.sh). Its environment
runs as a ``RemoteAgent`` program there (``tests/verifiers_env/run_episode.py``): one verifiers
episode per sample, its model client pointed at the sample's proxy session; the program
prints the reward verifiers' scoring computed, and ``AgentReward`` makes it the sample's.

The environment (``tests/verifiers_env/arith_taskset.py``) is a verifiers taskset of three
arithmetic rows (local data), a ``@vf.reward`` function and a harness that asks the model
once. The tiny model (TransformersEngine) writes the replies, restricted to scripted texts
(a random-weight model writes no number by itself): the right answer to one row, a wrong
one to another, so verifiers scores a 1 and a 0. Checked: the sample is token-exact against
the engine's own log, its reward is what verifiers computed (and what its reward function
says of the decoded reply), the program reached nothing but 127.0.0.1 (network audit), and
a row naming no task fails alone, with the program's reason.
Marked ``slow``: ``import verifiers.v1`` takes several seconds per program.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _proxy_fixtures import (
    RecordingEngine,
    Script,
    Served,
    assert_token_exact,
    audit,
    audited_env,
    session_requests,
)

from pipeline import Pipeline, SimulatedEngine, Status
from pipeline.proxy import (
    FINAL_ANSWER,
    SEGMENTS,
    AgentEndpoint,
    AgentReward,
    ProxyServer,
    RemoteAgent,
)
from pipeline.testing import ByteTokenizer

pytest_plugins = ["_model_fixtures"]

ENV_DIR = Path(__file__).with_name("verifiers_env")
VF_PYTHON = Path(__file__).resolve().parents[1] / ".venv-verifiers" / "bin" / "python"
needs_verifiers = pytest.mark.skipif(
    not VF_PYTHON.exists(), reason="verifiers 0.4.0 is not installed in .venv-verifiers "
    "(scripts/setup.sh installs it; ROLLOUT_SKIP_VERIFIERS=1 skipped it)")

# The taskset's rows (tests/verifiers_env/arith_taskset.py): prompt marker -> scripted reply.
REPLIES = {"2 + 3": "5", "7 + 8": "16"}  # 5 is right (reward 1), 16 is wrong (reward 0)
ANSWERS = {"2 + 3": "5", "7 + 8": "15"}


class ArithScript(Script):
    """The reply each verifiers row gets from the tiny model."""

    def texts(self, prompt_ids: list[int]) -> list[str]:
        text = self.tokenizer.decode(prompt_ids)
        return [reply for marker, reply in REPLIES.items() if marker in text]


@pytest.mark.slow
@needs_verifiers
async def test_verifiers_environment_through_the_proxy(make_engine, tiny_tokenizer,
                                                       tmp_path: Path):
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=ArithScript(tok)))
    served = Served(engine, tok)
    log, home = tmp_path / "net.jsonl", tmp_path / "home"
    home.mkdir()
    env = audited_env(log, home)
    env["PYTHONPATH"] = f"{ENV_DIR}:{env['PYTHONPATH']}"  # the taskset, by its id
    agent = RemoteAgent([str(VF_PYTHON), str(ENV_DIR / "run_episode.py"), "arith_taskset"],
                        proxy=served.proxy, env=env, cwd=str(tmp_path), timeout_s=100,
                        answer_message=False)
    # Task 7 does not exist: the program exits with its reason, that sample alone fails.
    rows = [{"prompt": f"verifiers task {i}", "extra": {"verifiers_task": i}} for i in (0, 1, 7)]
    async with served.proxy:
        pipe = Pipeline([agent, AgentReward()], engine=engine, tokenizer=tok,
                        sampling={"max_tokens": 16}, sample_timeout_s=110)
        result = await pipe.run_batch(rows, n=1)

    assert result.stats.by_status == {"completed": 2, "failed": 1}, (
        [s.error for s in result.samples],
        [i.artifacts.get("proxy.agent_log", "")[-2000:] for i in result.items])
    (missing,) = [s for s in result.samples if s.status is Status.FAILED]
    assert missing.reward is None
    assert "extra.verifiers_task must be a task index of 'arith_taskset' (0..2), got 7" in (
        missing.error or "")
    events = audit(log)
    assert {e["host"] for e in events if e["event"] == "connect"
            and e["target"].startswith("(")} == {"127.0.0.1"}
    assert served.statuses and max(served.statuses) < 500, served.statuses
    rewards = []
    for sample, item in zip(result.samples, result.items, strict=True):
        if sample is missing:
            continue
        sent = session_requests(engine, sample.extra_fields["proxy_session"])
        (segment,) = item.artifacts[SEGMENTS]
        assert_token_exact([segment], sent)
        assert (sample.prompt_ids, sample.response_ids, sample.logprobs) == (
            segment.prompt_ids, segment.response_ids, segment.logprobs)
        assert sample.status is Status.COMPLETED
        (marker,) = [m for m in REPLIES if m in tok.decode(sample.prompt_ids)]
        reply = tok.decode(sample.response_ids, skip_special_tokens=True).strip()
        report = json.loads(item.artifacts[FINAL_ANSWER])
        assert report["reply"] == reply == REPLIES[marker]  # what verifiers scored
        assert sample.reward == report["reward"] == report["rewards"]["correct"]
        assert sample.reward == (1.0 if reply == ANSWERS[marker] else 0.0)
        rewards.append(sample.reward)
    assert sorted(rewards) == [0.0, 1.0]


def _reporting(answer: str | None) -> Any:
    """An in-process agent: one model call, then ``answer`` as its final answer."""
    async def agent(endpoint: AgentEndpoint) -> str | None:
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as client:
            await client.chat.completions.create(
                model=endpoint.model, messages=endpoint.task["messages"])
        return answer
    return agent


async def test_agent_reward_reads_the_report_and_fails_a_sample_without_one():
    tok = ByteTokenizer()
    engine = SimulatedEngine(responder=lambda ids, rng: [*tok.encode("ok"), tok.eos_token_id])
    answers = ['{"reward": 0.25, "passed": 3}', "done", '{"reward": true}', None]
    async with ProxyServer(engine, tok) as proxy:
        results = []
        for answer in answers:
            pipe = Pipeline([RemoteAgent(_reporting(answer), proxy=proxy, answer_message=False),
                             AgentReward()], engine=engine, tokenizer=tok)
            results.append(await pipe.run_batch([{"prompt": "go"}], n=1))
    good = results[0]
    assert good.samples[0].status is Status.COMPLETED and good.samples[0].reward == 0.25
    assert good.items[0].artifacts["reward_payload"] == {"reward": 0.25, "passed": 3,
                                                         "score": 0.25}
    for result, shown in zip(results[1:], ["'done'", "'{\"reward\": true}'", "nothing"],
                             strict=True):
        (sample,) = result.samples
        assert sample.status is Status.FAILED
        assert "reported no reward" in (sample.error or "") and shown in (sample.error or "")


def test_agent_reward_needs_remote_agent_before_it():
    from pipeline import StageDefinitionError

    with pytest.raises(StageDefinitionError, match="RemoteAgent"):
        Pipeline([AgentReward()], engine=SimulatedEngine(), tokenizer=ByteTokenizer())

