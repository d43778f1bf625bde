"""A real black-box agent (``tests/proxy_agent.py``: the official ``openai`` SDK in a
subprocess) against the proxy backed by the tiny model on ``TransformersEngine``.

What is forced: a random-weight model never writes a tool call, so a logits processor
(``ForcedText``) restricts every reply to given texts, chosen from the prompt the engine
receives: with no tool result yet, one of two ``add`` calls (the model really samples which
one, so those logprobs are real); with one result, ``add(<result>, 8)``; with two, ``Answer:
<last result>``. The checks compare the proxy's record with the engine's own request log and
with the chat template's rendering of the conversation.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from _add_task import SYSTEM, TOOLS
from _model_fixtures import ForcedText

from pipeline import Pipeline, SamplingParams, Status, artifacts
from pipeline._text.render import chat_form
from pipeline.proxy import FINAL_ANSWER, SEGMENTS, ProxyServer, RemoteAgent

pytest_plugins = ["_model_fixtures"]
pytest.importorskip("openai")  # the agent's SDK (dev extra)

AGENT = Path(__file__).with_name("proxy_agent.py")
QUESTION = "What is 12 plus 30, plus 8?"
TASK = {"messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": QUESTION}], "tools": TOOLS}


def call_text(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


class Forced:
    """Processor factory: the reply allowed depends on the results seen in the prompt."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def texts(self, prompt_ids: list[int]) -> list[str]:
        text = self.tokenizer.decode(prompt_ids)
        results = re.findall(r"<tool_response>\n(\d+)\n</tool_response>", text)
        results += re.findall(r"result: (\d+)", text)
        if not results:
            return [call_text(12, 30), call_text(12, 31)]
        if len(results) == 1:
            return [call_text(int(results[0]), 8)]
        return [f"Answer: {results[-1]}"]

    def __call__(self, request_id: str, prompt_ids: list[int]) -> ForcedText:
        return ForcedText([self.tokenizer.encode(t) for t in self.texts(prompt_ids)],
                          self.tokenizer.eos_token_id)


class RecordingEngine:
    """The real engine, plus its own log of what each request was sent and returned."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.log: dict[str, tuple[list[int], Any]] = {}

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Any:
        gen = await self.engine.generate(prompt_ids, sampling, request_id)
        self.log[request_id] = (list(prompt_ids), gen)
        return gen

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def aclose(self) -> None:
        await self.engine.aclose()


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal mask values: ``(value, start, end)``."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


def session_requests(engine: RecordingEngine, session_id: str) -> list[tuple[list[int], Any]]:
    """The engine's log of one session, in request order (ids end in the request count)."""
    mine = [(int(rid.rsplit("-", 1)[1]), entry) for rid, entry in engine.log.items()
            if rid.rsplit("-", 1)[0] == session_id]
    return [entry for _, entry in sorted(mine)]


