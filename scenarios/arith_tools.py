"""rollout run arith  (or: python -m scenarios.arith_tools [--count N] [--n K] [--seed S])
rollout run arith --family qwen3  (qwen2.5, llama3.1, gpt-oss, deepseek-v3: a real family)

Arithmetic word problems solved with a calculator tool: a multi-turn agent loop on a real model.
``rollout run arith --engine simulated`` runs the same loop on the simulated engine, with a
scripted agent (:func:`responder`) that calls the calculator and then answers.

The stage list is ``BuildPrompt -> Loop([Generate, CallTools]) -> numeric_match_reward``. The
default model (:func:`default_model`) is the tiny policy shipped with the package
(:func:`pipeline.models.tiny_policy_dir`, trained by ``python -m scenarios.train_tiny_policy``):
a tiny Qwen2 model that calls the calculator in about nine samples of ten and solves about a
third of the problems, on purpose short of perfect so RL has room to improve it.
``--model DIR`` runs another one (the random tiny model shows the machinery, not skill).

``rollout run arith --family NAME`` runs the loop with a model family's real tokenizer, chat
template, tool and reasoning parsers and stop ids (:mod:`pipeline.families`), on scripted
replies written in the family's own format (:func:`family_responder`): hermes blocks after a
``<think>`` block for Qwen3, ``<|python_tag|>`` JSON ending ``<|eom_id|>`` for Llama 3.1,
harmony channels ending ``<|call|>`` for gpt-oss, DeepSeek's tool markup. The scripted
replies show the machinery (calls and reasoning parsed, tokens checked), not skill.

Knobs: ``rows(count, seed)`` draws problems; ``stages(max_turns)`` sets how many assistant turns
a sample may take; sampling (``max_tokens`` per turn, ``max_response_tokens`` over the whole
trajectory) comes from the pipeline config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
from pathlib import Path
from typing import Any, NamedTuple

from pipeline import AgentMessage, AgentRolloutItem, Context, Tokenizer
from pipeline import artifacts as A
from pipeline.engines import Responder
from pipeline.families import FAMILIES
from pipeline.stages import BuildPrompt, CallTools, Generate, Loop
from pipeline.tools import Tool, calculator_tool, make_registry, tool_schema

DATA_SOURCE = "arith_tools"
SYSTEM_PROMPT = ("Solve the word problem. Use the calculator tool for the arithmetic, then "
                 "reply with one line: Answer: <number>.")

_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jo")
_ITEMS = ("apples", "books", "coins", "marbles", "stamps", "cards", "shells", "pens")


class Problem(NamedTuple):
    """One word problem: its text, the integer answer and the expression that computes it."""

    question: str
    answer: int
    expression: str


def draw_problem(rng: random.Random) -> Problem:
    """One seeded problem (the draws :func:`rows` makes, so the same seed gives the same ones)."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(4)
    if kind == 0:
        a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 12)
        return Problem(f"{name} has {a} {item} and buys {b} boxes with {c} {item} in each. "
                       f"How many {item} does {name} have now?", a + b * c, f"{a} + {b} * {c}")
    if kind == 1:
        groups, each, lost = rng.randint(3, 12), rng.randint(5, 40), rng.randint(1, 20)
        return Problem(f"{name} packs {groups} bags of {each} {item} and then loses {lost} "
                       f"{item}. How many {item} are left?", groups * each - lost,
                       f"{groups} * {each} - {lost}")
    if kind == 2:
        share, people = rng.randint(4, 30), rng.randint(2, 9)
        total = share * people
        return Problem(f"{name} shares {total} {item} equally among {people} friends. "
                       f"How many {item} does each friend get?", share, f"{total} / {people}")
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    return Problem(f"{name} counts {a} {item} on Monday and {b} on Tuesday. What is the total?",
                   a + b, f"{a} + {b}")


def rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` problems in the row schema, the same ones for the same ``seed``.

    Each row has ``messages`` (system + user), ``tools`` (the calculator's OpenAI schema),
    ``ground_truth`` (the integer answer, as text) and ``data_source``.
    """
    rng = random.Random(seed)
    schemas = [tool_schema(t) for t in tools().values()]
    out = []
    for _ in range(count):
        question, answer, _ = draw_problem(rng)
        out.append({
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": question}],
            "tools": schemas,
            "ground_truth": str(answer),
            "data_source": DATA_SOURCE,
        })
    return out


def tools() -> dict[str, Tool]:
    """The tool registry for ``Pipeline(tools=...)``: just the calculator."""
    return make_registry([calculator_tool()])


_ANSWER = re.compile(r"answer\s*[:=]?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_number(text: str) -> float | None:
    """The number after ``Answer:``, else the last number in ``text``; None if there is none."""
    found = _ANSWER.findall(text) or _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


async def numeric_match_reward(item: AgentRolloutItem, ctx: Context) -> None:
    """Reward 1.0 when the final assistant message's number equals the ground truth, else 0.0."""
    final = next((m for m in reversed(item.artifacts.get(A.MESSAGES, ()))
                  if isinstance(m, AgentMessage) and m.role == "assistant"), None)
    text = final.content if final is not None and isinstance(final.content, str) else ""
    predicted = extract_number(text)
    expected = extract_number(str(item.data.ground_truth))
    correct = (predicted is not None and expected is not None
               and math.isclose(predicted, expected, rel_tol=1e-9, abs_tol=1e-9))
    item.artifacts[A.REWARD] = 1.0 if correct else 0.0
    item.artifacts[A.REWARD_PAYLOAD] = {"score": 1.0 if correct else 0.0, "acc": correct,
                                        "predicted": predicted, "expected": expected}


_EXPRESSIONS = (
    (re.compile(r"has (\d+) \w+ and buys (\d+) boxes with (\d+)"), "{} + {} * {}"),
    (re.compile(r"packs (\d+) bags of (\d+) \w+ and then loses (\d+)"), "{} * {} - {}"),
    (re.compile(r"shares (\d+) \w+ equally among (\d+)"), "{} / {}"),
    (re.compile(r"counts (\d+) \w+ on Monday and (\d+)"), "{} + {}"),
)


def expression_of(question: str) -> str | None:
    """The arithmetic a problem from :func:`draw_problem` asks for, read back from its text."""
    for pattern, template in _EXPRESSIONS:
        found = pattern.search(question)
        if found:
            return template.format(*found.groups())
    return None


def responder(tokenizer: Tokenizer, tool_rate: float = 0.9) -> Responder:
    """A scripted agent for the simulated engine, so the tool loop runs without a model.

    First turn: a hermes ``<tool_call>`` to the calculator with the problem's expression
    (``tool_rate`` of the time; otherwise a guessed answer). After a tool reply: ``Answer:``
    with the tool's result. Every reply ends with the tokenizer's eos, so turns stop.
    """
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0

    def reply(prompt_ids: list[int], rng: random.Random) -> list[int]:
        text = tokenizer.decode(prompt_ids)
        last_user, last_tool = text.rfind("user\n"), text.rfind("tool\n")
        if last_tool > last_user:  # the calculator answered: report its result
            result = text[last_tool + len("tool\n"):].split("<|im_end|>")[0].strip()
            out = f"Answer: {result}"
        else:
            expression = expression_of(text[last_user:])
            if expression is None or rng.random() >= tool_rate:
                out = f"Answer: {rng.randint(0, 999)}"
            else:
                call = {"name": "calculator", "arguments": {"expression": expression}}
                out = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        return [*tokenizer.encode(out, add_special_tokens=False), eos]

    return reply


_THOUGHT = "The calculator does the arithmetic; I call it, then report its result."
# Per family: where a prompt's last user message and last tool result start, how a call turn
# and an answer turn are written ({thought}, {expression}, {answer}), and their stop tokens.
_FORMATS: dict[str, dict[str, str]] = {
    "qwen2.5": dict(
        user="<|im_start|>user\n", tool="<tool_response>\n",
        call="<tool_call>\n"
             '{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n'
             "</tool_call>", call_stop="<|im_end|>",
        answer="Answer: {answer}", answer_stop="<|im_end|>"),
    "qwen3": dict(
        user="<|im_start|>user\n", tool="<tool_response>\n",
        call="<think>\n{thought}\n</think>\n\n<tool_call>\n"
             '{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n'
             "</tool_call>", call_stop="<|im_end|>",
        answer="<think>\n{thought}\n</think>\n\nAnswer: {answer}", answer_stop="<|im_end|>"),
    "llama3.1": dict(
        user="<|start_header_id|>user<|end_header_id|>", tool="<|start_header_id|>ipython",
        call='<|python_tag|>{{"name": "calculator", '
             '"parameters": {{"expression": "{expression}"}}}}',
        call_stop="<|eom_id|>", answer="Answer: {answer}", answer_stop="<|eot_id|>"),
    "gpt-oss": dict(
        user="<|start|>user<|message|>", tool="<|start|>functions.calculator",
        call="<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>"
             "commentary to=functions.calculator <|constrain|>json<|message|>"
             '{{"expression": "{expression}"}}', call_stop="<|call|>",
        answer="<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>"
               "final<|message|>Answer: {answer}", answer_stop="<|return|>"),
    "deepseek-v3": dict(
        user="<｜User｜>", tool="<｜tool▁output▁begin｜>",
        call="{thought}</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
             "<｜tool▁sep｜>calculator\n```json\n{{\"expression\": \"{expression}\"}}\n```"
             "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", call_stop="<｜end▁of▁sentence｜>",
        answer="{thought}</think>\n\nAnswer: {answer}", answer_stop="<｜end▁of▁sentence｜>"),
}


