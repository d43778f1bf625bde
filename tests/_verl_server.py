"""The one stand-in of the verl tests: an inference server with verl's server signature.

``StandInServer`` is a Ray actor with ``generate(prompt_ids, sampling_params, request_id, ...)
-> TokenOutput`` (verl 0.9.1's ``vLLMHttpServer.generate``) over our ``TransformersEngine``
on the tiny model. Like verl's server it reports ``stop_reason="completed"`` for stop and
length alike and ``extra_fields["global_steps"]``. Scripted for the tests:

- a prompt without a tool response yet is forced to a calculator call (a multi-turn batch
  from a random model);
- a prompt containing ``SLOW`` is a long generation: one engine step every ``slow_step_s``,
  eos banned, so it runs until ``max_tokens`` unless the call is cancelled. The server logs
  each such call's start, steps and end (``cancelled`` or ``done``), which is how the tests
  see that a timed-out sample's server request really stops.

PYTEST_DONT_REWRITE (registered for pickling by value: Ray actors import nothing from tests).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


class _Forced:
    """Only ``choice`` then the stop token may be sampled."""

    def __init__(self, choice: list[int], stop: int) -> None:
        self.choice, self.stop = choice, stop

    def __call__(self, generated: Any, logits: Any) -> Any:
        import torch

        done = len(generated)
        allowed = self.choice[done] if done < len(self.choice) else self.stop
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[allowed] = True
        return logits.masked_fill(~keep, float("-inf"))


class _NoStop:
    def __init__(self, banned: set[int]) -> None:
        self.banned = sorted(banned)

    def __call__(self, generated: Any, logits: Any) -> Any:
        logits = logits.clone()
        logits[self.banned] = float("-inf")
        return logits


class StandInServer:
    """verl's rollout server, as far as ``LLMServerClient.generate`` sees it."""

    def __init__(self, model_dir: str, *, global_steps: int = 7, slow_step_s: float = 0.25,
                 max_model_len: int = 1024) -> None:
        import torch

        torch.set_num_threads(1)
        from pipeline.engines import TransformersEngine

        self.engine = TransformersEngine.from_pretrained(
            model_dir, max_model_len=max_model_len, processor_factory=self._processor)
        self.tokenizer = self.engine.tokenizer
        self.global_steps = global_steps
        self.slow_step_s = slow_step_s
        self.calls: dict[str, dict[str, Any]] = {}
        self.requests = 0

    def _processor(self, request_id: str, prompt: Any) -> Any:
        if request_id.startswith("slow-"):
            return _NoStop(set(self.engine.eos_token_ids))
        text = self.tokenizer.decode(prompt)
        if "<tool_response>" in text:
            return None
        return _Forced(self.tokenizer.encode(CALL), self.tokenizer.eos_token_id)

    async def generate(self, prompt_ids: list[int], sampling_params: dict[str, Any],
                       request_id: str, image_data: Any = None, video_data: Any = None,
                       **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        from pipeline import SamplingParams

        self.requests += 1
        params = dict(sampling_params)
        sampling = SamplingParams(
            temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0),
            top_k=params.get("top_k", -1), max_tokens=params.get("max_tokens", 64),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()))
        if "SLOW" in self.tokenizer.decode(prompt_ids):
            tokens, logprobs = await self._slow(list(prompt_ids), sampling, request_id)
        else:
            gen = await self.engine.generate(prompt_ids, sampling, request_id)
            tokens, logprobs = gen.token_ids, gen.logprobs
        return TokenOutput(token_ids=tokens, log_probs=logprobs if params.get("logprobs")
                           else None, stop_reason="completed",
                           extra_fields={"global_steps": self.global_steps})

    async def _slow(self, prompt: list[int], sampling: Any, request_id: str
                    ) -> tuple[list[int], list[float]]:
        log = self.calls[request_id] = {"start": time.time(), "steps": 0, "end": None,
                                        "how": None, "max_tokens": sampling.max_tokens}
        tokens: list[int] = []
        logprobs: list[float] = []
        one = sampling.model_copy(update={"max_tokens": 1})
        try:
            while len(tokens) < sampling.max_tokens:
                await asyncio.sleep(self.slow_step_s)
                gen = await self.engine.generate(prompt + tokens, one,
                                                 f"slow-{request_id}-{len(tokens)}")
                tokens += gen.token_ids
                logprobs += gen.logprobs
                log["steps"] = len(tokens)
        except asyncio.CancelledError:
            log["how"] = "cancelled"
            raise
        finally:
            log["end"] = time.time()
        log["how"] = "done"
        return tokens, logprobs

    async def slow_calls(self) -> dict[str, dict[str, Any]]:
        return dict(self.calls)

    async def inflight(self) -> int:
        return self.engine.inflight_requests

    async def request_count(self) -> int:
        return self.requests
