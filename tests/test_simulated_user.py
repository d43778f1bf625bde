"""SimulatedUser: a second engine plays the user in an agent <-> user <-> tool conversation on
the real tiny model (both engines forced to known texts: random weights); the user's tokens
are mask 0 in the agent's trajectory and recorded separately; a scripted policy; the user's
request is aborted when the sample times out."""

from __future__ import annotations

import asyncio

import pytest
from _model_fixtures import ForcedText

from pipeline import BuildPrompt, Generate, Pipeline, SimulatedEngine, Status, artifacts
from pipeline._text.render import chat_form, render
from pipeline.stages import USER_TURNS, CallTools, SimulatedUser
from pipeline.testing import ByteTokenizer
from pipeline.tools import calculator_tool, tool_schema

pytest_plugins = ["_model_fixtures"]

CALC = calculator_tool()


def call_text(expression: str) -> str:
    return ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "'
            + expression + '"}}\n</tool_call>')


AGENT = {0: call_text("12 + 5"), 1: "Answer: 17", 2: call_text("17 * 2"), 3: "Answer: 34"}
USER = {0: "Now double it.", 1: "Thanks! ###STOP###"}


def forced(tokenizer, texts: dict[int, str]):
    def factory(request_id, prompt_ids):
        turn = int(request_id.rsplit("-", 1)[1])
        return ForcedText([tokenizer.encode(texts[turn])], tokenizer.eos_token_id)
    return factory


class Recording:
    """Passes requests to an engine, keeping the request ids and aborts it saw."""

    def __init__(self, engine) -> None:
        self.engine, self.ids, self.aborted = engine, [], []
        self.max_model_len = getattr(engine, "max_model_len", None)

    async def generate(self, prompt_ids, sampling, request_id):
        self.ids.append(request_id)
        return await self.engine.generate(prompt_ids, sampling, request_id)

    async def abort(self, request_id):
        self.aborted.append(request_id)
        await self.engine.abort(request_id)

    async def aclose(self):
        await self.engine.aclose()


ROW = {"messages": [{"role": "system", "content": "Use the calculator."},
                    {"role": "user", "content": "What is 12 + 5?"}],
       "tools": [tool_schema(CALC)],
       "extra": {"user_instructions": "You want 12 + 5, then its double. Then stop."}}


async def test_agent_user_tool_conversation_is_one_token_exact_trajectory(make_engine,
                                                                         tiny_tokenizer):
    tok = tiny_tokenizer
    agent = make_engine(processor_factory=forced(tok, AGENT))
    user_engine = Recording(make_engine(processor_factory=forced(tok, USER)))
    user = SimulatedUser(engine=user_engine, tokenizer=tok, sampling={"max_tokens": 24})
    rollout = Pipeline([BuildPrompt(), user.loop([Generate(), CallTools()], max_turns=8)],
                       engine=agent, tokenizer=tok, tools=[CALC], sampling={"max_tokens": 48},
                       sample_timeout_s=60)
    result = await rollout.run_batch([ROW], n=1)
    (sample,), (item,) = result.samples, result.items
    assert sample.status == Status.COMPLETED and sample.exit_reason == "done"
    messages = item.artifacts[artifacts.MESSAGES]
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "assistant",
                                          "user", "assistant", "tool", "assistant"]
    assert [messages[3].content, messages[7].content] == ["17", "34"]
    assert messages[5].content == USER[0]
    # the user's turns, recorded apart: its own sampled ids, the stopping turn not appended
    turns = item.artifacts[USER_TURNS]
    assert [t["text"] for t in turns] == [USER[0], USER[1]]
    assert [t["stopped"] for t in turns] == [False, True]
    assert turns[0]["token_ids"] == [*tok.encode(USER[0]), tok.eos_token_id]
    assert len(turns[0]["logprobs"]) == len(turns[0]["token_ids"]) and turns[0]["prompt_len"]
    assert user_engine.ids == [f"{item.uid}-user-0", f"{item.uid}-user-1"]
    # trained tokens are exactly the agent's; the user's reply only in mask-0 tokens
    ids, mask = sample.response_ids, sample.response_mask
    assert [t for t, m in zip(ids, mask, strict=True) if m == 1] == [
        t for turn in range(4) for t in [*tok.encode(AGENT[turn]), tok.eos_token_id]]
    untrained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 0])
    assert USER[0] in untrained and USER[1] not in tok.decode(ids)
    full = render(tok, [chat_form(m) for m in messages], [tool_schema(CALC)],
                  add_generation_prompt=False)
    assert tok.decode([*sample.prompt_ids, *ids]) == full.rstrip("\n")


TOKENIZER = ByteTokenizer()


def short_answer(prompt_ids, rng):
    return [*TOKENIZER.encode("sure"), TOKENIZER.eos_token_id]


async def test_scripted_policy_sees_roles_swapped_and_stops_the_loop():
    seen: dict[str, list[list[dict]]] = {}

    async def policy(view, item):
        mine = seen.setdefault(item.uid, [])
        mine.append(view)
        return "one more" if len(mine) < 3 else "bye ###STOP###"

    user = SimulatedUser(policy=policy, instructions="Be brief.")
    engine = SimulatedEngine(latency_s=0.001, responder=short_answer)
    rollout = Pipeline([BuildPrompt(), user.loop([Generate()], max_turns=10)], engine=engine,
                       tokenizer=TOKENIZER, sampling={"max_tokens": 8})
    result = await rollout.run_batch([{"prompt": "hello"}], n=2)
    assert [s.status for s in result.samples] == [Status.COMPLETED] * 2
    item = result.items[0]
    assert item.artifacts[artifacts.TURNS] == 3  # the agent answered three times
    assert [t["text"] for t in item.artifacts[USER_TURNS]] == ["one more", "one more",
                                                                "bye ###STOP###"]
    view = seen[item.uid][1]  # the user's view before its second reply
    assert view[0] == {"role": "system", "content": "Be brief."}
    assert [m["role"] for m in view[1:]] == ["assistant", "user", "assistant", "user"]
    assert view[1]["content"] == "hello" and view[2]["content"] == "sure"


async def test_the_users_request_is_aborted_when_the_sample_times_out():
    user_engine = Recording(SimulatedEngine(latency_s=3600, latency_sigma=0.0,
                                            tail_prob=0.0))
    user = SimulatedUser(engine=user_engine, tokenizer=TOKENIZER)
    engine = SimulatedEngine(latency_s=0.001, responder=short_answer)
    rollout = Pipeline([BuildPrompt(), user.loop([Generate()], max_turns=4)], engine=engine,
                       tokenizer=TOKENIZER, sampling={"max_tokens": 8}, sample_timeout_s=0.3)
    result = await asyncio.wait_for(rollout.run_batch([{"prompt": "hi"}], n=1), 30)
    assert result.samples[0].status == Status.TIMEOUT
    assert user_engine.aborted == [f"{result.items[0].uid}-user-0"]


def test_config_errors_name_the_field():
    from pipeline import ConfigError

    with pytest.raises(ConfigError) as exc:
        SimulatedUser()
    assert exc.value.field == "engine"
    with pytest.raises(ConfigError) as exc:
        SimulatedUser(engine=SimulatedEngine())
    assert exc.value.field == "tokenizer"
    with pytest.raises(ConfigError) as exc:
        SimulatedUser(policy=lambda v, i: "x", sampling={"max_tokens": -1})
    assert exc.value.field == "sampling"