def family_responder(tokenizer: Tokenizer, family: str) -> Responder:
    """A scripted agent writing in ``family``'s own format (see the module doc), for the
    simulated engine: a calculator call with the problem's expression, then ``Answer:`` with
    the tool's result, each turn ending on the family's stop token for it."""
    spec = _FORMATS[family]
    record = FAMILIES[family]

    def reply(prompt_ids: list[int], rng: random.Random) -> list[int]:
        text = tokenizer.decode(prompt_ids)  # special tokens kept: the markers are some
        last_user, last_tool = text.rfind(spec["user"]), text.rfind(spec["tool"])
        if last_tool > last_user:  # the calculator answered: report its result
            found = _NUMBER.search(text, last_tool + len(spec["tool"]))
            answer = found.group() if found else "?"
            out = spec["answer"].format(thought=_THOUGHT, answer=answer)
            stop = spec["answer_stop"]
        else:
            expression = expression_of(text[last_user:]) or "0"
            out = spec["call"].format(thought=_THOUGHT, expression=expression)
            stop = spec["call_stop"]
        return [*tokenizer.encode(out, add_special_tokens=False), record.token_id(stop)]

    return reply


def default_model() -> Path:
    """The model directory ``rollout run arith`` uses unless ``--model`` says otherwise."""
    from pipeline.models import tiny_policy_dir

    return tiny_policy_dir()


def stages(max_turns: int = 4, family: str | None = None) -> list[Any]:
    """The plain stage list of this scenario; ``family`` reads turns with that family's
    parsers and stops on its stop ids (``Generate(family=...)``)."""
    return [BuildPrompt(), Loop([Generate(family=family), CallTools()], max_turns=max_turns),
            numeric_match_reward]


async def run(count: int = 8, n: int = 2, seed: int = 0) -> Any:
    """Run the scenario on the tiny policy with :class:`TransformersEngine`; returns the batch
    result (``samples``, ``items``, ``stats``)."""
    from pipeline import Pipeline
    from pipeline.engines.transformers import TransformersEngine

    model_dir = default_model()
    engine = await asyncio.to_thread(TransformersEngine.from_pretrained, model_dir,
                                     max_batch_size=64, max_model_len=2048)
    try:
        pipeline = Pipeline(stages(), engine=engine, tokenizer=engine.tokenizer, tools=tools(),
                            config={"seed": seed, "sample_timeout_s": 300,
                                    "sampling": {"max_tokens": 96, "max_response_tokens": 512}})
        return await pipeline.run_batch(rows(count, seed), n=n)
    finally:
        await engine.aclose()


def main() -> None:
    """Command line entry point (the CLI's ``rollout run arith`` does the same)."""
    parser = argparse.ArgumentParser(prog="python -m scenarios.arith_tools")
    parser.add_argument("--count", type=int, default=8, help="problems (default 8)")
    parser.add_argument("--n", type=int, default=2, help="rollouts per problem (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = asyncio.run(run(args.count, args.n, args.seed))
    print(result.stats.model_dump_json(indent=1))


if __name__ == "__main__":
    main()
