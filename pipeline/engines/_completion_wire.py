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


def sampling_fields(sampling: SamplingParams, *, ignore_eos: bool) -> dict[str, Any]:
    """vLLM's sampling fields for ``sampling``: the sampled token's logprob, stop ids, special
    tokens kept (the same in a completion body and in ``/inference/v1/generate``'s
    ``sampling_params``)."""
    fields: dict[str, Any] = {
        "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "logprobs": 0,
        "stop_token_ids": list(sampling.stop_token_ids), "skip_special_tokens": False,
    }
    if sampling.top_k > 0:
        fields["top_k"] = sampling.top_k
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    if ignore_eos:
        fields["ignore_eos"] = True
    return fields


def completion_body(model: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                    request_id: str, *, ignore_eos: bool,
                    extra_body: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of one completion (``extra_body`` last: it may override any field)."""
    body = {"model": model, "prompt": [int(t) for t in prompt_ids], "return_token_ids": True,
            "request_id": request_id, **sampling_fields(sampling, ignore_eos=ignore_eos)}
    body.update(extra_body)
    return body


def read_completion(answer: Mapping[str, Any], prompt_ids: Sequence[int], request_id: str,
                    version: int | None, *, check_prompt: bool) -> Generation:
    """The generation in a completion answer.

    Raises:
        EngineError: no choice, no ``token_ids`` (not vLLM-compatible enough), a logprob
            missing, or (``check_prompt``) echoed prompt ids that differ from those sent.
    """
    choice, tokens = sampled_choice(answer, request_id)
    echoed = choice.get("prompt_token_ids")
    if check_prompt and echoed is not None and list(echoed) != list(prompt_ids):
        raise EngineError(f"request {request_id}: the server's prompt_token_ids "
                          f"({len(echoed)} ids) differ from the {len(prompt_ids)} ids sent")
    block = choice.get("logprobs")
    logprobs = sampled_logprobs(block.get("token_logprobs") if isinstance(block, Mapping)
                                else None, len(tokens), request_id)
    return choice_generation(choice, tokens, logprobs, len(prompt_ids), request_id, version)


def sampled_choice(answer: Mapping[str, Any], request_id: str) -> tuple[Any, list[int]]:
    """The first choice of an answer and its sampled token ids.

    Raises:
        EngineError: no choice, or no ``token_ids`` (not vLLM-compatible enough).
    """
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"request {request_id}: the answer has no choice") from None
    tokens = choice.get("token_ids")
    if tokens is None:
        raise EngineError(f"request {request_id}: the server returned no token_ids "
                          f"(it needs return_token_ids support, as vLLM has)")
    return choice, [int(t) for t in tokens]


def choice_generation(choice: Mapping[str, Any], tokens: list[int], logprobs: list[float],
                      prompt_len: int, request_id: str, version: int | None) -> Generation:
    """The :class:`Generation` of a checked choice: its finish reason and routed experts."""
    reason, raw = finish_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                request_id, "the server")
    experts = choice.get("routed_experts")
    if experts is not None:
        experts = decode_experts(experts, prompt_len + len(tokens))
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
