"""Render, tokenize and parse cost per turn, per model family (issue 36's figures).

Run::

    python benchmarks/family_render.py            # full figures (about a minute)
    python benchmarks/family_render.py --quick    # fewer repetitions, for a smoke run

For each family of :mod:`pipeline.families` (its real vocabulary and chat template, its
parsers), on a calculator conversation with the family's tool schema:

- ``prompt_us``: the prompt of a one-question row, rendered and tokenized
  (``render_prompt``, what ``BuildPrompt`` does per sample);
- ``tool_turn_us``: one tool turn's delta (``render_turn_delta``: the two small renderings,
  the bridge after the stop token, its tokens and the boundary check), what ``CallTools``
  does per tool turn; ``drift`` says what the template did (empty: prefix-stable);
- ``parse_us``: the family's parser (its record's tool and reasoning parsers: the built-in
  hermes one, else vLLM's through ``VLLMToolParser``) on the assistant's call as the
  family's template writes it, decoded as ``Generate`` decodes it for that parser;
- ``integrity_us``: the per-turn token-integrity checks (prefix, logprobs, decode
  comparison; the decode itself is the message's, made anyway) on the same turn.

Figures are the median of 5 rounds, each the mean over many repetitions, in µs on one core.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from _common import write_result

from pipeline import AgentMessage, ToolCall, ToolFunction
from pipeline._text import integrity
from pipeline._text.render import decode_text, encode_text, render, render_prompt
from pipeline._text.render import render_turn_delta as turn_delta
from pipeline.families import FAMILIES, family_tokenizer
from pipeline.tools import calculator_tool, make_tool_parser, tool_schema

QUESTION = "What is (2 + 3) * 4? Use the calculator."
ARGUMENTS = '{"expression": "2 + 3"}'


def per_call_us(work: Callable[[], object], repeat: int) -> float:
    """Median over 5 rounds of the mean time of ``work`` (µs)."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            work()
        rounds.append((time.perf_counter() - start) / repeat * 1e6)
    return round(statistics.median(rounds), 1)


def assistant_text(tokenizer: Any, user: dict[str, Any], call: dict[str, Any],
                   tools: list[dict[str, Any]]) -> str:
    """The assistant's call turn as the family's template writes it (what the model is
    trained to produce), without the template's closing token."""
    prompt = render(tokenizer, [user], tools, add_generation_prompt=True)
    whole = render(tokenizer, [user, call], tools, add_generation_prompt=False)
    return whole[len(prompt):] if whole.startswith(prompt) else whole


def measure(name: str, repeat: int) -> dict[str, Any]:
    record = FAMILIES[name]
    tokenizer = family_tokenizer(name)
    tools = [tool_schema(calculator_tool())]
    user = {"role": "user", "content": QUESTION}
    call = ToolCall(id="c1", function=ToolFunction(name="calculator", arguments=ARGUMENTS))
    assistant = AgentMessage(role="assistant", content="", tool_calls=[call])
    tool = AgentMessage(role="tool", content="5", tool_call_id="c1", name="calculator")
    conversation = [AgentMessage(role="user", content=QUESTION), assistant]
    stop = record.stop_token_ids[0]
    # the stop the model ends a call turn with: the family's call-ending token if it has one
    for token in ("<|call|>", "<|eom_id|>"):
        if token in record.stop_tokens:
            stop = record.token_id(token)

    _, prompt_ids = render_prompt(tokenizer, [user], tools)
    delta = turn_delta(tokenizer, conversation, [tool], tools, stop)

    parser = make_tool_parser(tokenizer, record.tool_parser or "hermes",
                              record.reasoning_parser)
    special = bool(getattr(parser, "needs_special_tokens", False))
    reply_text = assistant_text(tokenizer, user, {
        "role": "assistant", "content": "", "tool_calls": [call.model_dump(mode="json")]},
        tools)
    reply_ids = encode_text(tokenizer, reply_text)
    parse_input = decode_text(tokenizer, reply_ids, skip_special_tokens=not special)
    parsed = parser.parse(parse_input)

    logprobs = [-0.5] * len(reply_ids)
    # the loop decodes the turn anyway (the message's text): the check compares that decode
    # with the engine's own text, so the decode is not part of its cost
    engine_text = decode_text(tokenizer, reply_ids, skip_special_tokens=True)
    decoded = "".join(engine_text)
    response = [*reply_ids, *delta.ids]
    # the marks the loop holds after one turn; each timed call starts from a copy of them
    # (marks grow by one per turn: reusing one dict would time a conversation growing
    # to thousands of turns)
    turn_marks: dict[str, Any] = {}
    integrity.mark_turn(turn_marks, prompt_ids, reply_ids)

    def checks() -> None:
        artifacts = {integrity.MARKS: list(turn_marks[integrity.MARKS])}
        integrity.loop_prefix_mismatch(artifacts, prompt_ids, response)
        integrity.logprobs_mismatch(reply_ids, logprobs)
        integrity.decode_mismatch(decoded, engine_text)
        integrity.mark_turn(artifacts, prompt_ids, response)

    return {
        "tool_parser": parser.name,
        "prompt_tokens": len(prompt_ids),
        "tool_turn_tokens": len(delta.ids),
        "drift": list(delta.drift),
        "calls_parsed": [c.name for c in parsed.calls],
        "prompt_us": per_call_us(lambda: render_prompt(tokenizer, [user], tools), repeat),
        "tool_turn_us": per_call_us(
            lambda: turn_delta(tokenizer, conversation, [tool], tools, stop), repeat),
        "parse_us": per_call_us(lambda: parser.parse(parse_input), repeat),
        "integrity_us": per_call_us(checks, repeat * 10),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    repeat = 20 if args.quick else 200
    figures = {name: measure(name, repeat) for name in FAMILIES}
    for name, row in figures.items():
        print(f"{name:12} prompt {row['prompt_us']:8.1f} us  tool turn {row['tool_turn_us']:8.1f}"
              f" us  parse {row['parse_us']:8.1f} us ({row['tool_parser']})  integrity "
              f"{row['integrity_us']:6.1f} us  drift {row['drift'] or '-'}  calls "
              f"{row['calls_parsed']}")
    path = write_result("family_render", {"repeat": repeat, "families": figures,
                                          "note": "2-core machine, quiet"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
