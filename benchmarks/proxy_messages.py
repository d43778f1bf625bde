"""What a turn costs through the Messages API, against the same turn through chat completions.

Run::

    python benchmarks/proxy_messages.py            # 40 conversations per API (about a minute)
    python benchmarks/proxy_messages.py --quick    # 6 per API, for a smoke run

The proxy runs in this process on the *simulated* engine with zero latency (named as such), so
every figure is the proxy's own cost, never a model's, with the tiny model's real BPE tokenizer
and its jinja chat template (:func:`pipeline.models.tiny.ensure_tiny_model`). The agent side is
an aiohttp client in the same process sending raw JSON bodies, the same for both APIs but their
shape: a 10-turn tool loop (system prompt, question, one tool; per turn the model's reply is a
hermes tool call and the agent sends a short tool result back with its whole history).
Conversations alternate between the APIs (chat, Messages, chat, ...), so load on the shared
machine falls on both alike.

Per request: the wall time from sending the body to reading the whole reply (non-streamed),
and the proxy's own time for the turn (``Turn.timings["total_s"]``: match, render, generate,
commit; without HTTP and JSON). Reported: p50 and p90 per API over all turns, and the ratio
Messages / chat of the p50s (the goal: within 10%, i.e. at most 1.10). Results go to
``benchmarks/results/proxy_messages.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from typing import Any

from _common import write_result

SYSTEM = ("You are a careful assistant. Use the calculator tool for every arithmetic step "
          "and reply with one line: Answer: <number>.")
QUESTION = "Ava has 12 boxes with 37 apples each and gives away 58 apples. How many are left?"
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}},
          "required": ["expression"]}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": SCHEMA}}]
MESSAGES_TOOLS = [{"name": "calculator", "description": "Evaluate an arithmetic expression.",
                   "input_schema": SCHEMA}]
REPLY = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 37 - 58"}}'
         "\n</tool_call>")
TURNS = 10


class ChatLoop:
    """One chat-completions agent: its messages, and the next body."""

    route = "chat/completions"

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": QUESTION}]

    def body(self) -> bytes:
        return json.dumps({"model": "m", "messages": self.messages, "tools": CHAT_TOOLS,
                           "max_tokens": 256}).encode()

    def step(self, reply: dict[str, Any], turn: int) -> None:
        message = reply["choices"][0]["message"]
        self.messages += [message, {"role": "tool", "content": str(386 + turn),
                                    "tool_call_id": message["tool_calls"][0]["id"]}]


class MessagesLoop:
    """One Messages API agent, as Claude Code shapes its requests (system blocks with
    ``cache_control``, content blocks)."""

    route = "messages"

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": [
            {"type": "text", "text": QUESTION}]}]

    def body(self) -> bytes:
        return json.dumps({"model": "m", "max_tokens": 256, "tools": MESSAGES_TOOLS,
                           "system": [{"type": "text", "text": SYSTEM,
                                       "cache_control": {"type": "ephemeral"}}],
                           "messages": self.messages}).encode()

    def step(self, reply: dict[str, Any], turn: int) -> None:
        call = next(b for b in reply["content"] if b["type"] == "tool_use")
        self.messages += [{"role": "assistant", "content": reply["content"]},
                          {"role": "user", "content": [{"type": "tool_result",
                                                        "tool_use_id": call["id"],
                                                        "content": str(386 + turn)}]}]


async def converse(http: Any, proxy: Any, loop: ChatLoop | MessagesLoop,
                   wall: list[float], own: list[float]) -> None:
    session = proxy.create_session()
    url = f"{proxy.session_url(session)}/{loop.route}"
    headers = {"Authorization": f"Bearer {session.api_key}",
               "Content-Type": "application/json"}
    for turn in range(TURNS):
        body = loop.body()
        start = time.perf_counter()
        async with http.post(url, data=body, headers=headers) as r:
            reply = await r.json()
        wall.append(time.perf_counter() - start)
        assert r.status == 200, reply
        loop.step(reply, turn)
    record = proxy.record(session.id)
    assert len(record.segments) == 1, "every turn merges"
    own += [t.timings["total_s"] for t in record.turns]
    await proxy.delete_session(session.id)


def percentiles(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=10)
    return {"p50_ms": round(statistics.median(values) * 1e3, 3), "p90_ms": round(q[8] * 1e3, 3),
            "n": len(values)}


async def run(conversations: int) -> dict[str, Any]:
    import aiohttp
    from transformers import AutoTokenizer

    from pipeline import SimulatedEngine
    from pipeline.models.tiny import ensure_tiny_model
    from pipeline.proxy import ProxyServer

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    reply = [*tokenizer.encode(REPLY, add_special_tokens=False), tokenizer.eos_token_id]
    engine = SimulatedEngine(latency_s=0.0, latency_sigma=0.0, tail_prob=0.0,
                             responder=lambda prompt, rng: list(reply),
                             eos_token_id=tokenizer.eos_token_id)
    wall: dict[str, list[float]] = {"chat": [], "messages": []}
    own: dict[str, list[float]] = {"chat": [], "messages": []}
    async with ProxyServer(engine, tokenizer, max_sessions=10_000) as proxy, \
            aiohttp.ClientSession() as http:
        for _ in range(2):  # warm-up: template compiled, connections open
            await converse(http, proxy, ChatLoop(), [], [])
            await converse(http, proxy, MessagesLoop(), [], [])
        for _ in range(conversations):
            await converse(http, proxy, ChatLoop(), wall["chat"], own["chat"])
            await converse(http, proxy, MessagesLoop(), wall["messages"], own["messages"])
    figures: dict[str, Any] = {
        "engine": "simulated, zero latency", "tokenizer": "tiny model's byte-level BPE",
        "turns_per_conversation": TURNS, "conversations_per_api": conversations,
        "request_wall": {api: percentiles(v) for api, v in wall.items()},
        "proxy_turn_time": {api: percentiles(v) for api, v in own.items()}}
    figures["messages_over_chat_p50"] = {
        "request_wall": round(statistics.median(wall["messages"])
                              / statistics.median(wall["chat"]), 3),
        "proxy_turn_time": round(statistics.median(own["messages"])
                                 / statistics.median(own["chat"]), 3)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    figures = asyncio.run(run(6 if args.quick else 40))
    print(json.dumps(figures, indent=2))
    if not args.quick:
        print("wrote", write_result("proxy_messages", figures))


if __name__ == "__main__":
    main()
