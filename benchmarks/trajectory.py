"""What trajectory dumps cost: write and read throughput, bytes per sample, trace conversion.

Run::

    python benchmarks/trajectory.py            # 2,000 samples (about half a minute)
    python benchmarks/trajectory.py --quick    # 300 samples, for a smoke run

The samples are real: a batch through ``Pipeline`` on the simulated engine (zero latency)
with the byte tokenizer, a system prompt with a tool schema, up to 3 agent turns of up to
256 tokens with a tool reply after the first, and a judge. Each figure times only the part
named (the batch is produced once; medians of 3 runs): ``TrajectoryWriter.write`` for
every sample (without and with token ids; with ``fsync`` per line on a subset),
``batch_metrics``, then, with the batch dropped from memory as in a fresh ``rollout
inspect`` process, ``read_trajectories`` and ``build_trace`` + ``json.dump``. The writer's
cost inside a batch is measured too: the same batch with and without ``on_sample_done``
set to the writer, alternating, medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import write_result

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
from pipeline.observability import (
    TrajectoryWriter,
    batch_metrics,
    build_trace,
    read_trajectories,
)
from pipeline.testing import ByteTokenizer

SYSTEM = ("You are a careful assistant. Think step by step, call the calculator when "
          "arithmetic is needed, and end with 'Answer: <number>'. ") * 3
REPEATS = 3
"""Each write and read figure is the median of this many runs."""

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


class CalculatorReply:
    """After the first turn: a tool call on the reply and the tool's answer (mask 0)."""

    name = "call_tools"

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        if ctx.turn != 0:
            return
        art = item.artifacts
        art[artifacts.MESSAGES][-1].tool_calls = [ToolCall(id="call-0", function=ToolFunction(
            name="calculator", arguments='{"expression": "17 * 23"}'))]
        text = "<|im_start|>tool\n391<|im_end|>\n<|im_start|>assistant\n"
        ids = ctx.tokenizer.encode(text)
        art[artifacts.RESPONSE_IDS].extend(ids)
        art[artifacts.RESPONSE_MASK].extend([0] * len(ids))
        art[artifacts.LOGPROBS].extend([0.0] * len(ids))
        art[artifacts.MESSAGES].append(AgentMessage(role="tool", content="391",
                                                    tool_call_id="call-0"))
        art[artifacts.TOOL_TURNS] = 1


async def judge(item: AgentRolloutItem, ctx: Context) -> None:
    score = float(len(item.artifacts[artifacts.RESPONSE_IDS]) % 2)
    item.artifacts[artifacts.REWARD] = score
    item.artifacts[artifacts.REWARD_PAYLOAD] = {"score": score, "judger": "parity"}


def make_pipeline(tokenizer: ByteTokenizer) -> Pipeline:
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0, vocab_size=200,
                             eos_token_id=tokenizer.eos_token_id, seed=3)
    return Pipeline([BuildPrompt(offload=False), Loop([Generate(), CalculatorReply()], max_turns=3),
                     judge], engine=engine, tokenizer=tokenizer, sampling={"max_tokens": 256})


def rows(num: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": f"Problem {i}: what is 17 * 23 + {i}?"}],
             "tools": TOOLS, "data_source": "arith"} for i in range(num)]


def time_writes(result: Any, path: Path, **options: Any) -> tuple[float, int]:
    writer = TrajectoryWriter(path, **options)
    writer.begin_batch(step=0)
    started = time.perf_counter()
    for item, sample in zip(result.items, result.samples, strict=True):
        writer.write(item, sample)
    elapsed = time.perf_counter() - started
    writer.end_batch(result)
    writer.close()
    assert writer.errors == 0
    return elapsed, path.stat().st_size


