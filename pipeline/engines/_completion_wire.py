"""The ``/v1/completions`` wire format of :class:`~pipeline.engines.OpenAIEngine`: the body
it sends (token ids in, vLLM's ``return_token_ids`` and the sampled token's logprob asked
for) and the :class:`~pipeline.engines.Generation` read from the answer, checked.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline._data.config import SamplingParams
from pipeline._exceptions import EngineError
from pipeline.engines._base import Generation
from pipeline.engines._outputs import finish_reason, full_length_experts


def completion_body(model: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                    request_id: str, *, ignore_eos: bool,
                    extra_body: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of one completion (``extra_body`` last: it may override any field)."""
    body: dict[str, Any] = {
        "model": model, "prompt": [int(t) for t in prompt_ids],
        "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "logprobs": 0, "return_token_ids": True,
        "stop_token_ids": list(sampling.stop_token_ids), "skip_special_tokens": False,
        "request_id": request_id,
    }
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body)
    return body


def read_completion(answer: Mapping[str, Any], prompt_ids: Sequence[int], request_id: str,
                    version: int | None, *, check_prompt: bool) -> Generation:
    """The generation in a completion answer.

    Raises:
        EngineError: no choice, no ``token_ids`` (not vLLM-compatible enough), a logprob
            missing, or (``check_prompt``) echoed prompt ids that differ from those sent.
    """
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"request {request_id}: the answer has no choice") from None
    tokens = choice.get("token_ids")
    if tokens is None:
        raise EngineError(f"request {request_id}: the server returned no token_ids "
                          f"(it needs return_token_ids support, as vLLM has)")
    tokens = [int(t) for t in tokens]
    echoed = choice.get("prompt_token_ids")
    if check_prompt and echoed is not None and list(echoed) != list(prompt_ids):
        raise EngineError(f"request {request_id}: the server's prompt_token_ids "
                          f"({len(echoed)} ids) differ from the {len(prompt_ids)} ids sent")
    block = choice.get("logprobs")
    logprobs = sampled_logprobs(block.get("token_logprobs") if isinstance(block, Mapping)
                                else None, len(tokens), request_id)
    reason, raw = finish_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                request_id, "the server")
    experts = choice.get("routed_experts")
    if experts is not None:
        experts = decode_experts(experts, len(prompt_ids) + len(tokens))
    return Generation(tokens, logprobs, reason, raw, routed_experts=experts,
                      policy_version=version)


def sampled_logprobs(values: Sequence[Any] | None, count: int,
                     request_id: str) -> list[float]:
    """The sampled tokens' logprobs, one per token, as floats.

    Raises:
        EngineError: a count other than ``count``, or a position without a logprob.
    """
    if values is None or len(values) != count:
        raise EngineError(f"request {request_id}: the server returned "
                          f"{0 if values is None else len(values)} logprobs for {count} tokens")
    out: list[float] = []
    for position, value in enumerate(values):
        if value is None or math.isnan(float(value)):
            raise EngineError(f"request {request_id}: no logprob at position {position}")
        out.append(float(value))
    return out


def decode_experts(encoded: str, length: int) -> Any:
    """vLLM's base64 ``.npy`` router choices, padded to ``[length, layers, topk]``."""
    import numpy as np

    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    return full_length_experts(array, length)
