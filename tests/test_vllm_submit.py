"""What VLLMEngine hands vLLM per request, without starting an engine: the sampling params
are built fresh for every request and marked as that request's own, so vLLM's frontend does
not deep-copy them on the event loop (issue 42 item 4: 40-100 us per request, paid for
every one of thousands of requests submitted at once). Skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (see scripts/install_vllm.sh)"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"
                               ":DeprecationWarning"),  # torch, imported by vLLM
]

from pipeline import SamplingParams  # noqa: E402
from pipeline.engines.vllm import VLLMEngine  # noqa: E402


@pytest.fixture(scope="module")
def engine() -> VLLMEngine:
    """The engine's request building only: no AsyncLLM behind it (nothing is submitted)."""
    return VLLMEngine(None, ignore_eos=True)


def test_vllm_takes_the_request_params_without_a_deep_copy(engine: VLLMEngine) -> None:
    params = engine.sampling_params(SamplingParams(max_tokens=8, seed=3, stop_token_ids=[7]))
    # vLLM's add_request copies params with clone(): a deep copy unless they are the
    # request's own. A shallow copy shares the stop list; a deep copy does not.
    assert params.clone().stop_token_ids is params.stop_token_ids
    assert params.stop_token_ids == [7] and params.seed == 3 and params.max_tokens == 8


def test_every_request_gets_params_of_its_own(engine: VLLMEngine) -> None:
    sampling = SamplingParams(max_tokens=8, seed=3, stop_token_ids=[7])
    first, second = engine.sampling_params(sampling), engine.sampling_params(sampling)
    # vLLM may fill in a request's params (its stop ids, the output kind): never shared.
    assert first is not second and first.stop_token_ids is not second.stop_token_ids


def test_token_prompt_is_plain_ints(engine: VLLMEngine) -> None:
    import numpy as np

    prompt = engine.prompt(np.array([5, 6, 7], dtype=np.int64))
    ids = prompt["prompt_token_ids"]
    assert ids == [5, 6, 7] and all(type(t) is int for t in ids)
