"""Built-in judgers: math, exact_match, regex, llm (simulated engine), http (real server)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web

from pipeline import AgentRolloutItem, SimulatedEngine
from pipeline.judgers import (
    ExactMatchJudger,
    HttpJudger,
    JudgeError,
    LLMJudger,
    MathJudger,
    RegexJudger,
    answers_equal,
    extract_answer,
    get_judger,
    parse_score,
)
from pipeline.judgers._llm import fill_template
from pipeline.judgers.testing import judge_item
from pipeline.testing import ByteTokenizer


def item_for(answer: str | None, ground_truth: Any = None, *, question: str = "What is 6*7?",
             data_source: str = "default") -> AgentRolloutItem:
    return judge_item(answer, ground_truth=ground_truth, data_source=data_source,
                      question=question, extra={"split": "test"}, uid="g-0")


# ---- math -------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "answer", "method"), [
    ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", "boxed"),
    ("\\boxed{x^{2}} then later \\fbox{\\{1, 2\\}}", "\\{1, 2\\}", "boxed"),
    ("nested \\boxed{\\sqrt{\\frac{a}{b}}} end", "\\sqrt{\\frac{a}{b}}", "boxed"),
    ("Natalia sold 48 clips.\n#### 72", "72", "gsm8k"),
    ("Therefore, the final answer is: 1,000.", "1,000", "answer_is"),
    ("first 3 apples, then 4, so 7 in all", "7", "last_number"),
    ("no digits here", None, "none"),
    ("\\boxed{unclosed", None, "none"),
])
def test_answer_extraction(text: str, answer: str | None, method: str) -> None:
    assert extract_answer(text, fallback_last_number=method != "none") == (answer, method)


@pytest.mark.parametrize(("a", "b", "equal"), [
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac12", "1/2", True),
    ("-\\frac{3}{4}", "-0.75", True),
    ("1,000", "1000", True),
    ("$42$", "42.0", True),
    ("50\\%", "50", True),
    ("90^\\circ", "90", True),
    ("x = 5", "5", True),
    ("5\\text{ cm}", "5", True),
    ("1e3", "1000", True),
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("0.3333333", "1/3", True),
    ("0.33", "1/3", False),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("2x", "2", False),
    ("\\sqrt{2}", "\\sqrt 2", False),  # not numbers: compared as normalized strings
    ("\\text{(A)}", "(A)", True),
])
def test_answer_equivalence(a: str, b: str, equal: bool) -> None:
    assert answers_equal(a, b)[0] is equal


async def test_math_judger_scores_and_explains() -> None:
    judge = MathJudger()
    right = await judge.judge(item_for("6*7 = \\boxed{42}", "42"))
    assert right.score == 1.0
    assert right.payload == {"extracted": "42", "extraction": "boxed", "ground_truth": "42",
                             "comparison": "numeric"}
    assert (await judge.judge(item_for("\\boxed{41}", 42))).score == 0.0
    assert (await judge.judge(item_for("\\boxed{0.5}", ["1/3", "\\frac{1}{2}"]))).score == 1.0
    assert (await judge.judge(item_for("It is \\boxed{42}", "\\boxed{42}"))).score == 1.0
    none = await judge.judge(item_for(None, "42"))
    assert none.score == 0.0 and none.payload["reason"] == "no final answer found"
    with pytest.raises(JudgeError, match="no ground_truth"):
        await judge.judge(item_for("\\boxed{1}", None))


# ---- exact_match / regex ---------------------------------------------------------------

async def test_exact_match() -> None:
    assert (await ExactMatchJudger().judge(item_for("  Paris \n", "Paris"))).score == 1.0
    assert (await ExactMatchJudger().judge(item_for("paris", "Paris"))).score == 0.0
    folded = ExactMatchJudger(case_sensitive=False)
    assert (await folded.judge(item_for("paris", ["Lyon", "PARIS"]))).score == 1.0
    boxed = ExactMatchJudger(extract="boxed")
    assert (await boxed.judge(item_for("thinking... \\boxed{B}", "B"))).score == 1.0
    missing = await boxed.judge(item_for("no box", "B"))
    assert missing.score == 0.0 and missing.payload["extracted"] is None
    last = ExactMatchJudger(extract="last_line")
    assert (await last.judge(item_for("work\nmore work\n  B  \n\n", "B"))).score == 1.0


async def test_regex_with_a_pattern_and_with_the_ground_truth_as_pattern() -> None:
    grab = RegexJudger(r"Answer:\s*([A-D])", group=1)
    result = await grab.judge(item_for("Answer: A\n...no wait. Answer: C", "C"))
    assert result.score == 1.0 and result.payload["matched"] == "C"
    assert (await grab.judge(item_for("Answer: B", "C"))).score == 0.0
    assert (await grab.judge(item_for("I refuse", "C"))).payload["reason"] == "no match"
    fmt = RegexJudger(r"<answer>.*</answer>", fullmatch=True)
    assert (await fmt.judge(item_for(" <answer>4</answer> "))).score == 1.0
    assert (await fmt.judge(item_for("x <answer>4</answer>"))).score == 0.0
    from_row = RegexJudger()
    assert (await from_row.judge(item_for("the value is 12.50", r"12\.50?"))).score == 1.0
    with pytest.raises(JudgeError, match="not a valid pattern"):
        await from_row.judge(item_for("x", "(unclosed"))


# ---- llm ----------------------------------------------------------------------------------

def judge_engine(reply: str, seen: list[str], tok: ByteTokenizer) -> SimulatedEngine:
    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        seen.append(tok.decode(prompt_ids))
        return [*tok.encode(reply), tok.eos_token_id]
    return SimulatedEngine(latency_s=0.001, latency_sigma=0.0, tail_prob=0.0,
                           eos_token_id=tok.eos_token_id, responder=respond)


async def test_llm_judger_through_the_simulated_engine() -> None:
    tok, seen = ByteTokenizer(), []
    engine = judge_engine("The answer matches. Score: 8", seen, tok)
    judge = LLMJudger(engine, tok, system="You are strict.")
    result = await judge.judge(item_for("It is {42} (json: {\"a\": 1})", "42"))
    assert result.score == pytest.approx(0.8)
    assert result.payload["raw_score"] == 8.0 and result.payload["finish_reason"] == "stop"
    prompt = seen[0]
    assert prompt.startswith("<|im_start|>system\nYou are strict.<|im_end|>")
    assert "What is 6*7?" in prompt and "It is {42} (json: {\"a\": 1})" in prompt
    assert "Reference answer:\n42" in prompt and prompt.endswith("<|im_start|>assistant\n")


async def test_llm_judger_custom_template_parser_and_bad_replies() -> None:
    tok, seen = ByteTokenizer(), []
    judge = LLMJudger(judge_engine("VERDICT=yes", seen, tok), tok,
                      template="Q={question} A={answer} {not_a_field}",
                      parse=lambda reply: 1.0 if "yes" in reply else 0.0, max_score=1.0)
    assert (await judge.judge(item_for("42"))).score == 1.0
    assert "Q=What is 6*7? A=42 {not_a_field}" in seen[0]
    garbled = LLMJudger(judge_engine("I cannot decide.", [], tok), tok)
    with pytest.raises(JudgeError, match="could not parse a score") as info:
        await garbled.judge(item_for("42"))
    assert info.value.payload["reply"] == "I cannot decide."
    too_high = LLMJudger(judge_engine("Score: 11", [], tok), tok)
    with pytest.raises(JudgeError, match="outside"):
        await too_high.judge(item_for("42"))
    assert parse_score("Score: 3\n... final **Score: 7.5**") == 7.5
    assert fill_template("{answer}", {"answer": "{question}", "question": "Q"}) == "{question}"


async def test_llm_judger_from_the_registry() -> None:
    tok = ByteTokenizer()
    judge = get_judger("llm", engine=judge_engine("Score: 10", [], tok), tokenizer=tok)
    assert (await judge.judge(item_for("42", "42"))).score == 1.0


# ---- http ---------------------------------------------------------------------------------

Handler = Callable[[web.Request], Any]


@pytest.fixture
async def service() -> AsyncIterator[tuple[str, dict[str, list[Any]]]]:
    """A reward service on 127.0.0.1 with well-behaved and misbehaving endpoints."""
    calls: dict[str, list[Any]] = {}

    def endpoint(name: str, behave: Callable[[int, dict[str, Any]], Any]) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            calls.setdefault(name, []).append(body)
            return await behave(len(calls[name]), body)
        return handle

    async def ok(n: int, body: dict[str, Any]) -> web.StreamResponse:
        score = float(body["response"].strip() == str(body["ground_truth"]))
        return web.json_response({"score": score, "judge": "remote"})

    async def flaky(n: int, body: dict[str, Any]) -> web.StreamResponse:
        if n <= 2:
            return web.Response(status=503, text="overloaded")
        return web.json_response(0.25)

    async def slow_once(n: int, body: dict[str, Any]) -> web.StreamResponse:
        if n == 1:
            await asyncio.sleep(0.6)
        return web.json_response({"score": 1})

    async def bad_request(n: int, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=400, text="missing field")

    async def down(n: int, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(status=500, text="boom")

    async def not_json(n: int, body: dict[str, Any]) -> web.StreamResponse:
        return web.Response(text="<html>")

    app = web.Application()
    for name, behave in [("ok", ok), ("flaky", flaky), ("slow", slow_once),
                         ("bad", bad_request), ("down", down), ("html", not_json)]:
        app.router.add_post(f"/{name}", endpoint(name, behave))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", calls
    await runner.cleanup()


async def test_http_judger_posts_the_trajectory(service) -> None:  # type: ignore[no-untyped-def]
    url, calls = service
    judge = HttpJudger(f"{url}/ok")
    try:
        result = await judge.judge(item_for(" 42 ", 42, data_source="gsm8k"))
    finally:
        await judge.aclose()
    assert result.score == 1.0 and result.payload == {"judge": "remote", "attempts": 1}
    body = calls["ok"][0]
    assert body["data_source"] == "gsm8k" and body["ground_truth"] == 42
    assert body["uid"] == "g-0" and body["extra"] == {"split": "test"}
    assert body["messages"][-1] == {"role": "assistant", "content": " 42 "}
    json.dumps(body)  # plain JSON all the way


async def test_http_judger_retries_server_errors_and_timeouts(service) -> None:  # type: ignore[no-untyped-def]
    url, calls = service
    async with asyncio.timeout(10):
        flaky = HttpJudger(f"{url}/flaky", retries=2, backoff_s=0.01)
        slow = HttpJudger(f"{url}/slow", timeout_s=0.3, retries=1, backoff_s=0.01)
        try:
            result = await flaky.judge(item_for("x"))
            assert result.score == 0.25 and result.payload["attempts"] == 3
            assert len(calls["flaky"]) == 3
            result = await slow.judge(item_for("x"))
            assert result.score == 1.0 and result.payload["attempts"] == 2
        finally:
            await flaky.aclose()
            await slow.aclose()


async def test_http_judger_gives_up_clearly(service) -> None:  # type: ignore[no-untyped-def]
    url, calls = service
    down = HttpJudger(f"{url}/down", retries=2, backoff_s=0.01)
    bad = HttpJudger(f"{url}/bad", retries=2, backoff_s=0.01)
    html = HttpJudger(f"{url}/html", retries=2, backoff_s=0.01)
    refused = HttpJudger("http://127.0.0.1:9/nothing", retries=1, backoff_s=0.01, timeout_s=1)
    try:
        with pytest.raises(JudgeError, match="failed 3 times; last: HTTP 500: boom"):
            await down.judge(item_for("x"))
        assert len(calls["down"]) == 3
        with pytest.raises(JudgeError, match="HTTP 400: missing field"):
            await bad.judge(item_for("x"))
        assert len(calls["bad"]) == 1  # a client error is not retried
        with pytest.raises(JudgeError, match="invalid JSON"):
            await html.judge(item_for("x"))
        with pytest.raises(JudgeError, match="failed 2 times; last: Client"):
            await refused.judge(item_for("x"))
    finally:
        for judge in (down, bad, html, refused):
            await judge.aclose()
