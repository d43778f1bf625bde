"""A sample's images and their pixel inputs, and the processor that renders them.

:class:`VisionProcessor` wraps a Hugging Face processor (``AutoProcessor``: for Qwen2-VL /
Qwen2.5-VL a ``Qwen2_5_VLProcessor``): the chat template renders one placeholder per image
(``<|vision_start|><|image_pad|><|vision_end|>``), the processor's ``__call__`` resizes each
image, cuts it into patches and repeats the placeholder token once per merged patch, so the
token ids are exactly what the model expects, and returns ``pixel_values`` and
``image_grid_thw`` beside them. Everything here is synchronous and CPU-heavy: callers run it
in a worker thread (:mod:`pipeline.multimodal._prompt`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pipeline import artifacts as A
from pipeline._exceptions import ConfigError
from pipeline.multimodal._images import (
    ImageError,
    ImageLimits,
    LoadedImage,
    iter_image_parts,
    part_source,
)

_T = TypeVar("_T")

MULTI_MODAL = A.MULTI_MODAL
"""Artifact: the sample's :class:`SampleImages` (set by ``BuildPrompt(processor=...)``)."""


@dataclass(frozen=True)
class MultiModalInputs:
    """The images of a token sequence and the processor's pixel inputs for them, in the order
    their placeholder tokens appear. Immutable: a tool turn's images make a new one
    (:meth:`plus`), so the ``n`` samples of a group share their prompt's.

    Attributes:
        images: the decoded images (``LoadedImage``: PIL image, sha256, size).
        pixel_values: the processor's ``pixel_values`` (``[patches, C*T*P*P]`` for Qwen2-VL),
            a torch tensor, or None without images. None too for a processor without a patch
            grid (each image a run of placeholder tokens, as Aria's or LLaVA's): vLLM engines
            take the images themselves, while the trainer handoff and the transformers engine
            need Qwen2-VL's pixel layout.
        image_grid_thw: ``[images, 3]`` patch grid per image (torch), or None.
        image_token_counts: placeholder tokens per image in the token ids.
        image_token_id: the placeholder token those runs are made of (the processor's
            ``image_token``), or None where unknown.
    """

    images: tuple[LoadedImage, ...] = ()
    pixel_values: Any = None
    image_grid_thw: Any = None
    image_token_counts: tuple[int, ...] = ()
    image_token_id: int | None = None

    def __bool__(self) -> bool:
        return bool(self.images)

    def plus(self, other: MultiModalInputs) -> MultiModalInputs:
        """These inputs followed by ``other``'s (a later turn's images)."""
        if not other:
            return self
        if not self:
            return other
        import torch

        def joined(first: Any, second: Any) -> Any:  # None: a processor without a grid
            return None if first is None or second is None else torch.cat([first, second])

        return MultiModalInputs(
            self.images + other.images, joined(self.pixel_values, other.pixel_values),
            joined(self.image_grid_thw, other.image_grid_thw),
            self.image_token_counts + other.image_token_counts,
            self.image_token_id if self.image_token_id is not None else other.image_token_id)

    def first(self, count: int) -> MultiModalInputs:
        """The inputs of the first ``count`` images (a prompt that keeps a prefix of a
        sequence's tokens keeps the images whose tokens are in it)."""
        if count >= len(self.images):
            return self
        if count <= 0:
            return MultiModalInputs()
        if self.image_grid_thw is None:  # pixel rows per image unknown: the images only
            return MultiModalInputs(self.images[:count], None, None,
                                    self.image_token_counts[:count], self.image_token_id)
        grid = self.image_grid_thw[:count]
        patches = int(grid.prod(dim=1).sum())  # pixel_values rows: one per patch
        return MultiModalInputs(self.images[:count], self.pixel_values[:patches], grid,
                                self.image_token_counts[:count], self.image_token_id)

    def template_ids(self, ids: Sequence[int], image_token: int | None = None) -> list[int]:
        """``ids`` (these images' placeholders expanded, one run of ``image_token_counts[i]``
        tokens per image) with each run written as the one placeholder the chat template
        wrote: what vLLM takes with the images, since it expands a token prompt's
        placeholders itself (sent expanded, each image's first placeholder is expanded
        again). ``image_token``: the placeholder token where :attr:`image_token_id` is None.

        Raises:
            ValueError: no placeholder token is known, or its runs in ``ids`` are not one per
                image with the counted length.
        """
        token = self.image_token_id if self.image_token_id is not None else image_token
        if token is None:
            raise ValueError("the image placeholder token is not known")
        runs = _runs(ids, token)
        if runs != list(self.image_token_counts):
            raise ValueError(f"the prompt's image placeholder runs {runs} do not match its "
                             f"images' token counts {list(self.image_token_counts)}")
        return [int(t) for i, t in enumerate(ids)
                if t != token or i == 0 or ids[i - 1] != token]  # each run's first only

    def pil_images(self) -> list[Any]:
        """The PIL images, as vLLM's ``multi_modal_data["image"]`` takes them."""
        return [image.image for image in self.images]

    def summary(self) -> list[dict[str, Any]]:
        """Per image: sha256, width, height, placeholder tokens (what dumps keep)."""
        return [{"sha256": image.sha256, "width": image.width, "height": image.height,
                 "tokens": tokens}
                for image, tokens in zip(self.images, self.image_token_counts, strict=True)]

    def trainer_inputs(self) -> dict[str, Any]:
        """verl's ``multi_modal_inputs`` entry of a sample (empty without images):
        ``pixel_values``, ``image_grid_thw`` and ``images_seqlens`` (patches per frame, as
        verl 0.9.1's worker adds it)."""
        if not self:
            return {}
        import torch

        grid = self.image_grid_thw
        return {"pixel_values": self.pixel_values, "image_grid_thw": grid,
                "images_seqlens": torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])}


