"""The ``llm`` judger: LLM-as-judge through any :class:`pipeline.Engine`.

A prompt template is filled with the question, the answer, the ground truth and the data
source, rendered with the tokenizer's chat template, and sent to the engine token-in; the
reply is decoded and a score parser turns it into a number.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Callable
from typing import Any

from pipeline._concurrency.callables import check_callable, plain_result
from pipeline._concurrency.cancel import abort_request
from pipeline._data.config import SamplingParams
from pipeline._data.models import AgentRolloutItem, FinishReason
from pipeline._runner.context import Resources
from pipeline._text.render import decode_text, render_prompt
from pipeline._text.tokenizer import Tokenizer
from pipeline.engines import Engine
from pipeline.judgers._base import JudgeError, JudgeResult, question_text, response_text
from pipeline.judgers._registry import register_judger

DEFAULT_TEMPLATE = """\
Grade the answer to the question below against the reference answer.

Question:
{question}

Reference answer:
{ground_truth}

Answer to grade:
{answer}

Think briefly, then end with a line of the form "Score: N", where N is an integer from 0
(wrong) to 10 (fully correct)."""

_FIELDS = re.compile(r"\{(question|answer|ground_truth|data_source)\}")
_SCORE = re.compile(r"(?i)score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)")

ScoreParser = Callable[[str], float]
"""Turns the judge model's reply into a score; raises ``ValueError`` when it finds none."""


def fill_template(template: str, values: dict[str, str]) -> str:
    """Replace ``{question}``, ``{answer}``, ``{ground_truth}`` and ``{data_source}``.

    Other braces are left alone (no escaping needed for JSON examples in a prompt), and
    values are inserted once, never re-expanded.
    """
    return _FIELDS.sub(lambda m: values[m.group(1)], template)


def parse_score(reply: str) -> float:
    """The number in the last ``Score: N`` of ``reply``.

    Raises:
        ValueError: the reply has no such line.
    """
    found = _SCORE.findall(reply)
    if not found:
        raise ValueError("no 'Score: N' in the judge's reply")
    return float(found[-1])


@register_judger("llm")
class LLMJudger:
    """Asks a judge model for a score.

    Args:
        engine: any engine (a served judge model, or the policy's own engine).
        tokenizer: the judge model's tokenizer (chat template, encode, decode).
        template: the prompt; see :func:`fill_template` for the fields.
        system: an optional system message.
        parse: ``reply -> raw score``, a plain function (an ``async def`` is refused;
            default :func:`parse_score`). One that returns an awaitable fails the call.
        max_score: the raw score is divided by it (default 10: scores land in [0, 1]); a raw
            score outside ``[0, max_score]`` is an error.
        sampling: the judge's sampling (default: greedy, 512 tokens).
        name: the judger's name.
        abort_timeout_s: bound on aborting the judge request when judging is cancelled (a
            failed or slow abort is logged, never replaces the outcome).

    Raises:
        ConfigError: ``parse`` is not a plain callable (``field="parse"``).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, *, template: str = DEFAULT_TEMPLATE,
                 system: str | None = None, parse: ScoreParser = parse_score,
                 max_score: float = 10.0, sampling: SamplingParams | None = None,
                 name: str = "llm", abort_timeout_s: float = 10.0) -> None:
        if max_score <= 0:
            raise ValueError(f"max_score must be > 0, got {max_score}")
        # The Pipeline's own check: an engine and tokenizer that fit (eos paired, no classes).
        Resources(engine=engine, tokenizer=tokenizer)
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.system = system
        check_callable(parse, "parse", "sync", owner="LLMJudger", shape="(reply) -> float")
        self.parse = parse
        self.max_score = max_score
        self.sampling = sampling or SamplingParams(temperature=0.0, max_tokens=512)
        self.name = name
        self.abort_timeout_s = abort_timeout_s
        self._ids = itertools.count()

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """Ask the judge model and parse its score.

        Raises:
            JudgeError: the engine aborted, or the reply holds no valid score (the reply is
                kept in the error's payload).
            EngineError: the engine failed.
            ContractError: ``parse`` returned an awaitable (closed, never run).
        """
        truth = item.data.ground_truth
        prompt = fill_template(self.template, {
            "question": question_text(item), "answer": response_text(item),
            "ground_truth": "" if truth is None else str(truth),
            "data_source": item.data.data_source})
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        _, prompt_ids = await asyncio.to_thread(render_prompt, self.tokenizer, messages, None)
        request_id = f"judge-{item.uid}-{next(self._ids)}"
        try:
            gen = await self.engine.generate(prompt_ids, self.sampling, request_id)
        except asyncio.CancelledError:
            await abort_request(self.engine, request_id, self.abort_timeout_s, uid=item.uid)
            raise
        if gen.finish_reason is FinishReason.ABORT:
            raise JudgeError(f"the judge engine aborted request {request_id}")
        reply = decode_text(self.tokenizer, gen.token_ids, skip_special_tokens=True)
        payload: dict[str, Any] = {"reply": reply[-2000:], "finish_reason": gen.finish_reason.value}
        try:
            raw = float(plain_result(self.parse(reply), f"LLMJudger {self.name!r}: parse"))
        except ValueError as exc:
            raise JudgeError(f"could not parse a score from the judge's reply: {exc}",
                             payload=payload) from exc
        if not 0.0 <= raw <= self.max_score:
            raise JudgeError(f"judge score {raw} is outside [0, {self.max_score}]",
                             payload=payload)
        payload["raw_score"] = raw
        return JudgeResult(score=raw / self.max_score, payload=payload)
