"""Torch + transformers engine: concurrent requests micro-batched into one forward loop.

Every ``generate`` call becomes a request queued to one worker thread that owns the model; the
event loop never runs model code. The worker runs a continuous batch:

1. at each step boundary it reads new requests and aborts;
2. new requests are prefilled together (left-padded, with an attention mask and per-row
   position ids) and their KV cache is merged into the running batch's cache;
3. one decode step runs for every row; each row samples with its own parameters and seed;
4. rows that stopped (stop token, token limit, abort) leave the batch at once.

Only full-attention decoder models are supported (the cache is padded on the left and sliced
by rows, which sliding-window layers do not allow). Extension points for later work: weight
sync runs code between steps with :meth:`TransformersEngine.call_in_worker`; the forward
passes themselves are :mod:`pipeline.engines._torch_forward`'s.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import queue
import threading
import zlib
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from pipeline._data.config import SamplingParams
from pipeline._data.models import FinishReason
from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._base import Generation
from pipeline.engines._torch_forward import ModelSteps
from pipeline.engines._torch_sampling import (
    ProcessorFactory,
    apply_processors,
    sample_rows,
)
from pipeline.engines._torch_worker import (
    Batch,
    EngineCounters,
    Request,
    deliver,
    eos_ids,
    keep_rows,
    merge_batches,
)
from pipeline.engines.moe import RouterCapture

_T = TypeVar("_T")
_logger = structlog.get_logger("pipeline.engines.transformers")

class TransformersEngine:
    """In-process engine on a Hugging Face causal LM (CPU or CUDA), micro-batched.

    ``logprobs`` are the log-probabilities of each sampled token under the distribution it was
    actually sampled from: the model's logits after the request's logits processor (if any),
    temperature, top-k and top-p, renormalised. With ``temperature=0`` the token is the argmax
    and its logprob is taken from that processed distribution at temperature 1.

    Sampling is seeded per request: the generator is seeded from ``sampling.seed`` (or, when
    it is None, the engine seed and the request id) mixed with a digest of the prompt ids, so
    the same seed and prompt give the same tokens whatever else is in the batch, while the
    turns of one agent loop (different prompts, same seed) get different random streams.

    Stops are token ids only: the model's eos ids plus ``sampling.stop_token_ids`` (the stop
    token is returned). ``raw_finish_reason`` is ``eos``/``stop_token`` for ``stop``,
    ``max_tokens``/``context`` for ``length`` (``context``: the model's ``max_model_len``
    was the binding limit; a prompt that already fills it returns no tokens), ``abort``.

    Raises (constructor): ConfigError for sizes below 1, EngineError for a model with
    sliding-window attention.

    Args:
        model: a causal LM (``transformers`` ``PreTrainedModel``), already on its device.
        tokenizer: the matching tokenizer, exposed as ``engine.tokenizer`` (optional).
        max_batch_size: most requests decoded together; more wait for a free row.
        max_model_len: context limit (prompt + generated); default: the model's
            ``max_position_embeddings``.
        max_prefill_tokens: bound on padded tokens prefilled in one forward (memory).
        eos_token_ids: stop ids besides each request's own; default from the model's
            generation config and the tokenizer.
        processor_factory: picks a :data:`LogitsProcessor` per request (constrained decoding).
        seed: base seed for requests without ``sampling.seed``.
        capture_routes: record each token's MoE router choice (top-k expert ids per layer,
            :class:`~pipeline.engines.moe.RouterCapture`) and return it as
            ``Generation.routed_experts``; needs an MoE model.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, max_batch_size: int = 32,
                 max_model_len: int | None = None, max_prefill_tokens: int = 16384,
                 eos_token_ids: Sequence[int] | None = None,
                 processor_factory: ProcessorFactory | None = None, seed: int = 0,
                 capture_routes: bool = False) -> None:
        if max_batch_size < 1 or max_prefill_tokens < 1:
            raise ConfigError("max_batch_size and max_prefill_tokens must be >= 1")
        config = model.config
        if hasattr(config, "get_text_config"):  # a vision-language model's sizes are its text's
            config = config.get_text_config()
        layer_types = getattr(config, "layer_types", None) or []
        if getattr(config, "use_sliding_window", False) or any(
                t != "full_attention" for t in layer_types):
            raise EngineError("TransformersEngine supports full-attention models only")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.vocab_size = int(config.vocab_size)
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None
                                       else eos_ids(model, tokenizer))
        self.pad_token_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.processor_factory = processor_factory
        self.seed = seed
        self.policy_version: int | None = None
        """Version of the loaded weights; reported on every generation (weight sync sets it)."""
        self.counters = EngineCounters()
        self.routes: RouterCapture | None = RouterCapture(self.model) if capture_routes else None
        self.steps = ModelSteps(self.model, self.pad_token_id, self.counters)
        """The forward passes (:mod:`._torch_forward`), run by the worker thread."""
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._known: dict[str, Request] = {}  # worker thread only: queued or running
        self._closed = False
        self._lock = threading.Lock()
        self._recompute = False  # worker thread only: re-prefill the running rows next step

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "cpu", dtype: Any = None,
                        **kwargs: Any) -> TransformersEngine:
        """Load a model directory (and its tokenizer) and build an engine on ``device``.

        Blocking (seconds to minutes): call it before the event loop starts, or through
        ``asyncio.to_thread``. ``dtype`` defaults to float32 on CPU and bfloat16 elsewhere;
        other keyword arguments go to the constructor.

        Raises:
            EngineError: the model or tokenizer cannot be loaded.
        """
        hf: Any = importlib.import_module("transformers")  # untyped at this boundary
        if dtype is None:
            dtype = torch.float32 if str(device) == "cpu" else torch.bfloat16
        try:
            tokenizer = hf.AutoTokenizer.from_pretrained(str(path))
            config = hf.AutoConfig.from_pretrained(str(path))
            # a vision-language checkpoint (Qwen2.5-VL) loads as its own class: the causal-LM
            # auto class would load its text half only
            auto = (hf.AutoModelForImageTextToText if hasattr(config, "vision_config")
                    else hf.AutoModelForCausalLM)
            model = auto.from_pretrained(str(path), dtype=dtype)
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot load a model from {path}: {exc}") from exc
        return cls(model.to(device), tokenizer, **kwargs)

    @property
    def inflight_requests(self) -> int:
        """Requests the worker holds now (queued or running); 0 once aborts have landed."""
        return len(self._known)

    # ----- the async side (event loop) --------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams,
                       request_id: str, *, multi_modal: Any = None) -> Generation:
        """Queue one request and wait for it (see the class doc for what comes back).

        ``multi_modal`` (a :class:`pipeline.multimodal.MultiModalInputs`) carries the pixel
        inputs of the prompt's image tokens, for a vision-language model (Qwen2-VL,
        Qwen2.5-VL): they are encoded at prefill, with the model's 3-D (mrope) positions.

        Raises:
            EngineError: the engine is closed, the prompt is empty or holds an id outside the
                vocabulary, the request id is in flight already, or the model failed.
            asyncio.CancelledError: the caller was cancelled; the request is aborted too.
        """
        if self._closed:
            raise EngineError(f"request {request_id}: the engine is closed")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise EngineError(f"request {request_id}: empty prompt")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise EngineError(f"request {request_id}: prompt holds a token id outside "
                              f"[0, {self.vocab_size})")
        if multi_modal and not self.steps.takes_images:
            raise EngineError(f"request {request_id}: the model takes no images "
                              f"({type(self.model).__name__})")
        room = self.max_model_len - len(prompt)
        if room <= 0:
            return Generation([], [], FinishReason.LENGTH, "context",
                              policy_version=self.policy_version)
        loop = asyncio.get_running_loop()
        request = Request(
            request_id=request_id, prompt=prompt, sampling=sampling,
            max_tokens=min(sampling.max_tokens, room),
            limit="max_tokens" if sampling.max_tokens <= room else "context",
            loop=loop, future=loop.create_future(),
            generator=torch.Generator().manual_seed(self._request_seed(prompt, sampling,
                                                                       request_id)),
            processor=(self.processor_factory(request_id, prompt)
                       if self.processor_factory is not None else None),
            images=multi_modal or None)
        self._send("add", request)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._send("abort", request_id)
            raise

    async def abort(self, request_id: str) -> None:
        """End ``request_id`` at the next step boundary with ``finish_reason=abort`` (the
        tokens sampled so far are returned); unknown ids are ignored."""
        if not self._closed:
            self._send("abort", request_id)

    async def call_in_worker(self, fn: Callable[[Any], _T], *, recompute: bool = False) -> _T:
        """Run ``fn(model)`` on the worker thread between two steps and return its result.

        The hook weight sync builds on: nothing runs on the model while ``fn`` runs. With
        ``recompute=True`` (``fn`` changed the weights) the requests decoding now drop their
        KV cache and prefill their prompt and the tokens sampled so far again before their
        next token, so every token after the call is sampled from the new weights alone (a
        partial rollout; vLLM preempts its running requests the same way). The policy version
        each token is stamped with is read at its step, so ``fn`` may set ``policy_version``.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[_T] = loop.create_future()
        self._send("call", fn, loop, future, recompute)
        return await future

    async def aclose(self) -> None:
        """Abort every request, stop the worker thread and wait for it."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._inbox.put(("close",))
            await asyncio.to_thread(thread.join)
        if self.routes is not None:
            self.routes.close()

    def _send(self, *command: Any) -> None:
        with self._lock:
            if self._closed and command[0] != "close":
                raise EngineError("the engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="transformers-engine",
                                                daemon=True)
                self._thread.start()
            self._inbox.put(command)

    def _request_seed(self, prompt: list[int], sampling: SamplingParams, request_id: str) -> int:
        base = sampling.seed if sampling.seed is not None else zlib.crc32(
            f"{self.seed}:{request_id}".encode())
        digest = hashlib.blake2b(array("q", prompt).tobytes(), digest_size=8,
                                 key=str(base).encode()[:64]).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    # ----- the worker thread --------------------------------------------------------------

    def _serve(self) -> None:
        waiting: list[Request] = []
        batch: Batch | None = None
        with torch.inference_mode():
            while True:
                try:
                    if self._take_commands(waiting, batch, block=batch is None and not waiting):
                        for request in list(self._known.values()):
                            self._finish(request, FinishReason.ABORT, "abort")
                        return
                    if batch is not None and self._recompute:
                        waiting[:0] = batch.rows  # their KV came from the old weights
                        batch = None
                    self._recompute = False
                    if batch is not None:
                        batch = self._drop(batch, [r.aborted for r in batch.rows])
                    if waiting and (batch is None or len(batch.rows) < self.max_batch_size):
                        batch = self._admit(waiting, batch)
                    if batch is not None:
                        batch = self._decode(batch)
                except Exception as exc:  # the model failed: fail its requests, keep serving
                    _logger.error("engine_step_failed", error=repr(exc))
                    for request in list(self._known.values()):
                        self._fail(request, EngineError(
                            f"request {request.request_id}: model failed: "
                            f"{type(exc).__name__}: {exc}"))
                    waiting, batch = [], None
                    if self.routes is not None:
                        self.routes.clear()

    def _take_commands(self, waiting: list[Request], batch: Batch | None, block: bool) -> bool:
        """Apply queued commands; True when the engine is closing."""
        while True:
            try:
                command = self._inbox.get() if block else self._inbox.get_nowait()
            except queue.Empty:
                return False
            block = False
            kind = command[0]
            if kind == "close":
                return True
            if kind == "add":
                request: Request = command[1]
                if request.request_id in self._known:
                    deliver(request.loop, request.future, None, EngineError(
                        f"request id {request.request_id!r} is already in flight"))
                else:
                    self.counters.requests += 1
                    self._known[request.request_id] = request
                    waiting.append(request)
            elif kind == "abort":
                found = self._known.get(command[1])
                if found is not None:
                    found.aborted = True
                    if found in waiting:
                        waiting.remove(found)
                        self._finish(found, FinishReason.ABORT, "abort")
            elif kind == "call":
                fn, loop, future, recompute = command[1:]
                try:
                    deliver(loop, future, fn(self.model), None)
                except Exception as exc:
                    deliver(loop, future, None, exc)
                self._recompute = self._recompute or recompute

    def _admit(self, waiting: list[Request], batch: Batch | None) -> Batch | None:
        free = self.max_batch_size - (len(batch.rows) if batch else 0)
        group: list[Request] = []
        longest = 0
        while waiting and len(group) < free:
            longest_if = max(longest, len(waiting[0].prompt) + len(waiting[0].tokens))
            if group and longest_if * (len(group) + 1) > self.max_prefill_tokens:
                break
            longest = longest_if
            group.append(waiting.pop(0))
        fresh, logits = self.steps.prefill(group)
        return merge_batches(batch, self._sample_and_settle(fresh, logits))

    def _decode(self, batch: Batch) -> Batch | None:
        return self._sample_and_settle(batch, self.steps.decode(batch))

    def _sample_and_settle(self, batch: Batch, logits: torch.Tensor) -> Batch | None:
        rows = batch.rows
        if self.routes is not None:
            self.routes.record([r.request_id for r in rows], self.steps.step_valid)
        broken = apply_processors(rows, logits)
        next_ids, tokens, logprobs = sample_rows(logits, [r.sampling for r in rows],
                                                 [r.generator for r in rows])
        done: list[bool] = []
        for request, token, logprob, error in zip(rows, tokens, logprobs, broken, strict=True):
            done.append(True)
            if error is not None:
                self._fail(request, error)
                continue
            request.tokens.append(token)
            request.logprobs.append(logprob)
            request.versions.append(self.policy_version)
            self.counters.generated_tokens += 1
            if token in self.eos_token_ids:
                self._finish(request, FinishReason.STOP, "eos")
            elif token in request.sampling.stop_token_ids:
                self._finish(request, FinishReason.STOP, "stop_token")
            elif len(request.tokens) >= request.max_tokens:
                self._finish(request, FinishReason.LENGTH, request.limit)
            else:
                done[-1] = False
        batch.last = next_ids
        return self._drop(batch, done)

    def _drop(self, batch: Batch, gone: list[bool]) -> Batch | None:
        """Remove rows (finished or aborted) and trim cache columns no row needs."""
        if not any(gone):
            return batch
        for request, leaves in zip(batch.rows, gone, strict=True):
            if leaves and request.aborted:
                self._finish(request, FinishReason.ABORT, "abort")
        return keep_rows(batch, [i for i, leaves in enumerate(gone) if not leaves])

    def _fail(self, request: Request, error: EngineError) -> None:
        """End ``request`` with ``error`` raised from its ``generate`` call."""
        if request.finished:
            return
        request.finished = True
        self._known.pop(request.request_id, None)
        if self.routes is not None:
            self.routes.pop(request.request_id)
        deliver(request.loop, request.future, None, error)

    def _finish(self, request: Request, reason: FinishReason, raw: str) -> None:
        if request.finished:
            return
        request.finished = True
        self._known.pop(request.request_id, None)
        routes = self.routes.pop(request.request_id) if self.routes is not None else None
        versions = request.versions
        tracked = [v for v in versions if v is not None]
        per_token = list(tracked) if len(tracked) == len(versions) and tracked else None
        generation = Generation(list(request.tokens), list(request.logprobs), reason, raw,
                                routed_experts=routes,
                                policy_version=min(tracked) if tracked else self.policy_version,
                                token_versions=per_token)
        deliver(request.loop, request.future, generation, None)
