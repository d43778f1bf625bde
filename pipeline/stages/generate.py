"""``Generate``: one assistant turn from the engine, appended token-exact."""

from __future__ import annotations

import asyncio

from pipeline import artifacts as A
from pipeline._context import Context
from pipeline._exceptions import SampleAborted
from pipeline._models import AgentMessage, AgentRolloutItem, ExitReason, FinishReason


class Generate:
    """Ask the engine to continue the conversation's token ids; append what it sampled.

    Reads ``prompt_ids`` and the response so far; appends the sampled tokens to
    ``response_ids`` with ``response_mask = 1`` and their ``logprobs``, and an assistant
    :class:`AgentMessage` carrying the same ids. The turn's ``max_tokens`` is the smaller of
    the per-turn cap and what is left of ``max_response_tokens``; when nothing is left, or the
    engine stops on length, the loop ends with ``exit_reason="length"``. Cancelling the stage
    (timeout, abort) aborts the engine request.
    """

    name = "generate"

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        art = item.artifacts
        response: list[int] = art.setdefault(A.RESPONSE_IDS, [])
        mask: list[int] = art.setdefault(A.RESPONSE_MASK, [])
        logprobs: list[float] = art.setdefault(A.LOGPROBS, [])
        sampling = item.sampling
        max_tokens = sampling.max_tokens
        if sampling.max_response_tokens is not None:
            max_tokens = min(max_tokens, sampling.max_response_tokens - len(response))
        if max_tokens <= 0:
            item.finish_reason, item.raw_finish_reason = FinishReason.LENGTH, "response_budget"
            art[A.EXIT_REASON] = ExitReason.LENGTH.value
            return
        turn = art.get(A.TURNS, 0)
        request_id = f"{item.uid}-{turn}"
        if max_tokens != sampling.max_tokens:
            sampling = sampling.model_copy(update={"max_tokens": max_tokens})
        try:
            gen = await ctx.engine.generate([*art[A.PROMPT_IDS], *response], sampling, request_id)
        except asyncio.CancelledError:
            await ctx.engine.abort(request_id)
            raise
        if gen.finish_reason is FinishReason.ABORT:
            raise SampleAborted(f"engine aborted request {request_id}")
        art[A.TURNS] = turn + 1
        response.extend(gen.token_ids)
        mask.extend([1] * len(gen.token_ids))
        logprobs.extend(gen.logprobs)
        if gen.policy_version is not None:
            art[A.POLICY_VERSION] = gen.policy_version
        item.finish_reason, item.raw_finish_reason = gen.finish_reason, gen.raw_finish_reason
        tokenizer = ctx.resources.tokenizer
        text = tokenizer.decode(gen.token_ids, skip_special_tokens=True) if tokenizer else None
        art.setdefault(A.MESSAGES, []).append(AgentMessage(
            role="assistant", content=text, token_ids=gen.token_ids, logprobs=gen.logprobs,
            finish_reason=gen.finish_reason))
        if gen.finish_reason is FinishReason.LENGTH:
            art[A.EXIT_REASON] = ExitReason.LENGTH.value
