"""Issue 33, item 10 (engine names): one registry of engine names, which ``make_engine``,
its error message and its type all come from; ``simulated`` is one of them, built by
``make_engine`` like the others and paired with its tokenizer's eos (item 7c)."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from pipeline import ConfigError, SamplingParams
from pipeline.engines import ENGINE_NAMES, SimulatedEngine, make_engine, resolve_engine_name
from pipeline.engines._factory import ENGINES, EngineName
from pipeline.testing import ByteTokenizer


def test_item10_known_engines_list_comes_from_the_registry():
    with pytest.raises(ConfigError) as info:
        resolve_engine_name("tgi")
    assert str(info.value).endswith("known: " + ", ".join(ENGINE_NAMES))
    assert "simulated" in ENGINE_NAMES
    assert tuple(ENGINES) == ENGINE_NAMES == get_args(EngineName)
    assert len(set(ENGINE_NAMES)) == len(ENGINE_NAMES)
    assert all(isinstance(why, str) and why for why in ENGINES.values())


async def test_item10_make_engine_builds_every_registered_name_it_can_here():
    """Every registered name is either built here or refused for a reason that is not
    'unknown engine' (vLLM/transformers need a model, openai a server)."""
    for name in ENGINE_NAMES:
        try:
            chosen, reason = resolve_engine_name(name)
        except ConfigError as exc:  # pragma: no cover - every registered name resolves
            raise AssertionError(f"{name}: {exc}") from None
        assert chosen in ENGINE_NAMES and chosen != "auto" and reason


async def test_item10_make_engine_simulated_pairs_the_tokenizers_eos():
    def six(prompt_ids: list[int], rng: Any) -> list[int]:
        return [*tok.encode("hello"), tok.eos_token_id]

    tok = ByteTokenizer()
    lines: list[str] = []
    engine, tokenizer = await make_engine("simulated", model_dir=None, notify=lines.append,
                                          options={"responder": six, "latency_s": 0.0})
    try:
        assert isinstance(engine, SimulatedEngine) and isinstance(tokenizer, ByteTokenizer)
        assert engine.eos_token_id == tokenizer.eos_token_id
        assert lines == ["engine=simulated (asked for)"]
        gen = await engine.generate(tokenizer.encode("hi"), SamplingParams(max_tokens=20), "r-0")
        assert gen.finish_reason == "stop" and len(gen.token_ids) == 6
    finally:
        await engine.aclose()
    with pytest.raises(ConfigError, match="--base-url is for --engine openai"):
        await make_engine("simulated", model_dir=None, base_url="http://x")
    with pytest.raises(ConfigError, match="eos"):
        await make_engine("simulated", model_dir=None, options={"eos_token_id": 7})
