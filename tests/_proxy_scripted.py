"""Scripted fakes shared by the proxy's API tests on the byte-level tokenizer (Messages,
Responses): the simulated engine's scripted replies, an engine that counts requests and keeps
the constraints it got, a proxy served from a thread for the synchronous hypothesis tests, and
the JSON values the fuzz tests draw.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

from hypothesis import strategies as st

from pipeline.proxy import Constraints, ProxyServer
from pipeline.testing import ByteTokenizer, SimulatedEngine

TOK = ByteTokenizer()
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def responder(prompt_ids: list[int], rng: Any) -> list[int]:
    """A tool call when the last user message asks for one and no result came yet; else
    ``ack <that message>`` (the simulated engine's scripted replies)."""
    text = TOK.decode(prompt_ids)
    users = re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", text, re.DOTALL)
    last = users[-1] if users else ""
    tail = text[text.rfind("<|im_start|>user"):]
    reply = CALL if "call" in last and "<|im_start|>tool" not in tail else f"ack {last}"
    return [*TOK.encode(reply), TOK.eos_token_id]


class CountingEngine(SimulatedEngine):
    """The simulated engine, counting requests and keeping the constraints it was given."""

    def __init__(self, enforces: tuple[str, ...] = ()) -> None:
        super().__init__(latency_s=0.001, latency_sigma=0.0, tail_prob=0.0, responder=responder,
                         eos_token_id=TOK.eos_token_id)
        if enforces:
            self.enforces = enforces
        self.requests = 0
        self.constraints: list[Constraints | None] = []

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str,
                       constraints: Constraints | None = None) -> Any:
        self.requests += 1
        self.constraints.append(constraints)
        return await super().generate(prompt_ids, sampling, request_id)


class ThreadedProxy:
    """A ProxyServer on its own event loop in a thread (hypothesis tests are synchronous)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0
        self.session: Any = None

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        proxy = ProxyServer(CountingEngine(), TOK, max_body_bytes=65536)
        self.port = int(self.loop.run_until_complete(proxy.start()).rsplit(":", 1)[1])
        self.session = proxy.create_session()
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(proxy.aclose())
        self.loop.close()

    def __enter__(self) -> ThreadedProxy:
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


scalars = (st.none() | st.booleans() | st.integers(-2**40, 2**40)
           | st.floats(allow_nan=False) | st.text(max_size=12))


json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                           max_leaves=6)
