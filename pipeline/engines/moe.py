"""Capturing a transformers MoE model's router choices during generation.

:class:`RouterCapture` puts a forward hook on every router ("gate") module of a Hugging Face
MoE model (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4-MoE, ...). After each
model forward, the engine calls :meth:`RouterCapture.record` with the request id of each batch
row and which input positions were real tokens; the capture appends each row's top-k expert
ids ``[tokens, num_layers, topk]`` to that request. When the request ends the engine calls
:meth:`RouterCapture.pop` and returns the array as ``Generation.routed_experts``.

What the array covers: every token the model ran on for the request, in order: the prompt
(prefill) and each sampled token that was fed back (decode). The last sampled token is never
fed back, so a request with prompt length ``p`` that sampled ``n`` tokens gives ``p + n - 1``
rows. ``pipeline.batch`` zero-fills that last position: no token with loss attends to it.

The ids are the ones the model used: transformers (v5) routers return
``(logits, weights, indices)`` and the hook keeps ``indices``, so routers that select with a
bias (DeepSeek-V3's ``e_score_correction_bias``) are captured as they chose. Routers that
return only logits (older transformers) get the top-k of the logits.

Hooks run on whichever thread runs the model (the engine's worker thread); ``record`` and
``pop`` must run on that thread too.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import numpy as np
import torch

from pipeline._exceptions import EngineError


def find_routers(model: Any) -> list[tuple[str, torch.nn.Module]]:
    """The router modules of ``model``, in layer order.

    A router is the ``gate`` (or ``router``) child of a module that also has ``experts``:
    the sparse MoE block of every transformers MoE architecture. Dense layers of a partly
    sparse model (``mlp_only_layers``, ``first_k_dense_replace``) have none.

    Returns:
        ``[(qualified name, module), ...]``; empty for a dense model.
    """
    found = []
    for name, module in model.named_modules():
        if not hasattr(module, "experts"):
            continue
        for attr in ("gate", "router"):
            child = getattr(module, attr, None)
            if isinstance(child, torch.nn.Module):
                found.append((f"{name}.{attr}", child))
                break
    return found


class RouterCapture:
    """Per-request top-k expert ids of every token a MoE model runs on.

    Use as a context manager (or call :meth:`close`) so the hooks come off the model.

    Args:
        model: a transformers MoE causal LM.
        dtype: integer dtype of the returned arrays; ``int16`` holds any expert id below
            32768 at a quarter of int64's memory (routing is ``layers * topk`` ids per token).

    Attributes:
        names: the router modules, in layer order.
        num_layers: MoE layers (the arrays' second dimension).
        topk: experts per token (the third).

    Raises:
        EngineError: the model has no router modules.
    """

    def __init__(self, model: Any, *, dtype: Any = np.int16) -> None:
        routers = find_routers(model)
        if not routers:
            raise EngineError(f"{type(model).__name__} has no MoE router modules to capture "
                              f"(no module with both 'experts' and a 'gate'/'router')")
        config = getattr(model, "config", None)
        self.names = [name for name, _ in routers]
        self.num_layers = len(routers)
        topk: Any = (getattr(routers[0][1], "top_k", None)
                     or getattr(config, "num_experts_per_tok", None) or 0)
        self.topk = int(topk)
        if self.topk < 1:
            raise EngineError("cannot tell how many experts the router picks per token")
        self.dtype = np.dtype(dtype)
        self._step: list[torch.Tensor | None] = [None] * self.num_layers
        self._buffers: dict[str, list[np.ndarray]] = {}
        self._handles = [module.register_forward_hook(self._hook(i))
                         for i, (_, module) in enumerate(routers)]

    def _hook(self, layer: int) -> Any:
        def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
            self._step[layer] = _expert_ids(output, self.topk)
        return keep

    def record(self, keys: list[str], valid: torch.Tensor | None = None) -> None:
        """File the routing of the forward that just ran under each row's key.

        Call it right after each model forward, before the next one.

        Args:
            keys: one key (request id) per batch row, in row order.
            valid: ``[rows, positions]`` of that forward's input, nonzero where the position
                is a real token (the prefill's attention mask); None: every position is
                (a decode step).

        Raises:
            EngineError: a router did not run in that forward, or the shapes disagree with
                ``keys``.
        """
        step, self._step = self._step, [None] * self.num_layers
        if any(ids is None for ids in step):
            missing = [n for n, ids in zip(self.names, step, strict=True) if ids is None]
            raise EngineError(f"routers {missing} did not run in the last forward")
        rows = len(keys)
        flat = torch.stack([ids.reshape(-1, self.topk) for ids in step if ids is not None],
                           dim=1)  # [rows * positions, layers, topk]
        if rows == 0 or flat.shape[0] % rows:
            raise EngineError(f"router output has {flat.shape[0]} tokens for {rows} rows")
        routes = flat.reshape(rows, -1, self.num_layers, self.topk).cpu().numpy()
        routes = routes.astype(self.dtype, copy=False)
        keep = None if valid is None else valid.detach().bool().cpu().numpy()
        if keep is not None and keep.shape != routes.shape[:2]:
            raise EngineError(f"valid has shape {keep.shape}, the forward ran "
                              f"{routes.shape[:2]} positions")
        for row, key in enumerate(keys):
            self._buffers.setdefault(key, []).append(
                routes[row] if keep is None else routes[row][keep[row]])

    def pop(self, key: str) -> np.ndarray | None:
        """The routing recorded for ``key`` as ``[tokens, num_layers, topk]``; forgets it.

        Returns:
            The array, or None when nothing was recorded for ``key``.
        """
        parts = self._buffers.pop(key, None)
        if not parts:
            return None
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def clear(self) -> None:
        """Forget every request's routing (after a failed step, say)."""
        self._buffers.clear()
        self._step = [None] * self.num_layers

    def close(self) -> None:
        """Remove the hooks from the model and forget everything."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()

    def __enter__(self) -> RouterCapture:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _expert_ids(output: Any, topk: int) -> torch.Tensor:
    """The chosen expert ids from a router's output: ``(logits, weights, indices)`` or
    logits alone."""
    if isinstance(output, tuple | list):
        for value in reversed(output):
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                return value.detach()
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise EngineError(f"unexpected router output of type {type(output).__name__}")
    return output.detach().topk(topk, dim=-1).indices
