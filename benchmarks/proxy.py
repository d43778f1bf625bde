"""What the LLM proxy adds per request, by history length, and how many requests/s it serves.

Run::

    python benchmarks/proxy.py            # full figures (about a minute)
    python benchmarks/proxy.py --quick    # fewer requests, for a smoke run

The proxy runs in its own process (started by this script with ``--serve``) on the
*simulated* engine with zero latency, so every figure is the proxy's own cost, never a
model's. This process is the agent: it speaks HTTP to the proxy like an OpenAI client does.
Each conversation is a tool loop: a system prompt, a question and one tool schema, then per
turn the model's reply is a hermes tool call (about 30 tokens) and the agent sends a short tool
result back with the whole history, as agents do.

Part 1, added latency. For each history length H (1, 10, 50 turns) sessions are first filled
with H turns, then one more request is timed per session, one at a time (no queueing): the
wall time from sending the request to reading the whole reply over a keep-alive connection.
The baseline is the same engine called directly (``await engine.generate(prompt, ...)`` with
a prompt of the same length, in this process). Added latency = proxy percentile minus
baseline percentile. The server's CPU time per timed request (from ``/proc``) is reported
beside it, since other work on a shared 2-core machine inflates wall times.

Part 2, throughput: 32 concurrent agents run 10-turn conversations (a new session each) for
a fixed time; requests/s over the run, and server CPU per request.

Both parts run with two tokenizers: the byte-level test tokenizer (near-free template), and
the tiny model's real BPE tokenizer with its jinja chat template, when ``transformers`` is
installed (built locally by :func:`pipeline.models.tiny.ensure_tiny_model`).
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import write_result

SYSTEM = ("You are a careful assistant. Use the calculator tool for every arithmetic step "
          "and reply with one line: Answer: <number>.")
QUESTION = "Ava has 12 boxes with 37 apples each and gives away 58 apples. How many are left?"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
REPLY = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 37 - 58"}}'
         "\n</tool_call>")


# ----- the server process ------------------------------------------------------------------


def serve(tokenizer_name: str) -> None:
    from pipeline import SimulatedEngine, asyncio_run
    from pipeline.proxy import ProxyServer

    tokenizer = load_tokenizer(tokenizer_name)
    reply = [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.eos_token_id]
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                             responder=lambda prompt, rng: list(reply),
                             eos_token_id=tokenizer.eos_token_id)

    async def main() -> None:
        async with ProxyServer(engine, tokenizer, max_sessions=100_000) as proxy:
            print(json.dumps({"url": proxy.url}), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

    asyncio_run(main(), watchdog=False, dump_signal=None)


def serve_floor() -> None:
    """A bare aiohttp server: reads the body, answers a fixed chat-completion-sized JSON."""
    from aiohttp import web

    from pipeline import asyncio_run
    from pipeline._net import start_site

    reply = json.dumps({"id": "x", "object": "chat.completion", "choices": [{
        "index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_0_0", "type": "function", "function": {
                "name": "calculator", "arguments": '{"expression": "12 * 37 - 58"}'}}]},
        "finish_reason": "tool_calls"}], "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 1}}}).encode()

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    async def main() -> None:
        app = web.Application(client_max_size=2**24)
        app.router.add_post("/{tail:.*}", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        _, port = await start_site(runner)
        print(json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await runner.cleanup()

    asyncio_run(main(), watchdog=False, dump_signal=None)


def load_tokenizer(name: str) -> Any:
    if name == "byte":
        from pipeline.testing import ByteTokenizer

        return ByteTokenizer()
    from transformers import AutoTokenizer

    from pipeline.models.tiny import ensure_tiny_model

    return AutoTokenizer.from_pretrained(ensure_tiny_model())


class Server:
    """The proxy process: started with ``--serve``, stopped by closing its stdin."""

    def __init__(self, tokenizer_name: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", tokenizer_name], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.url = json.loads(line)["url"]
        self.port = int(self.url.rsplit(":", 1)[1])

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


# ----- the agent side -----------------------------------------------------------------------


def tool_result(turn: int) -> str:
    return f"{12 * 37 - 58 + turn}"


class Conversation:
    """One agent's messages; ``step`` adds the reply and a tool result."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": QUESTION}]
        self.turns = 0

    def body(self) -> bytes:
        return json.dumps({"model": "m", "messages": self.messages, "tools": TOOLS,
                           "max_tokens": 256}).encode()

    def step(self, reply: dict[str, Any]) -> None:
        message = reply["choices"][0]["message"]
        self.messages.append(message)
        call_id = message["tool_calls"][0]["id"]
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": tool_result(self.turns)})
        self.turns += 1


