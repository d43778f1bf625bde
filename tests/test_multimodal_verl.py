"""Vision-language samples handed to verl 0.9.1 (issue 41, item 5): verl's own agent-loop
postprocess (``AgentLoopWorker._compute_multi_modal_inputs`` / ``_compute_position_ids``)
run on our ``to_verl_outputs``, against our ``to_verl_batch`` columns: the same pixel inputs
and the same mrope position ids, for a prompt image, a tool's image and a text-only sample in
one batch; ``collate`` carries the pixels.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip("trl")
torch = pytest.importorskip("torch")

from _vl import rope_processor, solid_png_url  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline import BuildPrompt, CallTools, ConfigError, Generate, Loop, Pipeline  # noqa: E402
from pipeline.batch import collate, to_verl_batch, to_verl_outputs  # noqa: E402
from pipeline.multimodal import ensure_tiny_vl_model  # noqa: E402
from pipeline.testing import SimulatedEngine  # noqa: E402
from pipeline.tools import FunctionTool, tool_schema  # noqa: E402

P, R = 160, 160
IMAGE_PAD = 151655
CALL = '<tool_call>\n{"name": "zoom", "arguments": {"factor": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def processor() -> Any:
    """The tiny VL model's processor with the model's rope positions bound to it
    (``tests/_vl.py``)."""
    return rope_processor()


@pytest.fixture(scope="module")
def result(processor) -> Any:
    tokenizer = processor.tokenizer
    call = [*tokenizer.encode(CALL, add_special_tokens=False),
            tokenizer.convert_tokens_to_ids("<|im_end|>")]
    answer = [*tokenizer.encode("It is red.", add_special_tokens=False), call[-1]]

    def responder(prompt_ids: list[int], rng: Any) -> list[int]:
        text = tokenizer.decode(prompt_ids)
        return call if "Zoom" in text and "<tool_response>" not in text else answer

    zoomed = Image.new("RGB", (112, 84), (200, 0, 0))

    async def zoom(factor: int) -> Any:
        return [zoomed, {"type": "text", "text": f"x{factor}"}]

    tool = FunctionTool(name="zoom", description="Zoom in.", fn=zoom, parameters={
        "type": "object", "properties": {"factor": {"type": "integer"}}})
    rows = [{"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": solid_png_url((0, 0, 250), (80, 60))}},
                {"type": "text", "text": "Zoom in, then name the color."}]}],
             "tools": [tool_schema(tool)]},
            {"prompt": "Name a color.", "tools": []},  # no tool schema in these prompts
            {"messages": [{"role": "user", "content": [
                {"type": "image", "image": solid_png_url((0, 250, 0), (56, 56))},
                {"type": "text", "text": "Name the color."}]}], "tools": []}]
    rollout = Pipeline([BuildPrompt(processor=processor),
                        Loop([Generate(), CallTools()], max_turns=3)],
                       engine=SimulatedEngine(responder=responder, latency_s=0.0),
                       tokenizer=tokenizer, tools=[tool], sampling={"max_tokens": 40})
    return asyncio.run(rollout.run_batch(rows, n=1))


def test_verl_postprocess_agrees_with_our_batch(processor, result):
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    assert [i.status.value for i in result.items] == ["completed"] * 3, \
        [i.error for i in result.items]
    samples = result.samples
    assert [len(s.multi_modal_inputs.images) if s.multi_modal_inputs else 0
            for s in samples] == [2, 0, 1]
    outputs = to_verl_outputs(samples, items=result.items, use_verl=True)
    batch = to_verl_batch(samples, items=result.items, pad_token_id=151643,
                          max_prompt_len=P, max_response_len=R, use_verl=True,
                          processor=processor)
    ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    assert tuple(batch.batch["position_ids"].shape) == (3, 4, P + R)
    worker = SimpleNamespace(processor=processor, tokenizer=processor.tokenizer,
                             mm_processor_kwargs=None)
    worker._get_mm_processor_kwargs = lambda audios=None: {}
    for i, output in enumerate(outputs):
        theirs = AgentLoopWorker._compute_multi_modal_inputs(worker, output, ids[i:i + 1])
        positions = AgentLoopWorker._compute_position_ids(worker, ids[i:i + 1],
                                                          mask[i:i + 1], theirs, {})
        ours = batch.non_tensor_batch["multi_modal_inputs"][i]
        assert sorted(ours) == sorted(theirs)
        for key in theirs:
            assert torch.equal(ours[key], theirs[key]), key
        assert torch.equal(batch.batch["position_ids"][i:i + 1], positions)
    # the image sample's vision rows differ from its text row: mrope, not 1-D positions
    first = batch.batch["position_ids"][0]
    assert not torch.equal(first[0], first[2])
    # two images: 80x60 -> 84x56 -> 6x4 patches -> 6 tokens; 112x84 -> 8x6 -> 12 tokens
    assert ids[0].tolist().count(IMAGE_PAD) == 6 + 12


def test_collate_carries_pixels_and_images_need_rope_index(processor, result):
    samples = result.samples
    out = collate(samples, pad_token_id=151643, max_prompt_len=P, max_response_len=R)
    assert out["image_counts"].tolist() == [2, 0, 1]
    assert out["image_grid_thw"].tolist() == [[1, 4, 6], [1, 6, 8], [1, 4, 4]]
    assert out["pixel_values"].shape[0] == 24 + 48 + 16
    assert torch.equal(out["pixel_values"][:72], samples[0].multi_modal_inputs.pixel_values)
    with pytest.raises(ConfigError) as bad:
        to_verl_batch(samples, pad_token_id=151643, max_prompt_len=P, max_response_len=R,
                      use_verl=False)
    assert bad.value.field == "processor"
    line = samples[0].model_dump(mode="json")["multi_modal_inputs"]
    assert [(image["width"], image["tokens"]) for image in line] == [(80, 6), (112, 12)]


def test_an_overlong_sample_with_images_is_emptied_not_cut(processor, result):
    """A prompt budget that cuts the first sample's prompt (its image tokens among the cut):
    collate empties that row and hands over none of its images, so the model's own forward
    over the batch finds as many image tokens as features (a cut row broke it: 'Image
    features and image tokens do not match'), and to_verl_batch builds its mrope positions
    (it raised on the cut grid)."""
    samples = result.samples
    budget = len(samples[2].prompt_ids)
    assert len(samples[0].prompt_ids) > budget >= len(samples[1].prompt_ids)
    out = collate(samples, pad_token_id=151643, max_prompt_len=budget, max_response_len=R)
    assert out["overlong"].tolist() == [True, False, False]
    assert out["attention_mask"][0].sum() == 1 and not out["response_mask"][0].any()
    assert out["image_counts"].tolist() == [0, 0, 1]
    assert torch.equal(out["pixel_values"], samples[2].multi_modal_inputs.pixel_values)
    assert int((out["input_ids"] == IMAGE_PAD).sum()) == samples[2].prompt_ids.count(IMAGE_PAD)
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(ensure_tiny_vl_model())).eval()
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       pixel_values=out["pixel_values"],
                       image_grid_thw=out["image_grid_thw"]).logits
    assert logits.shape[:2] == out["input_ids"].shape
    batch = to_verl_batch(samples, items=result.items, pad_token_id=151643,
                          max_prompt_len=budget, max_response_len=R, use_verl=False,
                          processor=processor)
    handed = batch["non_tensor_batch"]["multi_modal_inputs"]
    assert [sorted(h) for h in handed] == [[], [], ["image_grid_thw", "images_seqlens",
                                                    "pixel_values"]]
    assert tuple(batch["batch"]["position_ids"].shape) == (3, 4, budget + R)
    assert batch["non_tensor_batch"]["rollout_overlong"].tolist() == [True, False, False]
