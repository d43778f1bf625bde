"""What the live token-integrity checks cost (issue 36 item 4; goal: < 5% of the tool loop's
per-sample CPU).

Run::

    python benchmarks/token_integrity.py            # full figures (about a minute)
    python benchmarks/token_integrity.py --quick    # smaller sizes, for a smoke run

Part 1, the checks alone, per turn (µs): what ``Generate`` and ``CallTools`` run per turn of
a tool loop (the loop's prefix check, the logprobs count, the decode comparison against an
engine-reported text, the turn marks), timed in a tight loop on a 4-turn conversation; and
the proxy's full prefix comparison of a merged request (a 2,000-token segment).

Part 2, the tool loop's CPU per sample with the checks on and off
(``PipelineConfig.token_integrity_checks``): ``BuildPrompt`` + ``Loop([Generate(),
CallTools()])`` on the simulated engine at zero latency (the event loop is the bottleneck,
so CPU time is what is measured), three calculator calls then an answer per sample (four
model turns, three tool turns), with the ``ByteTokenizer`` and with the tiny Qwen2 tokenizer
and chat template (a real BPE tokenizer: rendering costs more, so the checks' share is
smaller). The engine reports its text (``Generation.text``) so that the decode check runs
too. Runs alternate (on, off, on, off, ...); the medians and the median of the per-pair
ratios are reported, and the minimums (the run least disturbed by other processes: on a
shared 2-core machine the spread between runs is larger than the checks' cost); the order
alternates within pairs, on-off then off-on, so that neither side always runs first. The
most precise figure is ``checks_alone_share_pct``: Part 1's µs per turn times the model
turns, over the loop's CPU per sample with the checks off.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any

from _common import write_result

from pipeline import (
    BuildPrompt,
    FinishReason,
    Generate,
    Generation,
    Loop,
    Pipeline,
    SimulatedEngine,
)
from pipeline._text import integrity
from pipeline.stages import CallTools
from pipeline.testing import ByteTokenizer
from pipeline.tools import calculator_tool, make_registry

CALL = ('<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a} + {b}"}}}}\n'
        '</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
TOOL_TURNS = 3


class TextEngine(SimulatedEngine):
    """The simulated engine, scripted to call the calculator ``TOOL_TURNS`` times and then
    answer, each turn after ``latency_s``, reporting its text the way a server does (so the
    decode check runs) unless ``report_text`` is False. Also benchmarks/flat_cost.py's."""

    def __init__(self, tokenizer: Any, latency_s: float = 0.0,
                 report_text: bool = True) -> None:
        super().__init__(latency_s=latency_s, latency_sigma=0.0, tail_prob=0.0,
                         eos_token_id=tokenizer.eos_token_id)
        self.tokenizer = tokenizer
        self.turn_latency_s = latency_s
        self.report_text = report_text
        self._ids: dict[str, list[int]] = {}

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str) -> Generation:
        turn = int(request_id.rsplit("-", 1)[1])
        text = (CALL.format(a=turn + 1, b=turn + 2) if turn < TOOL_TURNS
                else f"Answer: {2 * turn + 1}")
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = self.tokenizer.encode(text, add_special_tokens=False)
        self.calls += 1
        await asyncio.sleep(self.turn_latency_s)
        tokens = [*ids, self.eos_token_id]
        return Generation(tokens, [-0.5] * len(tokens), FinishReason.STOP, "stop",
                          text=text if self.report_text else None)


def tool_pipeline(tokenizer: Any, checks: bool) -> Pipeline:
    return Pipeline([BuildPrompt(), Loop([Generate(), CallTools()], max_turns=TOOL_TURNS + 2)],
                    engine=TextEngine(tokenizer), tokenizer=tokenizer,
                    tools=make_registry([calculator_tool()]), sampling={"max_tokens": 256},
                    sample_timeout_s=600, max_concurrency=256, progress_log_s=None,
                    token_integrity_checks=checks)


ROWS = [{"prompt": f"Question {i}: add the numbers with the calculator.", "tools": TOOLS}
        for i in range(64)]


