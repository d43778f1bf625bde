"""``RemoteAgent`` on the simulated engine: in-process agents, failing and silent agents, and
agents killed with their whole process group on the sample's deadline (real subprocesses and
signals)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp

from pipeline import Pipeline, Status, artifacts
from pipeline.proxy import (
    AGENT_LOG,
    FINAL_ANSWER,
    PROXY_KEY,
    SEGMENTS,
    AgentEndpoint,
    ProxyServer,
    RemoteAgent,
)
from pipeline.testing import ByteTokenizer, SimulatedEngine

TOK = ByteTokenizer()
ROW = {"messages": [{"role": "user", "content": "say hi"}], "ground_truth": "hi"}


def engine() -> SimulatedEngine:
    def reply(prompt_ids: list[int], rng: Any) -> list[int]:
        return [*TOK.encode(f"hi {len(prompt_ids)}"), TOK.eos_token_id]

    return SimulatedEngine(latency_s=0.001, latency_sigma=0.0, tail_prob=0.0, responder=reply,
                           eos_token_id=TOK.eos_token_id)


async def two_turn_agent(endpoint: AgentEndpoint) -> str:
    """Asks twice over HTTP (sending its history back) and answers with its own summary."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    messages = list(endpoint.task["messages"])
    async with aiohttp.ClientSession(headers=headers) as http:
        for _ in range(2):
            async with http.post(f"{endpoint.base_url}/chat/completions",
                                 json={"model": endpoint.model, "messages": messages}) as r:
                assert r.status == 200, await r.text()
                message = (await r.json())["choices"][0]["message"]
            messages += [message, {"role": "user", "content": "again"}]
    return f"final: {message['content']}"


async def test_an_in_process_agent_fills_the_standard_artifacts():
    eng = engine()
    async with ProxyServer(eng, TOK) as proxy:
        pipe = Pipeline([RemoteAgent(two_turn_agent)], engine=eng, tokenizer=TOK,
                        extras={PROXY_KEY: proxy}, sampling={"max_tokens": 32})
        result = await pipe.run_batch([ROW], n=3)
        assert len(proxy.sessions) == 0
    assert result.stats.by_status == {"completed": 3}
    for sample, item in zip(result.samples, result.items, strict=True):
        art = item.artifacts
        (segment,) = art[SEGMENTS]
        assert sample.prompt_ids == segment.prompt_ids == TOK.encode(
            TOK.apply_chat_template(ROW["messages"], add_generation_prompt=True))
        assert sample.response_ids == segment.response_ids
        assert sample.response_mask == segment.response_mask
        assert [m for m in sample.response_mask[:1]] == [1] and 0 in sample.response_mask
        assert sample.logprobs == segment.logprobs and sample.tool_turns == 0
        assert art[artifacts.TURNS] == 2 and sample.extra_fields["proxy_splits"] == 0
        assert sample.extra_fields["proxy_segments"] == []
        messages = art[artifacts.MESSAGES]
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant",
                                              "assistant"]
        assert messages[3].token_ids and messages[-1].token_ids is None
        assert messages[-1].model_extra == {"source": "agent"}
        assert art[FINAL_ANSWER] == messages[-1].content == f"final: {messages[3].content}"
        assert sample.finish_reason.value == "stop" and item.raw_finish_reason == "stop"


SILENT = "import sys; sys.stdin.read(); print('nothing to say')"
FAILING = "import sys; sys.stdin.read(); print('boom: bad config', file=sys.stderr); sys.exit(3)"


async def test_failing_and_silent_agents_fail_their_sample_with_a_reason():
    eng = engine()
    async with ProxyServer(eng, TOK) as proxy:
        pipe = Pipeline([RemoteAgent([sys.executable, "-c", FAILING], proxy=proxy)],
                        engine=eng, tokenizer=TOK)
        failed = await pipe.run(ROW)
        assert failed.status is Status.FAILED and failed.masked
        assert "exited with status 3" in failed.error and "boom: bad config" in failed.error
        pipe = Pipeline([RemoteAgent([sys.executable, "-c", SILENT], proxy=proxy)],
                        engine=eng, tokenizer=TOK)
        result = await pipe.run_batch([ROW])
        assert result.samples[0].status is Status.FAILED
        assert "made no model request" in result.samples[0].error
        assert result.items[0].artifacts[FINAL_ANSWER] == "nothing to say"
        assert result.items[0].artifacts[AGENT_LOG] == ""
        missing = await Pipeline([RemoteAgent(two_turn_agent)], engine=eng,
                                 tokenizer=TOK).run(ROW)
        assert "needs a started ProxyServer" in missing.error


STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the grandchild too
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
with open(sys.argv[1], "w") as fh:
    fh.write(f"{os.getpid()} {child.pid}")
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


async def test_the_deadline_kills_the_agents_whole_process_group(tmp_path):
    eng = engine()
    pids = tmp_path / "pids"
    async with ProxyServer(eng, TOK) as proxy:
        agent = RemoteAgent([sys.executable, "-c", STUBBORN, str(pids)], proxy=proxy,
                            kill_grace_s=0.2)
        pipe = Pipeline([agent], engine=eng, tokenizer=TOK, sample_timeout_s=2.0)
        sample = await pipe.run(ROW)
        assert sample.status is Status.TIMEOUT and sample.masked
        assert len(proxy.sessions) == 0
        parent, child = map(int, pids.read_text().split())
        for _ in range(100):
            if not alive(parent) and not alive(child):
                break
            await asyncio.sleep(0.02)
        assert not alive(parent) and not alive(child)
        # the agent's own limit, shorter than the sample's, fails the sample instead
        pids = tmp_path / "pids-2"
        agent = RemoteAgent([sys.executable, "-c", STUBBORN, str(pids)], proxy=proxy,
                            timeout_s=1.0, kill_grace_s=0.2)
        sample = await Pipeline([agent], engine=eng, tokenizer=TOK,
                                sample_timeout_s=30).run(ROW)
        assert sample.status is Status.FAILED and "timeout_s=1.0" in sample.error
        parent, child = map(int, pids.read_text().split())
        await asyncio.sleep(0.1)
        assert not alive(parent) and not alive(child)


