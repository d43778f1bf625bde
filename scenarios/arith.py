"""Arithmetic questions answered in one turn, scored by numeric match.

Run it::

    rollout run arith-single --engine simulated --rows 64 --n 4

The stage list is plain Python: build the prompt, generate one answer, score it with a small
custom stage. On the simulated engine a scripted responder answers (correctly 70% of the
time), so the rewards are meaningful while the figures show only the pipeline's own cost.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from pipeline import AgentRolloutItem, BuildPrompt, Context, Generate, Tokenizer, artifacts
from pipeline.engines import Responder

SYSTEM = "Answer the question. Put the final number in <answer></answer>."
_QUESTION = re.compile(r"What is (-?\d+) ([+\-*]) (-?\d+)\?")
_ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` seeded questions in the row schema."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b, op = rng.randint(0, 99), rng.randint(0, 99), rng.choice("+-*")
        out.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"What is {a} {op} {b}?"},
                ],
                "ground_truth": str(_OPS[op](a, b)),
                "data_source": "arith",
            }
        )
    return out


def answer_of(text: str) -> str | None:
    """The last ``<answer>N</answer>`` of ``text``, or None."""
    found = _ANSWER.findall(text)
    return found[-1] if found else None


async def score_answer(item: AgentRolloutItem, ctx: Context) -> None:
    """Reward 1.0 when the last ``<answer>`` equals the ground truth, else 0.0."""
    messages = item.artifacts.get(artifacts.MESSAGES, [])
    text = next((m.content for m in reversed(messages) if m.role == "assistant"), None) or ""
    answer = answer_of(text if isinstance(text, str) else "")
    correct = answer is not None and answer == str(item.data.ground_truth)
    item.artifacts[artifacts.REWARD] = 1.0 if correct else 0.0
    item.artifacts[artifacts.REWARD_PAYLOAD] = {
        "score": 1.0 if correct else 0.0,
        "extracted": answer,
    }


def default_model() -> Path:
    """The model a real engine runs here unless ``--model`` says otherwise: the shipped tiny
    policy, like ``rollout run arith``. It was trained for the tool scenario's format (a
    calculator call, then ``Answer: N``), not ``<answer>`` tags, so on a real engine this
    one-turn scenario scores near 0; the simulated engine is its main engine."""
    from pipeline.models import tiny_policy_dir

    return tiny_policy_dir()


def stages() -> list[Any]:
    """The stage list: prompt, one generation, scoring."""
    return [BuildPrompt(), Generate(), score_answer]


def responder(tokenizer: Tokenizer, accuracy: float = 0.7) -> Responder:
    """A scripted reply for the simulated engine: the right answer ``accuracy`` of the time."""

    def reply(prompt_ids: list[int], rng: random.Random) -> list[int]:
        found = _QUESTION.findall(tokenizer.decode(prompt_ids))
        if not found:
            value = rng.randint(0, 99)
        else:
            a, op, b = found[-1]
            value = _OPS[op](int(a), int(b))
            if rng.random() > accuracy:
                value += rng.choice([-10, -1, 1, 10])
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        return [*tokenizer.encode(f"<answer>{value}</answer>", add_special_tokens=False), eos]

    return reply