async def run_agent(proxy: ProxyServer, session: Any, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "OPENAI_BASE_URL": proxy.session_url(session),
           "OPENAI_API_KEY": session.api_key, "OPENAI_MODEL": "tiny"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(AGENT), *args, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(TASK).encode()), 90)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_sdk_agent_turns_merge_into_the_engines_exact_tokens(make_engine, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Forced(tok)))
    async with ProxyServer(engine, tok, model_name="tiny") as proxy:
        session = proxy.create_session(sampling=SamplingParams(max_tokens=64, seed=5))
        code, out, err = await run_agent(proxy, session, "--stream", "1")
        assert code == 0, err
        record = proxy.record(session.id)
    first = json.loads(record.turns[0].reply["tool_calls"][0]["function"]["arguments"])
    total = first["a"] + first["b"] + 8
    assert out.strip() == f"Answer: {total}"
    assert [t.merged for t in record.turns] == [False, True, True]
    assert [t.request["stream"] for t in record.turns] == [False, True, False]
    assert [t.finish_reason for t in record.turns] == ["tool_calls", "tool_calls", "stop"]
    assert record.num_splits == 0 and len(record.segments) == 1
    # every turn: exactly what the engine was sent and what it returned
    sent = session_requests(engine, session.id)
    assert len(sent) == 3
    for turn, (prompt, gen) in zip(record.turns, sent, strict=True):
        assert (turn.prompt_ids, turn.response_ids, turn.logprobs) == (
            prompt, gen.token_ids, gen.logprobs)
    # one merged sequence: model runs (mask 1) are the engine's tokens, each request's prompt
    # is the sequence so far, the runs between are the template's tool turns (mask 0)
    seg = record.segments[0]
    assert seg.prompt_ids == tok.apply_chat_template(
        TASK["messages"], tools=TOOLS, add_generation_prompt=True)["input_ids"]
    ids, mask, logprobs = seg.response_ids, seg.response_mask, seg.logprobs
    assert len(ids) == len(mask) == len(logprobs)
    assert [m for m, _, _ in runs(mask)] == [1, 0, 1, 0, 1]
    model_runs = [(s, e) for m, s, e in runs(mask) if m == 1]
    for (start, end), (prompt, gen) in zip(model_runs, sent, strict=True):
        assert ids[start:end] == gen.token_ids and logprobs[start:end] == gen.logprobs
        assert prompt == seg.prompt_ids + ids[:start]
    results = [first["a"] + first["b"], total]
    for (_, start, end), result in zip([r for r in runs(mask) if r[0] == 0], results,
                                       strict=True):
        assert tok.decode(ids[start:end]) == (
            f"\n<|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
        assert set(logprobs[start:end]) == {0.0}
    # the branch the model sampled had a real probability; forced tokens have logprob 0
    assert any(lp < 0 for lp in logprobs[:model_runs[0][1]])
    # the whole sequence is what the template renders for the recorded conversation
    conversation = [chat_form(m) for m in seg.agent_messages()]
    rendered = tok.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    assert tok.encode(rendered) == seg.prompt_ids + ids + tok.encode("\n")


async def test_remote_agent_retry_and_rewrite_split_into_segments(make_engine, tiny_tokenizer):
    tok = tiny_tokenizer
    engine = RecordingEngine(make_engine(processor_factory=Forced(tok)))

    async def reward(item, ctx):
        answer = item.artifacts[FINAL_ANSWER]
        results = re.findall(r"<tool_response>\n(\d+)\n", tok.decode(
            item.artifacts[SEGMENTS][0].response_ids))
        item.artifacts[artifacts.REWARD] = float(answer == f"Answer: {int(results[0]) + 8}")

    command = [sys.executable, str(AGENT), "--retry-turn", "1", "--rewrite-after", "2"]
    async with ProxyServer(engine, tok, model_name="tiny") as proxy:
        pipe = Pipeline([RemoteAgent(command, proxy=proxy), reward], engine=engine,
                        tokenizer=tok, sampling={"max_tokens": 64}, sample_timeout_s=90)
        result = await pipe.run_batch([{**TASK, "ground_truth": "50"}], n=2)
        assert len(proxy.sessions) == 0  # deleted when their samples ended
    assert result.stats.by_status == {"completed": 2}, [s.error for s in result.samples]
    for sample, item in zip(result.samples, result.items, strict=True):
        assert sample.reward == 1.0
        extra = sample.extra_fields
        assert extra["proxy_splits"] == 2
        assert extra["proxy_split_reasons"] == {"retry": 1, "edited": 1}
        segs = item.artifacts[SEGMENTS]
        assert [s.reason for s in segs] == ["start", "retry", "edited"]
        assert [s.turns for s in segs] == [[0, 1], [2], [3]]
        assert segs[2].at_message == 1  # the summary replaced the question
        assert [e["reason"] for e in extra["proxy_segments"]] == ["start", "retry"]
        sent = session_requests(engine, extra["proxy_session"])
        assert len(sent) == 4
        # segment 0: two merged turns; the retried one stays recorded in it
        model_runs = [(s, e) for m, s, e in runs(segs[0].response_mask) if m == 1]
        for (start, end), (prompt, gen) in zip(model_runs, sent[:2], strict=True):
            assert segs[0].response_ids[start:end] == gen.token_ids
            assert prompt == segs[0].prompt_ids + segs[0].response_ids[:start]
        # segment 1 (retry): its prompt reuses the recorded tokens, so it is token for token
        # the prompt of the request it repeats; no model output was re-tokenized
        assert segs[1].prompt_ids == sent[1][0] == sent[2][0]
        assert segs[1].reused_tokens == len(segs[0].prompt_ids) + len(sent[0][1].token_ids)
        assert segs[1].response_ids == sent[2][1].token_ids
        assert segs[1].response_mask == [1] * len(sent[2][1].token_ids)
        # segment 2 (rewrite): the summary is rendered from scratch
        assert segs[2].reused_tokens == 0
        assert segs[2].prompt_ids == sent[3][0] == tok.apply_chat_template(
            segs[2].messages[:2], tools=TOOLS, add_generation_prompt=True)["input_ids"]
        # the trainer sample is the last segment; the answer is its last message
        assert sample.prompt_ids == segs[2].prompt_ids
        assert sample.response_ids == sent[3][1].token_ids
        assert sample.logprobs == sent[3][1].logprobs
        assert sample.response_mask == [1] * len(sample.response_ids)
        assert item.artifacts[artifacts.MESSAGES][-1].content == item.artifacts[FINAL_ANSWER]
        assert item.artifacts[artifacts.MESSAGES][-1].token_ids == sample.response_ids
        assert sample.status is Status.COMPLETED and not sample.masked


async def test_logprob_bytes_rebuild_the_utf8_of_characters_split_across_tokens(
        make_engine, tiny_tokenizer):
    from _proxy_fixtures import Script

    tok = tiny_tokenizer
    engine = make_engine(processor_factory=Script(tok))
    async with ProxyServer(engine, tok, model_name="tiny") as proxy:
        session = proxy.create_session()
        async with aiohttp.ClientSession() as http, http.post(
                f"{proxy.session_url(session)}/chat/completions",
                headers={"Authorization": f"Bearer {session.api_key}"},
                json={"model": "tiny", "logprobs": True, "top_logprobs": None, "n": None,
                      "messages": [{"role": "user", "content": "multi-byte please"}]}) as r:
            assert r.status == 200
            choice = (await r.json())["choices"][0]
    content = choice["message"]["content"]
    assert content == "h\u00e9llo \u2713 \u65e5\u672c"
    pieces = choice["logprobs"]["content"]
    assert any("\ufffd" in p["token"] for p in pieces)  # a token holds part of a character
    assert b"".join(bytes(p["bytes"]) for p in pieces if p["bytes"] is not None) == (
        content.encode())
    assert pieces[-1]["bytes"] is None  # the end-of-turn token is not part of the text