@dataclass
class SampleImages:
    """The ``multi_modal`` artifact of one sample: its processor and the inputs so far
    (prompt images, then each tool turn's), replaced as turns add images."""

    processor: VisionProcessor | None
    inputs: MultiModalInputs = field(default_factory=MultiModalInputs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the processor (a Ray worker sends finished items to the driver:
        the inputs matter there, a tokenizer per item would not)."""
        return {"processor": None, "inputs": self.inputs}


@dataclass(frozen=True)
class Rendered:
    """Text with image placeholders, its expanded token ids and the pixel inputs."""

    text: str
    ids: list[int]
    inputs: MultiModalInputs


class VisionProcessor:
    """A Hugging Face processor (image processor + tokenizer), used the way the pipeline
    needs it: messages' image parts loaded and checked (:class:`ImageLimits`), replaced by
    references (hash and size) in what is kept, and the template's placeholders expanded by
    the processor.

    Image work runs on the processor's own worker threads (:meth:`submit`), ``threads`` of
    them (default 1): the image processor is mostly Python and numpy code that holds the
    GIL, and every thread doing it at once is one more thread the event loop waits behind
    for the interpreter (with the default executor's six threads a batch of 448x448 images
    delayed a 5 ms ticker by 67 ms at p99; with one, see docs/guides/multimodal.md).

    Args:
        processor: the model's processor (``AutoProcessor.from_pretrained(model_dir)``, or
            :func:`pipeline.multimodal.tiny_vl_processor`); its ``tokenizer`` is the one the
            pipeline must use (``Pipeline(tokenizer=processor.tokenizer)``).
        limits: bounds on each image.
        threads: worker threads for image work.
    """

    def __init__(self, processor: Any, *, limits: ImageLimits | None = None,
                 threads: int = 1) -> None:
        if threads < 1:
            raise ConfigError(f"threads must be >= 1, got {threads}", field="threads")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.limits = limits or ImageLimits()
        self.threads = threads
        self._executor: ThreadPoolExecutor | None = None
        token = getattr(processor, "image_token", "<|image_pad|>")
        self.image_token = token
        self.image_token_id = int(self.tokenizer.convert_tokens_to_ids(token))
        self._direct = _direct_expansion(processor)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its threads (a Ray worker sends items back to the driver)."""
        return {**self.__dict__, "_executor": None}

    def submit(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """Run ``fn(*args)`` on the processor's worker threads; the returned future is the
        loop's (cancelling it does not stop the work, which ends on its own)."""
        if self._executor is None:  # threads end with the process (concurrent.futures)
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="vision")
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def load_messages(self, messages: Sequence[Mapping[str, Any]], *, where: str = "messages",
                      first: int = 0) -> tuple[list[dict[str, Any]], list[LoadedImage]]:
        """Messages with each image part replaced by its reference (``image_ref``), and the
        loaded images in order. A part that already is a reference without an image (a
        message read back from a record) is refused: the image is gone. ``first``: the
        index of ``messages[0]`` in the request (for the field names of errors).

        Raises:
            ImageError: a part that cannot be used (names ``where.<i>.content.<j>``).
        """
        out: list[dict[str, Any]] = []
        images: list[LoadedImage] = []
        for i, message in enumerate(messages):
            content = message.get("content")
            parts = list(iter_image_parts(content))
            if not parts:
                out.append(dict(message))
                continue
            new_content = list(content or ())
            for j, part in parts:
                source = part_source(part)
                spot = f"{where}.{first + i}.content.{j}"
                if source is None:
                    raise ImageError("an image part without an image (a reference read back "
                                     "from a record cannot be rendered again)", field=spot)
                loaded = _load(source, self.limits, spot)
                images.append(loaded)
                new_content[j] = loaded.ref()
            out.append({**message, "content": new_content})
        return out, images

    def expand(self, text: str, images: Sequence[LoadedImage]) -> Rendered:
        """Token ids of ``text`` with each image placeholder expanded by the processor, and
        the pixel inputs of ``images`` (one per placeholder, in order)."""
        if not images:
            from pipeline._text.render import encode_text

            return Rendered(text, encode_text(self.tokenizer, text), MultiModalInputs())
        pil = [image.image for image in images]
        if self._direct:
            out, ids = self._expand_direct(text, pil)
        else:
            out = self.processor(text=[text], images=pil, return_tensors="pt")
            ids = [int(t) for t in out["input_ids"][0]]
        grid = out.get("image_grid_thw")
        if grid is None:  # a processor without a patch grid: each image is a run of tokens
            counts = tuple(_runs(ids, self.image_token_id))
            if len(counts) != len(images):
                raise ImageError(f"the rendered text holds {len(counts)} runs of image tokens "
                                 f"for {len(images)} images")
            return Rendered(text, ids, MultiModalInputs(tuple(images), None, None, counts,
                                                        self.image_token_id))
        merge = int(getattr(self.processor.image_processor, "merge_size", 1))
        counts = tuple(int(g.prod()) // (merge * merge) for g in grid)
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != sum(counts):  # the template lost or doubled a placeholder
            raise ImageError(f"the rendered text holds {found} image tokens, the "
                             f"{len(images)} images need {sum(counts)}")
        return Rendered(text, ids, MultiModalInputs(tuple(images), out["pixel_values"], grid,
                                                    counts, self.image_token_id))

    def _expand_direct(self, text: str, pil: list[Any]) -> tuple[Any, list[int]]:
        """What the processor's ``__call__`` does for text with images, its steps called
        directly: its image processor, its ``replace_image_token`` for each placeholder in
        order, the tokenizer's plain encoding. The call itself costs about 1.2 ms more per
        prompt (keyword merging and validation, tensor conversions; a 224x224 image turn took
        4.9 ms of CPU with it, 3.7 without, ``benchmarks/multimodal.py``)."""
        from pipeline._text.render import encode_text

        out = self.processor.image_processor(images=pil, return_tensors="pt")
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(pil):  # as the processor: every placeholder needs an image
            raise ImageError(f"the rendered text holds {len(pieces) - 1} image placeholders "
                             f"for {len(pil)} images")
        expanded = [pieces[0]]
        for index, piece in enumerate(pieces[1:]):
            expanded += [self.processor.replace_image_token(out, image_idx=index), piece]
        return out, encode_text(self.tokenizer, "".join(expanded))


def _runs(ids: Sequence[int], token: int) -> list[int]:
    """Lengths of the runs of ``token`` in ``ids``, in order."""
    runs: list[int] = []
    previous = None
    for t in ids:
        if t == token:
            if previous == token:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = t
    return runs


def _direct_expansion(processor: Any) -> bool:
    """Whether :meth:`VisionProcessor._expand_direct` gives what the processor's call gives:
    the call is transformers' generic one (``ProcessorMixin.__call__``: image processor,
    then each image token replaced by the model's ``replace_image_token``, then the
    tokenizer), the model defines that replacement, the call gives its image processor no
    settings of its own (Aria's call defaults to 980-pixel crops where its image processor
    alone uses 490: 16 image tokens against 8), and the tokenizer adds no special tokens of
    its own (the processor encodes with them, the direct path without)."""
    import sys

    mixin = getattr(sys.modules.get("transformers.processing_utils"), "ProcessorMixin", None)
    cls = type(processor)
    kwargs = getattr(getattr(processor, "valid_processor_kwargs", None), "_defaults", None)
    if isinstance(kwargs, Mapping) and kwargs.get("images_kwargs"):
        return False
    if (mixin is None or not isinstance(processor, mixin) or cls.__call__ is not mixin.__call__
            or getattr(cls, "replace_image_token", None)
            in (None, getattr(mixin, "replace_image_token", None))
            or not isinstance(getattr(processor, "image_token", None), str)
            or getattr(processor, "image_processor", None) is None):
        return False
    tokenizer = processor.tokenizer
    try:
        return list(tokenizer("x")["input_ids"]) == list(tokenizer("x", add_special_tokens=False)
                                                         ["input_ids"])
    except Exception:  # a tokenizer that cannot say: the processor's own call
        return False


def _load(source: Any, limits: ImageLimits, spot: str) -> LoadedImage:
    from pipeline.multimodal._images import load_image

    return load_image(source, limits=limits, field=spot)
