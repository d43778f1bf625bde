"""python -m scenarios.order_desk  [--count N] [--n K] [--pool P]

A support desk: a (simulated) customer asks the agent about an order. In one trajectory the
agent looks the order up with an MCP tool (``scenarios/order_server.py``, the official SDK's
server started as a stdio subprocess, once for the run), writes a note into a notepad that
exists per trajectory (an SQLite database per sample; creating one is made to take 200 ms, as
provisioning a sandbox would, so they come from a warm pool), and answers; the customer is a
:class:`~pipeline.stages.SimulatedUser` with a scripted policy that asks, asks for a note, then
ends the conversation with ``###STOP###``.

The agent is the simulated engine with a scripted responder (:func:`responder`): no model, so
this shows the machinery (MCP, per-trajectory resource, warm pool, simulated user, tokens),
not skill. The stage list::

    BuildPrompt -> Loop([Generate, CallTools, SimulatedUser]) -> desk_reward

It prints the batch statistics, the warm pool's, and one line per sample.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sqlite3
import sys
from typing import Any

from pipeline import AgentRolloutItem, BuildPrompt, Context, Generate, Pipeline, Tokenizer
from pipeline import artifacts as A
from pipeline.engines import Responder, SimulatedEngine
from pipeline.stages import USER_TURNS, CallTools, SimulatedUser
from pipeline.tools import MCPServer, ResourceTool, ToolResult, WarmPool, tool_schema

SYSTEM_PROMPT = ("You are a support agent. Look orders up with order_status, write what you "
                 "told the customer with write_note when asked, and answer briefly.")
PROVISION_S = 0.2
"""How long creating a notepad takes (simulated provisioning)."""

NOTE_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}},
               "required": ["text"]}
_ORDER = re.compile(r"A-\d{3}")


async def provision_notepad() -> sqlite3.Connection:
    """A fresh notepad: an in-memory SQLite database, after the simulated provisioning time."""
    await asyncio.sleep(PROVISION_S)
    db = sqlite3.connect(":memory:")
    db.execute("create table notes (text text)")
    return db


async def close_notepad(db: sqlite3.Connection) -> None:
    db.close()


async def notepad_healthy(db: sqlite3.Connection) -> bool:
    return db.execute("select 1").fetchone() == (1,)


async def write_note(db: sqlite3.Connection, text: str) -> ToolResult:
    """The notepad tool: store a note; a small reward for keeping the customer's file."""
    db.execute("insert into notes values (?)", (text,))
    count = db.execute("select count(*) from notes").fetchone()[0]
    return ToolResult(f"saved note {count}", reward=0.1)


def notepad_tool(pool: WarmPool) -> ResourceTool:
    return ResourceTool(name="write_note", description="Write a note on the customer's file.",
                        parameters=NOTE_SCHEMA, call=write_note, pool=pool, timeout_s=10)


def customer(view: list[dict[str, Any]], item: AgentRolloutItem) -> str:
    """The scripted customer: after the agent's answer, asks for a note; then says goodbye."""
    asked = sum(1 for m in view if m["role"] == "assistant")  # the customer's own turns
    return "Please note that on my file." if asked == 1 else "Thanks, bye! ###STOP###"