async def new_session(http: Any, url: str) -> tuple[str, dict[str, str]]:
    async with http.post(f"{url}/sessions") as r:
        created = await r.json()
    return (f"{created['base_url']}/chat/completions",
            {"Authorization": f"Bearer {created['api_key']}",
             "Content-Type": "application/json"})


async def prefill(url: str, sessions: int, history: int) -> list[tuple[str, dict[str, str],
                                                                        Conversation]]:
    """``sessions`` sessions, each with ``history`` turns recorded (32 agents at a time)."""
    import aiohttp

    out: list[tuple[str, dict[str, str], Conversation]] = []
    gate = asyncio.Semaphore(32)
    async with aiohttp.ClientSession() as http:
        async def one() -> None:
            async with gate:
                chat_url, headers = await new_session(http, url)
                conversation = Conversation()
                for _ in range(history):
                    async with http.post(chat_url, data=conversation.body(),
                                         headers=headers) as r:
                        conversation.step(await r.json())
                out.append((chat_url, headers, conversation))

        await asyncio.gather(*(one() for _ in range(sessions)))
    return out


def timed_requests(server: Server, prepared: list[tuple[str, dict[str, str], Conversation]]
                   ) -> tuple[list[float], list[dict[str, Any]], float]:
    """One request per session, one at a time: wall seconds, the replies, server CPU seconds."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    latencies, replies = [], []
    cpu_before = server.cpu_s()
    for chat_url, headers, conversation in prepared:
        path = "/" + chat_url.split("/", 3)[3]
        body = conversation.body()
        start = time.perf_counter()
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
        latencies.append(time.perf_counter() - start)
        assert response.status == 200, data[:200]
        replies.append(json.loads(data))
    cpu = server.cpu_s() - cpu_before
    conn.close()
    return latencies, replies, cpu


def server_timings(prepared: list[tuple[str, dict[str, str], Conversation]],
                   sample: int) -> dict[str, float]:
    """Medians of the proxy's own timings of the timed turn (from the session records)."""
    import urllib.request

    found: dict[str, list[float]] = {}
    for chat_url, headers, _ in prepared[:sample]:
        request = urllib.request.Request(chat_url.rsplit("/v1/", 1)[0], headers=headers)
        with urllib.request.urlopen(request) as response:
            timings = json.loads(response.read())["turns"][-1]["timings"]
        for key in ("queued_s", "render_s", "engine_s", "total_s"):
            found.setdefault(key, []).append(timings[key])
    return {key.replace("_s", "_ms"): round(statistics.median(v) * 1e3, 3)
            for key, v in found.items()}


async def direct_engine(prompt_lens: list[int], reply_len: int, repeats: int) -> list[float]:
    """The baseline: the same simulated engine, awaited directly, with prompts of those lengths
    and replies of the same length (its cost grows with the reply: one logprob per token)."""
    from pipeline import SamplingParams, SimulatedEngine

    reply = [*range(3, 3 + reply_len - 1), 2]
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                             responder=lambda prompt, rng: list(reply), eos_token_id=2)
    sampling = SamplingParams(max_tokens=64)
    out = []
    for i in range(repeats):
        prompt = [5] * prompt_lens[i % len(prompt_lens)]
        start = time.perf_counter()
        await engine.generate(prompt, sampling, f"r{i}")
        out.append(time.perf_counter() - start)
    return out


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50_ms": round(cuts[49] * 1e3, 3), "p99_ms": round(cuts[98] * 1e3, 3),
            "mean_ms": round(statistics.fmean(ordered) * 1e3, 3)}


