"""What trajectory dumps cost: write and read throughput, bytes per sample, trace conversion.

Run::

    python benchmarks/trajectory.py            # 2,000 samples (about half a minute)
    python benchmarks/trajectory.py --quick    # 300 samples, for a smoke run

The samples are real: a batch through ``Pipeline`` on the simulated engine (zero latency)
with the byte tokenizer, a system prompt with a tool schema, up to 3 agent turns of up to
256 tokens with a tool reply after the first, and a judge. The batch is produced once; each
figure then times only the part named, as the median of 3 runs:

- ``TrajectoryWriter.write`` for every sample: with decoded text, with token ids, without a
  tokenizer, and with ``fsync`` after every line (200 samples);
- ``batch_metrics`` of the batch;
- with the batch dropped from memory (as in a fresh ``rollout inspect`` process):
  ``read_trajectories``, and ``write_trace`` (read, convert, write the trace file);
- the writer inside a batch: the same batch with and without ``on_sample_done`` set to the
  writer, alternating.

Each figure is given in CPU time of this process (steadier when other work shares the
machine) and in wall time; the load average at start and end is recorded beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
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
    read_trajectories,
    write_trace,
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


class Timer:
    """Wall and CPU (process) time of a block; CPU time is steadier on a shared machine."""

    def __enter__(self) -> Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        self.cpu = time.process_time() - self.cpu


def rates(timers: list[Timer], num: int, size: int | None = None) -> dict[str, float]:
    """Per-sample figures from the medians of several timed runs."""
    wall = statistics.median(t.wall for t in timers)
    cpu = statistics.median(t.cpu for t in timers)
    out = {"samples_per_s_cpu": round(num / cpu), "cpu_us_per_sample": round(1e6 * cpu / num, 1),
           "samples_per_s_wall": round(num / wall),
           "wall_us_per_sample": round(1e6 * wall / num, 1)}
    if size is not None:
        out["mb_per_s_cpu"] = round(size / cpu / 1e6, 1)
    return out


def time_writes(result: Any, path: Path, **options: Any) -> tuple[Timer, int]:
    path.unlink(missing_ok=True)
    writer = TrajectoryWriter(path, **options)
    writer.begin_batch(step=0)
    with Timer() as timer:
        for item, sample in zip(result.items, result.samples, strict=True):
            writer.write(item, sample)
    writer.end_batch(result)
    writer.close()
    assert writer.errors == 0
    return timer, path.stat().st_size


async def in_batch_cost(tokenizer: ByteTokenizer, folder: Path, num: int,
                        repeats: int) -> dict[str, float]:
    plain: list[Timer] = []
    dumped: list[Timer] = []
    for r in range(repeats):
        pipe = make_pipeline(tokenizer)
        with Timer() as timer:
            await pipe.run_batch(rows(num), n=1)
        plain.append(timer)
        writer = TrajectoryWriter(folder / f"inbatch_{r}.jsonl", tokenizer=tokenizer)
        writer.begin_batch(step=r)
        pipe = make_pipeline(tokenizer)
        with Timer() as timer:
            await pipe.run_batch(rows(num), n=1, on_sample_done=writer.write)
        dumped.append(timer)
        writer.close()
    base = statistics.median(t.cpu for t in plain)
    with_writer = statistics.median(t.cpu for t in dumped)
    return {"batch_cpu_s_median": round(base, 4),
            "batch_cpu_s_with_writer_median": round(with_writer, 4),
            "writer_cpu_us_per_sample": round(1e6 * (with_writer - base) / num, 1),
            "batch_wall_s_median": round(statistics.median(t.wall for t in plain), 4),
            "batch_wall_s_with_writer_median": round(statistics.median(t.wall for t in dumped),
                                                     4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = parser.parse_args()
    num = 300 if args.quick else 2000
    tokenizer = ByteTokenizer()
    result = asyncio.run(make_pipeline(tokenizer).run_batch(rows(num), n=1))
    figures: dict[str, Any] = {
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),
        "samples": num,
        "mean_prompt_tokens": round(statistics.mean(len(s.prompt_ids) for s in result.samples), 1),
        "mean_response_tokens": round(statistics.mean(len(s.response_ids)
                                                      for s in result.samples), 1),
        "mean_turns": round(statistics.mean(it.artifacts[artifacts.TURNS]
                                            for it in result.items), 2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label, options in (("text", {"tokenizer": tokenizer}),
                               ("token_ids", {"tokenizer": tokenizer, "include_token_ids": True}),
                               ("no_tokenizer", {})):
            runs = [time_writes(result, folder / f"{label}.jsonl", **options)
                    for _ in range(REPEATS)]
            figures[f"write_{label}"] = {**rates([t for t, _ in runs], num),
                                         "bytes_per_sample": round(runs[-1][1] / num)}
        subset = result.model_copy(update={"items": result.items[:200],
                                           "samples": result.samples[:200]})
        timer, _ = time_writes(subset, folder / "fsync.jsonl", tokenizer=tokenizer, fsync=True)
        figures["write_text_fsync_every_line"] = rates([timer], 200)
        with Timer() as timer:
            metrics = batch_metrics(result)
        figures["batch_metrics"] = {"cpu_ms": round(1e3 * timer.cpu, 2), "keys": len(metrics)}
        del result, subset
        gc.collect()
        for label in ("text", "token_ids"):
            path = folder / f"{label}.jsonl"
            timers = []
            for _ in range(REPEATS):
                dump = None
                gc.collect()
                with Timer() as timer:
                    dump = read_trajectories(path)
                timers.append(timer)
            assert dump is not None and len(dump.samples) == num and dump.torn_tail is None
            figures[f"read_{label}"] = rates(timers, num, path.stat().st_size)
        timers = []
        for _ in range(REPEATS):
            with Timer() as timer:
                trace = write_trace(folder / "text.jsonl", folder / "trace.json")
            timers.append(timer)
        figures["trace_read_convert_write"] = {
            **rates(timers, num), "events": len(trace["traceEvents"]),
            "bytes_per_sample": round((folder / "trace.json").stat().st_size / num)}
        del dump, trace
        gc.collect()
        figures["in_batch"] = asyncio.run(in_batch_cost(
            tokenizer, folder, min(num, 1000), repeats=3 if args.quick else 5))
    figures["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    path = write_result("trajectory", figures)
    print(json.dumps(figures, indent=2))
    print(f"written to benchmarks/results/{path.name}")


if __name__ == "__main__":
    main()