LINGERING = """
import os, subprocess, sys
sys.stdin.read()
# helpers that keep stdout open after the agent exits: one in the agent's process group,
# one that left it (setsid); neither may hold the sample
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
escaped = subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(60)"])
with open(sys.argv[1], "w") as fh:
    fh.write(str(escaped.pid))
import urllib.request, json
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "say hi"}]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
             "Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request))
print("library chatter " * 2000)
print("the answer:", reply["choices"][0]["message"]["content"])
if len(sys.argv) > 2:
    with open(os.environ["PIPELINE_ANSWER_FILE"], "w") as fh:
        fh.write("from the file\\nsecond line")
"""


async def test_an_agent_is_done_when_it_exits_even_if_a_helper_holds_its_stdout(tmp_path):
    eng = engine()
    pids = [tmp_path / "escaped-1", tmp_path / "escaped-2"]
    try:
        await _lingering_agents(eng, pids)
    finally:
        for path in pids:
            if path.exists():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(path.read_text()), signal.SIGKILL)


async def _lingering_agents(eng: SimulatedEngine, pids: list[Path]) -> None:
    async with ProxyServer(eng, TOK) as proxy:
        agent = RemoteAgent([sys.executable, "-c", LINGERING, str(pids[0])], proxy=proxy,
                            timeout_s=30, drain_s=0.5, max_output_bytes=4096)
        started = asyncio.get_running_loop().time()
        result = await Pipeline([agent], engine=eng, tokenizer=TOK).run_batch([ROW])
        elapsed = asyncio.get_running_loop().time() - started
        (sample,), (item,) = result.samples, result.items
        assert sample.status is Status.COMPLETED, sample.error
        assert elapsed < 20  # far below timeout_s=30: the helper did not hold the sample
        # the last stdout line is the answer (the chatter before it was cut to the cap)
        assert item.artifacts[FINAL_ANSWER].startswith("the answer: hi ")
        agent = RemoteAgent([sys.executable, "-c", LINGERING, str(pids[1]), "file"],
                            proxy=proxy, timeout_s=30, drain_s=0.5)
        item = (await Pipeline([agent], engine=eng, tokenizer=TOK).run_batch([ROW])).items[0]
        assert item.artifacts[FINAL_ANSWER] == "from the file\nsecond line"


async def budget_agent(endpoint: AgentEndpoint) -> str:
    """Keeps asking until the proxy refuses; returns the final error's code."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    messages = list(endpoint.task["messages"])
    async with aiohttp.ClientSession(headers=headers) as http:
        for _ in range(50):
            async with http.post(f"{endpoint.base_url}/chat/completions",
                                 json={"model": endpoint.model, "messages": messages}) as r:
                body = await r.json()
                if r.status != 200:
                    assert r.headers["x-should-retry"] == "false" and r.status == 404
                    raise RuntimeError(body["error"]["code"])
            messages += [body["choices"][0]["message"], {"role": "user", "content": "more"}]
    return "never refused"


async def test_a_spent_response_budget_ends_the_sample_like_generate():
    eng = engine()
    async with ProxyServer(eng, TOK) as proxy:
        async def agent(endpoint: AgentEndpoint) -> str:
            try:
                return await budget_agent(endpoint)
            except RuntimeError as exc:  # told to stop: a normal end for the agent
                return str(exc)

        pipe = Pipeline([RemoteAgent(agent, proxy=proxy)], engine=eng, tokenizer=TOK,
                        sampling={"max_tokens": 16, "max_response_tokens": 60})
        result = await pipe.run_batch([ROW])
        (sample,), (item,) = result.samples, result.items
    assert item.artifacts[FINAL_ANSWER] == "response_budget_exhausted"
    assert sample.status is Status.COMPLETED and not sample.masked
    assert (sample.finish_reason.value, sample.exit_reason, sample.raw_finish_reason) == (
        "length", "length", "response_budget")
    assert len(sample.response_ids) <= 60


async def test_a_held_session_outlives_the_idle_timeout_and_an_expired_one_says_so():
    eng = engine()
    async with ProxyServer(eng, TOK, idle_timeout_s=0.2) as proxy:
        async def slow_agent(endpoint: AgentEndpoint) -> str:
            await asyncio.sleep(1.0)  # a long tool call: several idle timeouts
            return await two_turn_agent(endpoint)

        sample = await Pipeline([RemoteAgent(slow_agent, proxy=proxy)], engine=eng,
                                tokenizer=TOK).run(ROW)
        assert sample.status is Status.COMPLETED, sample.error
        assert proxy.sessions.expired_count == 0
        loose = proxy.create_session()
        for _ in range(200):
            if proxy.sessions.find(loose.id) is None:
                break
            await asyncio.sleep(0.02)
        async with aiohttp.ClientSession() as http:
            for url in (proxy.session_url(loose), f"{proxy.url}/v1"):
                async with http.post(f"{url}/chat/completions", json={
                        "model": "m", "messages": ROW["messages"]},
                        headers={"Authorization": f"Bearer {loose.api_key}"}) as r:
                    body = await r.json()
                    assert (r.status, body["error"]["code"]) == (404, "session_expired")
                    assert "expired" in body["error"]["message"]
                    assert r.headers["x-should-retry"] == "false"