def latency_part(server: Server, floor: Server, histories: list[int],
                 per_history: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for history in histories:
        prepared = asyncio.run(prefill(server.url, per_history, history))
        latencies, replies, cpu = timed_requests(server, prepared)
        assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in replies)
        prompt_lens = [r["usage"]["prompt_tokens"] for r in replies]
        reply_len = replies[0]["usage"]["completion_tokens"]
        direct = asyncio.run(direct_engine(prompt_lens, reply_len, len(latencies)))
        http_floor, _, _ = timed_requests(floor, prepared)
        proxy_p, direct_p, floor_p = (percentiles(latencies), percentiles(direct),
                                      percentiles(http_floor))
        entry = figures[f"history_{history}"] = {
            "history_turns": history, "requests": len(latencies),
            "request_body_bytes": len(prepared[0][2].body()),
            "prompt_tokens_mean": round(statistics.fmean(prompt_lens)),
            "proxy": proxy_p, "direct_engine": direct_p,
            "added_p50_ms": round(proxy_p["p50_ms"] - direct_p["p50_ms"], 3),
            "added_p99_ms": round(proxy_p["p99_ms"] - direct_p["p99_ms"], 3),
            "bare_http_same_bodies": floor_p,
            "server_cpu_ms_per_request": round(cpu / len(latencies) * 1e3, 3),
            "proxy_timings_median": server_timings(prepared, 40),
        }
        print(f"  history {history:>2} turns ({entry['prompt_tokens_mean']} prompt tokens, "
              f"{entry['request_body_bytes']} B body): added p50 {entry['added_p50_ms']} ms, "
              f"p99 {entry['added_p99_ms']} ms; bare HTTP p50 {floor_p['p50_ms']} ms; "
              f"server CPU {entry['server_cpu_ms_per_request']} ms/request; in-proxy "
              f"{entry['proxy_timings_median']}", flush=True)
    return figures


async def throughput(url: str, agents: int, turns: int, seconds: float) -> tuple[int, float]:
    import aiohttp

    done = 0
    stop_at = time.perf_counter() + seconds
    connector = aiohttp.TCPConnector(limit=agents)
    async with aiohttp.ClientSession(connector=connector) as http:
        async def agent() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                chat_url, headers = await new_session(http, url)
                conversation = Conversation()
                for _ in range(turns):
                    async with http.post(chat_url, data=conversation.body(),
                                         headers=headers) as r:
                        conversation.step(await r.json())
                    done += 1
                async with http.delete(chat_url.rsplit("/v1/", 1)[0], headers=headers):
                    pass

        start = time.perf_counter()
        await asyncio.gather(*(agent() for _ in range(agents)))
        return done, time.perf_counter() - start


def throughput_part(server: Server, seconds: float) -> dict[str, Any]:
    cpu_before = server.cpu_s()
    done, wall = asyncio.run(throughput(server.url, 32, 10, seconds))
    cpu = server.cpu_s() - cpu_before
    result = {"agents": 32, "turns_per_conversation": 10, "requests": done,
              "wall_s": round(wall, 2), "requests_per_s": round(done / wall, 1),
              "server_cpu_ms_per_request": round(cpu / done * 1e3, 3)}
    print(f"  throughput: {result['requests_per_s']} requests/s "
          f"({result['server_cpu_ms_per_request']} ms server CPU each)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:  # a server process: stdout carries only its URL line
        import structlog

        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.serve == "floor":
        serve_floor()
        return
    if args.serve:
        serve(args.serve)
        return
    per_history = 60 if args.quick else 400
    seconds = 3.0 if args.quick else 10.0
    tokenizers = ["byte"]
    try:
        import transformers  # noqa: F401

        tokenizers.append("tiny")
    except ImportError:
        print("transformers is not installed: only the byte-level tokenizer is measured")
    figures: dict[str, Any] = {
        "engine": "simulated (zero latency, no model)",
        "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    floor = Server("floor")
    try:
        for name in tokenizers:
            print(f"tokenizer {name}:", flush=True)
            server = Server(name)
            try:
                figures[f"tokenizer_{name}"] = {
                    "latency": latency_part(server, floor, [1, 10, 50], per_history),
                    "throughput": throughput_part(server, seconds)}
            finally:
                server.close()
    finally:
        floor.close()
    figures["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"wrote {write_result('proxy', figures)}")


if __name__ == "__main__":
    main()