async def in_batch_cost(tokenizer: ByteTokenizer, folder: Path, num: int,
                        repeats: int) -> dict[str, float]:
    plain, dumped = [], []
    for r in range(repeats):
        pipe = make_pipeline(tokenizer)
        started = time.perf_counter()
        await pipe.run_batch(rows(num), n=1)
        plain.append(time.perf_counter() - started)
        writer = TrajectoryWriter(folder / f"inbatch_{r}.jsonl", tokenizer=tokenizer)
        writer.begin_batch(step=r)
        pipe = make_pipeline(tokenizer)
        started = time.perf_counter()
        await pipe.run_batch(rows(num), n=1, on_sample_done=writer.write)
        dumped.append(time.perf_counter() - started)
        writer.close()
    base, with_writer = statistics.median(plain), statistics.median(dumped)
    return {"batch_wall_s_median": round(base, 4),
            "batch_wall_s_with_writer_median": round(with_writer, 4),
            "writer_cost_us_per_sample": round(1e6 * (with_writer - base) / num, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = parser.parse_args()
    num = 300 if args.quick else 2000
    tokenizer = ByteTokenizer()
    result = asyncio.run(make_pipeline(tokenizer).run_batch(rows(num), n=1))
    mean_response = statistics.mean(len(s.response_ids) for s in result.samples)
    mean_prompt = statistics.mean(len(s.prompt_ids) for s in result.samples)
    figures: dict[str, Any] = {
        "samples": num, "mean_prompt_tokens": round(mean_prompt, 1),
        "mean_response_tokens": round(mean_response, 1),
        "mean_turns": round(statistics.mean(it.artifacts[artifacts.TURNS]
                                            for it in result.items), 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label, options in (("text", {"tokenizer": tokenizer}),
                               ("token_ids", {"tokenizer": tokenizer, "include_token_ids": True}),
                               ("no_tokenizer", {})):
            runs = []
            for _ in range(REPEATS):
                path = folder / f"{label}.jsonl"
                path.unlink(missing_ok=True)
                runs.append(time_writes(result, path, **options))
            elapsed, size = statistics.median(e for e, _ in runs), runs[-1][1]
            figures[f"write_{label}"] = {"samples_per_s": round(num / elapsed),
                                         "us_per_sample": round(1e6 * elapsed / num, 1),
                                         "bytes_per_sample": round(size / num)}
        subset = result.model_copy(update={"items": result.items[:200],
                                           "samples": result.samples[:200]})
        elapsed, _ = time_writes(subset, folder / "fsync.jsonl", tokenizer=tokenizer, fsync=True)
        figures["write_text_fsync_every_line"] = {"samples_per_s": round(200 / elapsed),
                                                  "us_per_sample": round(1e6 * elapsed / 200, 1)}
        started = time.perf_counter()
        metrics = batch_metrics(result)
        figures["batch_metrics"] = {"ms": round(1e3 * (time.perf_counter() - started), 2),
                                    "keys": len(metrics)}
        del result, subset
        gc.collect()
        for label in ("text", "token_ids"):
            path = folder / f"{label}.jsonl"
            times = []
            for _ in range(REPEATS):
                dump = None
                gc.collect()
                started = time.perf_counter()
                dump = read_trajectories(path)
                times.append(time.perf_counter() - started)
            elapsed = statistics.median(times)
            assert len(dump.samples) == num and dump.torn_tail is None
            figures[f"read_{label}"] = {
                "samples_per_s": round(num / elapsed),
                "mb_per_s": round(path.stat().st_size / elapsed / 1e6, 1)}
        dump = read_trajectories(folder / "text.jsonl")
        started = time.perf_counter()
        trace = build_trace(dump)
        with (folder / "trace.json").open("w") as fh:
            json.dump(trace, fh, separators=(",", ":"))
        elapsed = time.perf_counter() - started
        figures["trace"] = {"events": len(trace["traceEvents"]),
                            "samples_per_s": round(num / elapsed),
                            "bytes_per_sample": round((folder / "trace.json").stat().st_size / num)}
        del dump, trace
        gc.collect()
        figures["in_batch"] = asyncio.run(in_batch_cost(
            tokenizer, folder, min(num, 1000), repeats=3 if args.quick else 5))
    path = write_result("trajectory", figures)
    print(json.dumps(figures, indent=2))
    print(f"written to benchmarks/results/{path.name}")


if __name__ == "__main__":
    main()
