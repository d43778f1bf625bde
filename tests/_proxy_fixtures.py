"""Helpers for the proxy tests on the real tiny model: an engine that logs what it was sent,
scripted replies, mask runs, the token-exact check, a network audit for agent programs, and
running an agent program as the ``RemoteAgent`` of a batch (``Served``, ``run_client``).

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

from _model_fixtures import ForcedText

from pipeline import Pipeline, Status
from pipeline.proxy import SEGMENTS, ProxyServer, RemoteAgent

CLIENTS_DIR = Path(__file__).with_name("proxy_clients")


def call_text(name: str, **arguments: Any) -> str:
    """A Hermes tool call as the model writes it."""
    return (f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n'
            "</tool_call>")


class RecordingEngine:
    """The real engine, plus its own log of what each request was sent and returned;
    ``delays`` holds requests back (to make a client time out)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.log: dict[str, tuple[list[int], Any]] = {}
        self.delays: dict[str, float] = {}
        self.aborted: list[str] = []

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Any:
        await asyncio.sleep(self.delays.get(request_id, 0.0))
        gen = await self.engine.generate(prompt_ids, sampling, request_id)
        self.log[request_id] = (list(prompt_ids), gen)
        return gen

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
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
    """The engine's log of one session's answered requests, in request order."""
    mine = [(int(rid.rsplit("-", 1)[1]), entry) for rid, entry in engine.log.items()
            if rid.rsplit("-", 1)[0] == session_id]
    return [entry for _, entry in sorted(mine)]


def assert_token_exact(segments: list[Any], sent: list[tuple[list[int], Any]]) -> None:
    """Every model run of every segment is one engine reply, token for token, and every
    request's prompt is its segment's sequence up to that reply (turn i = answered request i)."""
    assert sorted(t for s in segments for t in s.turns) == list(range(len(sent)))
    for seg in segments:
        assert len(seg.response_ids) == len(seg.response_mask) == len(seg.logprobs)
        model_runs = [(s, e) for m, s, e in runs(seg.response_mask) if m == 1]
        assert len(model_runs) == len(seg.turns)
        for (start, end), turn in zip(model_runs, seg.turns, strict=True):
            prompt, gen = sent[turn]
            assert seg.response_ids[start:end] == gen.token_ids
            assert seg.logprobs[start:end] == gen.logprobs
            assert prompt == seg.prompt_ids + seg.response_ids[:start]


class Script:
    """Processor factory: the replies the tiny model may write, chosen from the prompt.

    A random-weight model never writes a tool call, so every reply is restricted to given
    texts (``ForcedText``); where two texts branch the model really samples between them.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def texts(self, prompt_ids: list[int]) -> list[str]:
        text = self.tokenizer.decode(prompt_ids)
        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
        if "one bash command per reply" in text:  # mini-swe-agent
            if not results:
                return [call_text("bash", command="echo 42 > answer.txt")]
            return [call_text("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT "
                                              "&& cat answer.txt")]
        if "You add numbers with the add tool." in text:  # the sub-agent
            return [call_text("add", a=12, b=30)] if not results else [results[-1]]
        if '"name": "adder"' in text:  # the main agent, its sub-agent as a tool
            if not results:
                return [call_text("adder", input="12 + 30")]
            return [f"Answer: {results[-1]}"]
        if "in parallel" in text:
            if not results:
                return [call_text("add", a=12, b=30) + "\n" + call_text("add", a=5, b=3)]
            return [f"Answer: {sum(int(r) for r in results)}"]
        if "multi-byte" in text:
            return ["h\u00e9llo \u2713 \u65e5\u672c"]
        numbers = [r for r in results if r.isdigit()]
        if not numbers:
            return [call_text("add", a=12, b=30), call_text("add", a=12, b=31)]
        if len(numbers) == 1:
            return [call_text("add", a=int(numbers[0]), b=8)]
        return [f"Answer: {numbers[-1]}"]

    def __call__(self, request_id: str, prompt_ids: list[int]) -> ForcedText:
        return ForcedText([self.tokenizer.encode(t) for t in self.texts(prompt_ids)],
                          self.tokenizer.eos_token_id)


def audited_env(log: Path, home: Path) -> dict[str, str]:
    """Environment for an agent program: the network audit (tests/proxy_clients/
    sitecustomize.py) on, every client kept off the internet and out of the user's home."""
    path = os.pathsep.join(p for p in (str(CLIENTS_DIR), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "PROXY_NET_LOG": str(log),
            "OPENAI_AGENTS_DISABLE_TRACING": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False", "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mswea"),
            "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
            "HOME": str(home), "PYTHONUNBUFFERED": "1"}


def audit(log: Path) -> list[dict[str, Any]]:
    """The audit's records; asserts the hook ran (a connection was seen) and that every
    connection and lookup was to the loopback range."""
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert any(e["event"] == "connect" for e in events), "the network audit saw nothing"
    refused = [e for e in events if not e["allowed"]]
    assert refused == [], refused
    return events


class Served:
    """A proxy on the recording engine, with every HTTP status it answered."""

    def __init__(self, engine: RecordingEngine, tok: Any, **options: Any) -> None:
        self.proxy = ProxyServer(engine, tok, model_name="tiny", **options)
        self.statuses: list[int] = []

        async def seen(request: Any, response: Any) -> None:
            self.statuses.append(response.status)

        self.proxy.app.on_response_prepare.append(seen)


async def run_client(served: Served, engine: RecordingEngine, tok: Any, command: list[str],
                     data: dict[str, Any], tmp_path: Path, n: int = 1,
                     **agent_options: Any) -> tuple[Any, list[list[Any]]]:
    """Run ``command`` as the agent of ``n`` samples; returns the batch and, per sample, the
    engine's log of its session. Asserts the audit, that no answer was a 5xx, that every
    sample is token-exact against the engine's log and is its last turn's segment."""
    log = tmp_path / "net.jsonl"
    home = tmp_path / "home"
    home.mkdir(parents=True, exist_ok=True)
    agent = RemoteAgent(command, proxy=served.proxy, env=audited_env(log, home),
                        cwd=str(tmp_path), timeout_s=100, **agent_options)
    pipe = Pipeline([agent], engine=engine, tokenizer=tok, sampling={"max_tokens": 160},
                    sample_timeout_s=110)
    result = await pipe.run_batch([data], n=n)
    assert result.stats.by_status == {"completed": n}, (
        [s.error for s in result.samples],
        [i.artifacts.get("proxy.agent_log", "")[-2000:] for i in result.items])
    events = audit(log)
    assert {e["host"] for e in events if e["event"] == "connect"
            and e["target"].startswith("(")} == {"127.0.0.1"}
    assert served.statuses and max(served.statuses) < 500, served.statuses
    sent = [session_requests(engine, s.extra_fields["proxy_session"]) for s in result.samples]
    for item, requests in zip(result.items, sent, strict=True):
        assert_token_exact(item.artifacts[SEGMENTS], requests)
    for sample, item in zip(result.samples, result.items, strict=True):
        main = max(item.artifacts[SEGMENTS], key=lambda s: max(s.turns))  # the last turn's
        assert (sample.prompt_ids, sample.response_ids, sample.response_mask) == (
            main.prompt_ids, main.response_ids, main.response_mask)
        assert sample.logprobs == main.logprobs and sample.status is Status.COMPLETED
    return result, sent
