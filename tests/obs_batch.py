"""A real pipeline batch with every kind of ending, for the observability tests.

Stages: ``BuildPrompt`` -> ``Loop([Generate, call_tools])`` -> ``outcome`` -> ``judge``.
Rows choose their fate through ``extra``: ``fail`` (the outcome stage raises), ``hang``
(it sleeps past the sample deadline), else the sample completes and is judged. Turn 0 of
every loop asks for a tool, so completed samples have one tool round (replies always fit
``max_tokens``).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from pipeline import (
    AgentMessage,
    AgentRolloutItem,
    BuildPrompt,
    Context,
    Generate,
    Loop,
    Pipeline,
    SimulatedEngine,
    ToolCall,
    ToolFunction,
    artifacts,
)
from pipeline.testing import ByteTokenizer

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]


class ToyTools:
    """Turn 0: the model "asks" for ``lookup``; the result is appended with mask 0."""

    name = "call_tools"

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        if ctx.turn != 0:
            return
        art = item.artifacts
        last = art[artifacts.MESSAGES][-1]
        last.tool_calls = [ToolCall(id=f"call-{item.uid}", function=ToolFunction(
            name="lookup", arguments='{"q": "x"}'))]
        await asyncio.sleep(0.002)
        text = "<|im_start|>tool\nlookup says 42<|im_end|>\n<|im_start|>assistant\n"
        ids = ctx.tokenizer.encode(text)
        art[artifacts.RESPONSE_IDS].extend(ids)
        art[artifacts.RESPONSE_MASK].extend([0] * len(ids))
        art[artifacts.LOGPROBS].extend([0.0] * len(ids))
        art[artifacts.MESSAGES].append(AgentMessage(role="tool", content="lookup says 42",
                                                    tool_call_id=f"call-{item.uid}"))
        art[artifacts.TOOL_TURNS] = art.get(artifacts.TOOL_TURNS, 0) + 1
        art["tool_calls"] = art.get("tool_calls", 0) + 1
        if item.data.extra.get("tool_error"):
            art["tool_errors"] = art.get("tool_errors", 0) + 1


async def outcome(item: AgentRolloutItem, ctx: Context) -> None:
    extra = item.data.extra
    if extra.get("fail"):
        raise ValueError(f"bad row {{brace}} in sample {item.uid}")
    if extra.get("hang"):
        await asyncio.sleep(30)
    if extra.get("drift"):
        item.artifacts["template_drift"] = ["assistant prefix differs"]
    item.artifacts["limiter_wait_s"] = 0.01 * (item.sample_index + 1)


class ToyJudge:
    """Reward 1.0 when the response has an even number of tokens, else 0.0."""

    name = "judge"

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        score = float(len(item.artifacts[artifacts.RESPONSE_IDS]) % 2 == 0)
        item.artifacts[artifacts.REWARD] = score
        item.artifacts[artifacts.REWARD_PAYLOAD] = {"score": score, "judger": "parity"}


def reply(prompt_ids: list[int], rng: random.Random) -> list[int]:
    """4 to 20 printable bytes, then eos: every turn stops well within ``max_tokens``."""
    return [rng.randrange(35, 126) for _ in range(rng.randint(4, 20))] + [2]


def make_pipeline(*, latency_s: float = 0.003, timeout_s: float = 0.3,
                  extra_stages: tuple[Any, ...] = ()) -> Pipeline:
    engine = SimulatedEngine(latency_s=latency_s, latency_sigma=0.3, tail_prob=0.0,
                             eos_token_id=2, seed=1, responder=reply)
    return Pipeline(
        [BuildPrompt(offload=False), Loop([Generate(), ToyTools()], max_turns=3), outcome,
         ToyJudge(), *extra_stages],
        engine=engine, tokenizer=ByteTokenizer(), sample_timeout_s=timeout_s,
        sampling={"max_tokens": 24})


def rows(num: int = 6) -> list[dict[str, Any]]:
    """Row 1 fails, row 2 hangs (times out), row 3 has a tool error and template drift."""
    out = []
    for i in range(num):
        extra = {"fail": i == 1, "hang": i == 2, "tool_error": i == 3, "drift": i == 3}
        out.append({"messages": [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": f"question {i}: what is 6*7?"}],
                    "tools": TOOLS, "data_source": "math" if i % 2 else "trivia",
                    "extra": extra})
    return out