def responder(tokenizer: Tokenizer) -> Responder:
    """The scripted agent (for the simulated engine): reads the last message of the prompt and
    calls order_status for a question, write_note when asked to note, and answers after a
    tool result. Every reply ends with eos."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0

    def call(name: str, arguments: dict[str, str]) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def reply(prompt_ids: list[int], rng: random.Random) -> list[int]:
        text = tokenizer.decode(prompt_ids)
        last = text.split("<|im_start|>")[-2]  # the message before the generation prompt
        found = _ORDER.findall(text)
        order = found[-1] if found else "A-100"
        if "<tool_response>" in last or last.startswith("tool"):
            result = last.split("<tool_response>")[-1].split("</tool_response>")[0].strip()
            result = result.split("\n", 1)[-1].split("<|im_end|>")[0].strip()
            out = ("Noted on your file." if result.startswith("saved note")
                   else f"Order {order}: {result}.")
        elif "note" in last.lower():
            told = re.findall(r"Order A-\d{3}: ([^.]*)\.", text)
            note = f"told customer: {order} {told[-1] if told else '?'}"
            out = call("write_note", {"text": note})
        else:
            out = call("order_status", {"order_id": order})
        return [*tokenizer.encode(out, add_special_tokens=False), eos]

    return reply


async def desk_reward(item: AgentRolloutItem, ctx: Context) -> None:
    """1 when the agent told the order's real status and a note was written, else 0."""
    from scenarios.order_server import ORDERS

    messages = item.artifacts.get(A.MESSAGES, [])
    order = item.data.extra["order_id"]
    told = any(m.role == "assistant" and ORDERS[order] in (m.content or "") for m in messages)
    noted = any(m.role == "tool" and (m.content or "").startswith("saved note")
                for m in messages)
    item.artifacts[A.REWARD] = float(told and noted)


def rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` customers, each asking about one order."""
    from scenarios.order_server import ORDERS

    rng = random.Random(seed)
    out = []
    for _ in range(count):
        order = rng.choice(sorted(ORDERS))
        out.append({"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                 {"role": "user", "content": f"Hi, where is my order {order}?"}],
                    "extra": {"order_id": order}})
    return out


def stages(user: SimulatedUser, max_turns: int = 10) -> list[Any]:
    """The stage list (see the module doc)."""
    return [BuildPrompt(), user.loop([Generate(), CallTools()], max_turns=max_turns),
            desk_reward]


async def run(count: int = 8, n: int = 2, pool_size: int = 8, seed: int = 0) -> dict[str, Any]:
    """Run the desk; returns the batch result and the pool's and server's figures."""
    from transformers import AutoTokenizer

    from pipeline.models import tiny_policy_dir

    tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, tiny_policy_dir())
    engine = SimulatedEngine(latency_s=0.01, responder=responder(tokenizer), seed=seed)
    server = MCPServer("orders", command=sys.executable, args=["-m", "scenarios.order_server"],
                       rate=200.0, burst=16, call_timeout_s=10)
    async with server, WarmPool(provision_notepad, size=pool_size, destroy=close_notepad,
                                healthy=notepad_healthy) as pool:
        await asyncio.sleep(PROVISION_S * 1.5)  # let the pool fill before the batch
        tools = [*server.tools, notepad_tool(pool)]
        for row in (rows_ := rows(count, seed)):
            row["tools"] = [tool_schema(t) for t in tools]
        user = SimulatedUser(policy=customer)
        rollout = Pipeline(stages(user), engine=engine, tokenizer=tokenizer, tools=tools,
                           config={"seed": seed, "sample_timeout_s": 60,
                                   "sampling": {"max_tokens": 128}})
        result = await rollout.run_batch(rows_, n=n)
        return {"result": result, "pool": pool.stats().as_dict(), "restarts": server.restarts}


def main() -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m scenarios.order_desk")
    parser.add_argument("--count", type=int, default=8, help="customers (default 8)")
    parser.add_argument("--n", type=int, default=2, help="rollouts per customer (default 2)")
    parser.add_argument("--pool", type=int, default=8, help="warm notepads (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = asyncio.run(run(args.count, args.n, args.pool, args.seed))
    result = out["result"]
    stats = result.stats
    print(f"status {stats.by_status}  reward mean {stats.reward_mean}  "
          f"tool calls {stats.tool_calls} (errors {stats.tool_errors})")
    print(f"warm pool {out['pool']}  mcp restarts {out['restarts']}")
    for sample, item in zip(result.samples, result.items, strict=True):
        extra = item.artifacts.get(A.EXTRA_FIELDS, {})
        print(f"{sample.uid} {sample.status.value} reward={sample.reward} "
              f"turns={item.artifacts.get(A.TURNS)} "
              f"user_turns={len(item.artifacts.get(USER_TURNS, []))} "
              f"warm={extra.get('tool_resources_warm')} "
              f"tool_rewards={extra.get('tool_rewards')}")


if __name__ == "__main__":
    main()
