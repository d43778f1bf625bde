"""A real verl BaseTool (verl 0.9.1's base class, its schema and response models) run per
trajectory by CallTools through VerlTool: create_kwargs from the row's tools_kwargs, state
kept across the calls of one sample, release once per instance on every outcome, rewards in
verl's tool_rewards column."""

from __future__ import annotations

import json

import pytest

from pipeline import AgentMessage, Loop, Pipeline, ToolCall, ToolFunction, artifacts
from pipeline.batch import to_verl_outputs
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import VerlTool

base_tool = pytest.importorskip("verl.tools.base_tool")
schemas = pytest.importorskip("verl.tools.schemas")


class CounterTool(base_tool.BaseTool):
    """A stateful verl tool: each instance counts up from its create_kwargs' start."""

    def __init__(self) -> None:
        super().__init__({}, schemas.OpenAIFunctionToolSchema.model_validate({
            "type": "function", "function": {
                "name": "count", "description": "Count up by a step.",
                "parameters": {"type": "object", "properties": {
                    "step": {"type": "integer", "description": "how much"}},
                    "required": ["step"]}}}))
        self.state: dict[str, int] = {}
        self.released: list[str] = []

    async def create(self, instance_id=None, **kwargs):
        instance_id, response = await super().create(instance_id)
        self.state[instance_id] = kwargs.get("create_kwargs", {}).get("start", 0)
        return instance_id, response

    async def execute(self, instance_id, parameters, **kwargs):
        self.state[instance_id] += parameters["step"]
        return schemas.ToolResponse(text=str(self.state[instance_id])), 0.25, {}

    async def release(self, instance_id, **kwargs):
        self.released.append(instance_id)
        del self.state[instance_id]


def two_turns_of_calls():
    """Two model turns, each calling ``count`` twice (scripted stand-ins for the model)."""

    async def turn(item, ctx):
        art = item.artifacts
        k = art.get(artifacts.TURNS, 0)
        calls = [ToolCall(id=f"c{k}{i}", function=ToolFunction(
            name="count", arguments=json.dumps({"step": 1}))) for i in range(2)]
        if k == 0:
            art[artifacts.PROMPT_IDS] = [1, 2, 3]
            art[artifacts.MESSAGES] = [AgentMessage(role="user", content="count")]
            art[artifacts.RESPONSE_IDS], art[artifacts.RESPONSE_MASK] = [], []
            art[artifacts.LOGPROBS] = []
        art[artifacts.MESSAGES].append(
            AgentMessage(role="assistant", content="", tool_calls=calls, token_ids=[2]))
        art[artifacts.RESPONSE_IDS].append(2)
        art[artifacts.RESPONSE_MASK].append(1)
        art[artifacts.LOGPROBS].append(-0.5)
        art[artifacts.TURNS] = k + 1

    return turn


async def test_a_verl_tool_keeps_one_instance_per_trajectory():
    verl_tool = CounterTool()
    tool = VerlTool(verl_tool)
    assert tool.name == "count" and tool.parameters["required"] == ["step"]
    rollout = Pipeline([Loop([two_turns_of_calls(), CallTools(offload=False)], max_turns=2)],
                       tokenizer=ByteTokenizer(), tools=[tool])
    rows = [{"prompt": "a", "tools_kwargs": {"count": {"create_kwargs": {"start": 100}}}},
            {"prompt": "b"}]
    result = await rollout.run_batch(rows, n=2)
    assert [s.status for s in result.samples] == ["completed"] * 4
    for item, start in zip(result.items, (100, 100, 0, 0), strict=True):
        counts = [m.content for m in item.artifacts[artifacts.MESSAGES] if m.role == "tool"]
        assert counts == [str(start + n) for n in (1, 2, 3, 4)] or counts == [
            str(start + n) for n in (2, 1, 3, 4)]  # one turn's two calls run concurrently
    assert len(verl_tool.released) == 4 and verl_tool.state == {}  # released once each
    outputs = to_verl_outputs(result.samples, items=result.items, use_verl=False)
    assert [o["extra_fields"]["tool_rewards"] for o in outputs] == [[0.25] * 4] * 4
