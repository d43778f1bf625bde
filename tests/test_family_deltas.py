"""Turn deltas on the real templates of families whose templates rewrite history (issue 36,
item 3): what the model conditions on after its turn is what the family's template renders
after that turn, never a splice cut inside the model's own text; the sampled tokens stay.

Real vocabularies and templates (``pipeline.families``); no model needed.
"""

from __future__ import annotations

import pytest

from pipeline import AgentMessage, ToolCall, ToolFunction
from pipeline._text.render import DRIFT_PREFIX, render, render_turn_delta

pytest.importorskip("quicktok", reason="the families extra is not installed")



@pytest.fixture
def gpt_oss(family_tokenizers):
    return family_tokenizers["gpt-oss"]


def test_gpt_oss_follow_up_after_a_final_answer_starts_after_the_closing_the_template_shows(
        gpt_oss):
    """A final answer sampled to ``<|return|>``, then the agent asks again (the proxy's case):
    gpt-oss's template shows that turn closed by ``<|end|>`` (and drops its analysis) once
    messages follow. The delta is the question and the generation prompt only."""
    ret = gpt_oss.convert_tokens_to_ids("<|return|>")
    conversation = [AgentMessage(role="user", content="What is 2 + 2?"),
                    AgentMessage(role="assistant", content="It is 4.")]
    delta = render_turn_delta(gpt_oss, conversation,
                              [AgentMessage(role="user", content="And 3 + 3?")], None, ret)
    assert delta.text == ("<|start|>user<|message|>And 3 + 3?<|end|>"
                          "<|start|>assistant"), delta.text
    assert delta.drift == (DRIFT_PREFIX,)
    assert delta.ids == gpt_oss.encode(delta.text, add_special_tokens=False)


def test_gpt_oss_tool_turn_bridge_after_call(gpt_oss):
    """A tool-call turn (content None, as the OpenAI format has it) sampled to ``<|call|>``:
    the template renders the call, and the delta is the tool's answer in harmony's
    ``functions.<name> to=assistant`` form and the generation prompt."""
    call = gpt_oss.convert_tokens_to_ids("<|call|>")
    conversation = [
        AgentMessage(role="user", content="What is 2 + 3?"),
        AgentMessage(role="assistant", content=None, tool_calls=[ToolCall(
            id="c1", function=ToolFunction(name="calc", arguments='{"e": "2 + 3"}'))])]
    delta = render_turn_delta(gpt_oss, conversation, [AgentMessage(
        role="tool", content="5", tool_call_id="c1", name="calc")], None, call)
    assert delta.text.startswith("<|start|>functions.calc to=assistant<|channel|>commentary"
                                 "<|message|>"), delta.text
    assert delta.text.endswith("<|end|><|start|>assistant"), delta.text
    assert "2 + 3" not in delta.text  # nothing of the model's own call again
    # the whole conversation as the template renders it continues with exactly this delta
    whole = render(gpt_oss, [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "calc", "arguments": '{"e": "2 + 3"}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "calc"}],
        None, add_generation_prompt=True)
    assert whole.endswith("<|call|>" + delta.text)


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3.1", "gpt-oss", "deepseek-v3"])
def test_stored_calls_render_their_arguments_once_as_json(family_tokenizers, family):
    """OpenAI messages carry a call's arguments as a JSON string; re-rendered history (a row
    with earlier turns, the proxy's new segment, the trainer's check) must show them as the
    model wrote them, never double-encoded (Qwen2.5, Llama 3.1 and gpt-oss did), and a
    template that wants the string (DeepSeek-V3) still gets it. Broken arguments stay as
    written."""
    tokenizer = family_tokenizers[family]
    arguments = '{"expression": "2 + 3"}'
    for text in (arguments, '{"expression": '):
        call = {"id": "c1", "type": "function",
                "function": {"name": "calculator", "arguments": text}}
        rendered = render(tokenizer, [
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "5", "tool_call_id": "c1", "name": "calculator"}],
            None, add_generation_prompt=True)
        if text == arguments:
            assert arguments in rendered, rendered[-300:]
            assert '\\"expression\\"' not in rendered, rendered[-300:]
        else:  # not a JSON object: rendered as written (a template may escape it)
            assert "expression" in rendered


def test_deepseek_v3_bridges_after_a_tool_call_and_after_an_answer(family_tokenizers):
    """DeepSeek-V3's template (its prompt opens ``<think>``): after a call the tool outputs
    follow and the model goes on in the same turn (no new ``<｜Assistant｜>``); after an
    answer a user's question gets the generation prompt with the opened ``<think>``. Neither
    bridge repeats the model's own text."""
    tokenizer = family_tokenizers["deepseek-v3"]
    eos = tokenizer.eos_token_id
    call = AgentMessage(role="assistant", content=None, tool_calls=[ToolCall(
        id="c1", function=ToolFunction(name="calculator", arguments='{"e": "2 + 3"}'))])
    question = AgentMessage(role="user", content="What is 2 + 3?")
    delta = render_turn_delta(tokenizer, [question, call], [AgentMessage(
        role="tool", content="5", tool_call_id="c1")], None, eos)
    assert delta.text == ("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>5"
                          "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"), delta.text
    answer = AgentMessage(role="assistant", content="It is 5.")
    delta = render_turn_delta(tokenizer, [question, answer],
                              [AgentMessage(role="user", content="And 3 + 3?")], None, eos)
    assert delta.text == "<｜User｜>And 3 + 3?<｜Assistant｜><think>\n", delta.text
    assert delta.drift == ()