def cpu_per_sample(pipe: Pipeline, samples: int) -> float:
    rows = (ROWS * (samples // len(ROWS) + 1))[:samples]
    gc.collect()
    start = time.process_time()
    result = asyncio.run(pipe.run_batch(rows))
    spent = time.process_time() - start
    assert result.stats.by_status == {"completed": samples}, result.stats.by_status
    assert result.stats.tool_turns_min == TOOL_TURNS, result.stats.tool_turns_min
    assert result.stats.token_integrity == {}
    return spent / samples * 1e6


def loop_cost(tokenizer: Any, samples: int, pairs: int) -> dict[str, Any]:
    on_runs, off_runs, ratios = [], [], []
    cpu_per_sample(tool_pipeline(tokenizer, True), samples // 4)  # warm-up, both ways
    cpu_per_sample(tool_pipeline(tokenizer, False), samples // 4)
    for k in range(pairs):  # the order alternates within pairs: on-off, off-on, ...
        if k % 2 == 0:
            on = cpu_per_sample(tool_pipeline(tokenizer, True), samples)
            off = cpu_per_sample(tool_pipeline(tokenizer, False), samples)
        else:
            off = cpu_per_sample(tool_pipeline(tokenizer, False), samples)
            on = cpu_per_sample(tool_pipeline(tokenizer, True), samples)
        on_runs.append(round(on, 1))
        off_runs.append(round(off, 1))
        ratios.append(on / off)
    on_med, off_med = statistics.median(on_runs), statistics.median(off_runs)
    return {
        "samples_per_run": samples, "pairs": pairs,
        "model_turns_per_sample": TOOL_TURNS + 1, "tool_turns_per_sample": TOOL_TURNS,
        "checks_on_cpu_us_per_sample": on_med, "checks_off_cpu_us_per_sample": off_med,
        "share_of_median_pair_ratio_pct": round((statistics.median(ratios) - 1) * 100, 2),
        "share_of_medians_pct": round((on_med / off_med - 1) * 100, 2),
        "share_of_minimums_pct": round((min(on_runs) / min(off_runs) - 1) * 100, 2),
        "checks_on_runs_us": on_runs, "checks_off_runs_us": off_runs,
    }


def per_turn_cost(tokenizer: Any, repeats: int) -> dict[str, Any]:
    """The checks of one 4-turn conversation, timed alone (µs per model turn)."""
    prompt = tokenizer.encode("x " * 200)[:200]
    replies = [tokenizer.encode(CALL.format(a=t, b=t + 1)) for t in range(TOOL_TURNS)]
    replies.append(tokenizer.encode("Answer: 7"))
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in replies]
    delta = tokenizer.encode("\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n")
    turns = len(replies)

    def conversation() -> None:
        art: dict[str, Any] = {}
        response: list[int] = []
        for k, (ids, text) in enumerate(zip(replies, texts, strict=True)):
            assert integrity.loop_prefix_mismatch(art, prompt, response) is None
            logprobs = [-0.5] * len(ids)
            assert integrity.logprobs_mismatch(ids, logprobs) is None
            response.extend(ids)
            assert integrity.decode_mismatch(text, text) is None
            integrity.mark_turn(art, prompt, response)
            if k < turns - 1:
                response.extend(delta)
                integrity.mark_turn(art, prompt, response)

    def bare() -> None:  # the same list work without the checks
        response: list[int] = []
        for k, ids in enumerate(replies):
            response.extend(ids)
            if k < turns - 1:
                response.extend(delta)

    def timed(fn: Any) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats / turns * 1e6

    loop_us = statistics.median(timed(conversation) - timed(bare) for _ in range(5))
    segment = list(range(2000))
    request = [*segment, *delta]
    start = time.perf_counter()
    for _ in range(repeats):
        assert integrity.prefix_mismatch(segment, request) is None
    proxy_us = (time.perf_counter() - start) / repeats * 1e6
    return {"loop_checks_us_per_turn": round(loop_us, 2),
            "proxy_prefix_check_us_per_turn_2000_tokens": round(proxy_us, 2)}


def tiny_tokenizer() -> Any:
    try:
        from transformers import AutoTokenizer

        from pipeline.models import tiny_policy_dir
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(tiny_policy_dir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    samples, pairs, repeats = (256, 3, 2000) if args.quick else (1024, 9, 20000)
    figures: dict[str, Any] = {"engine": "simulated (zero latency), reports its text",
                               "goal_share_pct": 5.0}
    tokenizers = {"byte": ByteTokenizer()}
    tiny = tiny_tokenizer()
    if tiny is not None:
        tokenizers["tiny_qwen2"] = tiny
    for name, tok in tokenizers.items():
        figures[name] = {"per_turn": per_turn_cost(tok, repeats),
                         "tool_loop": loop_cost(tok, samples, pairs)}
        loop = figures[name]["tool_loop"]
        per_turn = figures[name]["per_turn"]["loop_checks_us_per_turn"]
        loop["checks_alone_share_pct"] = round(
            per_turn * loop["model_turns_per_sample"] / loop["checks_off_cpu_us_per_sample"]
            * 100, 2)
        print(name, figures[name])
    path = write_result("token_integrity", figures)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
