"""Claude Code with its default system prompt and tools, through the proxy's Messages API, on a
tiny model built with a long context (issue 40, item 3).

Run::

    python benchmarks/proxy_claude_code.py        # two turns, about a minute on 2 cores

The tests run Claude Code (through ``claude-agent-sdk``) with the task's system prompt and one
tool, to fit the tiny model's 4,096-token context; this script runs it as shipped: its own
system prompt and built-in tool list (tens of thousands of tokens), on the tiny model rebuilt
with ``max_position_embeddings=65536`` (random weights, the same tokenizer) in the
TransformersEngine. The model's replies are forced (a random-weight model writes no tool call
by itself): a hermes call of Claude Code's ``Bash`` tool (``echo 42``), then ``Answer: 42``;
Claude Code runs the command itself. Its other traffic is off, and an HTTP(S) proxy on a dead
loopback port catches anything that would still go out.

Reported: the prompt tokens per turn, the proxy's time per turn (``Turn.timings``: match,
render, engine), the fields it sent that had no effect, whether both turns merged into one
segment, and whether that segment is token-exact against the engine's own log. Results go to
``benchmarks/results/proxy_claude_code.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import write_result

CALL = ('<tool_call>\n{"name": "Bash", "arguments": {"command": "echo 42", "description": '
        '"Print 42"}}\n</tool_call>')
QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
         "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
         "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
         "NO_PROXY": "127.0.0.1,localhost"}


class Forced:
    """Only ``text``'s tokens, then the stop token (a logits processor of one request)."""

    def __init__(self, ids: list[int], stop: int) -> None:
        self.ids, self.stop = ids, stop

    def __call__(self, generated: Any, logits: Any) -> Any:
        import torch

        keep = torch.zeros_like(logits, dtype=torch.bool)
        done = len(generated)
        keep[self.ids[done] if done < len(self.ids) else self.stop] = True
        return logits.masked_fill(~keep, float("-inf"))


async def run(home: Path) -> dict[str, Any]:
    import claude_agent_sdk
    import torch
    from claude_agent_sdk import ClaudeAgentOptions, ResultMessage, query
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.engines.transformers import TransformersEngine
    from pipeline.models.tiny import TinyModelSpec, ensure_tiny_model
    from pipeline.proxy import ProxyServer

    directory = ensure_tiny_model(home / "tiny-long", TinyModelSpec(max_position_embeddings=65536))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    log: dict[str, tuple[list[int], Any]] = {}

    def forced(request_id: str, prompt_ids: list[int]) -> Forced:
        answered = "<tool_response>" in tokenizer.decode(prompt_ids[-200:])
        text = "Answer: 42" if answered else CALL
        return Forced(tokenizer.encode(text), tokenizer.eos_token_id)

    class Logged(TransformersEngine):
        async def generate(self, prompt_ids: Any, sampling: Any, request_id: str,
                           **kwargs: Any) -> Any:
            gen = await super().generate(prompt_ids, sampling, request_id, **kwargs)
            log[request_id] = (list(prompt_ids), gen)
            return gen

    engine = Logged(model, tokenizer, max_model_len=65536, processor_factory=forced)
    cli = Path(claude_agent_sdk.__file__).parent / "_bundled" / "claude"
    async with ProxyServer(engine, tokenizer, model_name="tiny",
                           sampling={"max_tokens": 64}) as proxy:
        session = proxy.create_session()
        options = ClaudeAgentOptions(
            model="tiny", allowed_tools=["Bash"], max_turns=4, setting_sources=[],
            cwd=str(home), cli_path=str(cli),
            env={**QUIET, "HOME": str(home), "ANTHROPIC_API_KEY": session.api_key,
                 "ANTHROPIC_BASE_URL": proxy.session_url(session).removesuffix("/v1")})
        start, result = time.perf_counter(), None
        async for message in query(prompt="What is 40 plus 2? Use Bash.", options=options):
            if isinstance(message, ResultMessage):
                result = message
        wall = time.perf_counter() - start
        record = proxy.record(session.id)
    exact = all(token_exact(seg, log) for seg in record.segments)
    return {"model": "tiny Qwen2 (random weights), max_position_embeddings 65536",
            "engine": "TransformersEngine (CPU, float32), replies forced",
            "claude_code": result.model_dump() if hasattr(result, "model_dump") else {
                "result": getattr(result, "result", None),
                "is_error": getattr(result, "is_error", None),
                "num_turns": getattr(result, "num_turns", None)},
            "turns": [{"prompt_tokens": t.prompt_len, "reused_tokens": t.reused_tokens,
                       "finish_reason": t.finish_reason, "ignored_fields": t.ignored_fields,
                       "proxy_s": {k: round(v, 3) for k, v in t.timings.items()
                                   if k.endswith("_s")}} for t in record.turns],
            "tool_results": [m.get("content") for m in record.segments[-1].messages
                             if m.get("role") == "tool"],
            "segments": len(record.segments), "token_exact": exact,
            "wall_s": round(wall, 1)}


def token_exact(segment: Any, log: dict[str, tuple[list[int], Any]]) -> bool:
    """Each model run of the segment (mask 1) is one engine reply, token for token, and each
    request's prompt is the segment's sequence up to its reply."""
    mask, starts = segment.response_mask, []
    for i, m in enumerate(mask):
        if m == 1 and (i == 0 or mask[i - 1] == 0):
            starts.append(i)
    requests = [log[rid] for rid in sorted(log, key=lambda r: int(r.rsplit("-", 1)[1]))]
    if len(starts) != len(requests):
        return False
    for start, (prompt, gen) in zip(starts, requests, strict=True):
        if (segment.response_ids[start:start + len(gen.token_ids)] != gen.token_ids
                or prompt != segment.prompt_ids + segment.response_ids[:start]):
            return False
    return True


def main() -> None:
    logging.getLogger("pipeline").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as home:
        figures = asyncio.run(run(Path(home)))
    figures["claude_code"] = {k: figures["claude_code"].get(k) for k in
                              ("result", "is_error", "num_turns", "stop_reason")}
    print(json.dumps(figures, indent=2))
    print("wrote", write_result("proxy_claude_code", figures))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
