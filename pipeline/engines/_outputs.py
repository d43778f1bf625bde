"""What the vLLM-backed engines (in-process and over a server) share when they turn vLLM's
answer into a :class:`~pipeline.Generation`: one reading of its finish reason and one layout of
its MoE router choices, so the two engines cannot drift apart."""

from __future__ import annotations

from typing import Any

from pipeline._data.models import FinishReason
from pipeline._exceptions import EngineError


def finish_reason(raw: Any, stop_reason: Any, request_id: str,
                  source: str = "vLLM") -> tuple[FinishReason, str]:
    """vLLM's ``finish_reason`` as ours, with the raw word kept for the sample.

    A ``stop`` is split by vLLM's ``stop_reason``: an int is one of the caller's stop token
    ids (``"stop_token"``), anything else is the model's eos (``"eos"``).

    Raises:
        EngineError: a finish reason this project does not know (it would be silently
            trained on otherwise).
    """
    if raw == "stop":
        return FinishReason.STOP, "stop_token" if isinstance(stop_reason, int) else "eos"
    if raw == "length":
        return FinishReason.LENGTH, "length"
    if raw == "abort":
        return FinishReason.ABORT, "abort"
    raise EngineError(f"request {request_id}: {source} finished with {raw!r}")


def full_length_experts(experts: Any, length: int) -> Any:
    """Router choices padded to ``[length, layers, topk]`` (int32).

    vLLM reports one row per forwarded token, which leaves out the last sampled token (it is
    never fed back); that row is zero-filled so the array lines up with prompt + response.

    Raises:
        EngineError: more rows than tokens, or not a 3-d array.
    """
    import numpy as np

    array = np.asarray(experts)
    if array.ndim != 3 or array.shape[0] > length:
        raise EngineError(f"routed_experts has shape {array.shape}; expected "
                          f"[<= {length}, layers, topk]")
    if array.shape[0] < length:
        pad = np.zeros((length - array.shape[0], *array.shape[1:]), dtype=array.dtype)
        array = np.concatenate([array, pad])
    return array.astype(np.int32, copy=False)
