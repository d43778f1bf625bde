"""Image parts of chat messages: reading them, loading and checking the image, and the
reference a message keeps instead of the bytes.

The forms accepted in a message's ``content`` list:

- OpenAI's ``{"type": "image_url", "image_url": {"url": URL}}`` (or ``"image_url": URL``),
  where URL is a ``data:image/...;base64,`` URL, a ``file://`` URL or a file path;
- Hugging Face's ``{"type": "image", "image": X}`` with X a ``PIL.Image.Image``, a data URL
  or a file path.

Web URLs are refused: the pipeline fetches nothing. A loaded image is decoded fully (a
truncated file fails here, not inside the engine), converted to RGB, and checked against
:class:`ImageLimits`. Messages then hold :func:`image_ref` parts (``sha256``, ``width``,
``height``), which is what dumps and the proxy's records show: never the bytes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline._exceptions import PipelineError

IMAGE_TYPES = frozenset({"image", "image_url"})
"""Content-part types that carry an image."""


class ImageError(PipelineError, ValueError):
    """An image part that cannot be used: not an image, truncated, too large, an unsupported
    source. Ends its sample (``status=failed``), never the batch.

    Attributes:
        field: where the part is (``"messages.0.content.1"``, ``"tool.calls.0"``).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """Bounds checked before an image is decoded.

    Attributes:
        max_bytes: largest encoded image (a data URL's payload or a file), default 20 MiB.
        max_pixels: largest ``width * height`` before the processor resizes it (default
            about 36 megapixels: a 6000x6000 photo); PIL's own decompression-bomb bound is
            twice its ``MAX_IMAGE_PIXELS`` (179 megapixels) and would let far more through.
        allow_files: whether file paths (and ``file://`` URLs) may be read. Rows from a
            dataset are trusted; the proxy passes False for what an agent sends.
    """

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 6000 * 6000
    allow_files: bool = True


@dataclass(frozen=True, slots=True)
class LoadedImage:
    """A decoded RGB image and the facts a record keeps about it.

    Attributes:
        image: the ``PIL.Image.Image`` (mode ``RGB``).
        sha256: hex digest of the encoded bytes, or of the pixels for an in-memory image.
        width: pixels.
        height: pixels.
    """

    image: Any
    sha256: str
    width: int
    height: int

    def ref(self) -> dict[str, Any]:
        """The part a message keeps in place of the image: see :func:`image_ref`."""
        return image_ref(self)


def image_ref(image: LoadedImage) -> dict[str, Any]:
    """``{"type": "image", "sha256": ..., "width": ..., "height": ...}``: what messages,
    dumps and the proxy keep of an image (the chat template renders it as the image's
    placeholder, like the image itself)."""
    return {"type": "image", "sha256": image.sha256, "width": image.width,
            "height": image.height}


def is_image_part(part: Any) -> bool:
    """Whether a content part carries an image (or an image reference)."""
    return isinstance(part, Mapping) and (part.get("type") in IMAGE_TYPES
                                          or "image_url" in part or "image" in part)


def iter_image_parts(content: Any) -> Iterator[tuple[int, Mapping[str, Any]]]:
    """``(index, part)`` of each image part in a message's content (none for a string)."""
    if isinstance(content, list):
        for index, part in enumerate(content):
            if is_image_part(part):
                yield index, part


def has_images(messages: Sequence[Any]) -> bool:
    """Whether any message (a dict or an ``AgentMessage``) has an image part."""
    for message in messages:
        content = (message.get("content") if isinstance(message, Mapping)
                   else getattr(message, "content", None))
        if next(iter_image_parts(content), None) is not None:
            return True
    return False


def part_source(part: Mapping[str, Any]) -> Any:
    """The image source a part names: a PIL image, a data URL, a path; None for a reference
    (:func:`image_ref`) that carries no image."""
    if "image_url" in part:
        url = part["image_url"]
        return url.get("url") if isinstance(url, Mapping) else url
    return part.get("image")


def load_image(source: Any, *, limits: ImageLimits | None = None,
               field: str | None = None) -> LoadedImage:
    """Decode and check one image.

    Args:
        source: a ``PIL.Image.Image``, bytes, a ``data:`` URL, a ``file://`` URL or a path.
        limits: size bounds and whether files may be read.
        field: where the part is, for the error message.

    Raises:
        ImageError: not an image, truncated, over a limit, or a source that is refused
            (a web URL; a file when ``limits.allow_files`` is False).
    """
    from PIL import Image

    limits = limits or ImageLimits()
    if isinstance(source, Image.Image):
        return _checked(source, None, limits, field)
    if isinstance(source, bytes | bytearray):
        return _decode(bytes(source), limits, field)
    if not isinstance(source, str) or not source:
        raise ImageError(f"an image part needs a data URL, a file path or a PIL image, got "
                         f"{type(source).__name__}", field=field)
    if source.startswith("data:"):
        return _decode(_data_url_bytes(source, limits, field), limits, field)
    if source.startswith(("http://", "https://")):
        raise ImageError("web image URLs are not fetched; send the image as a data URL",
                         field=field)
    if not limits.allow_files:
        raise ImageError("file paths are not read here; send the image as a data URL",
                         field=field)
    path = Path(source.removeprefix("file://"))
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise ImageError(f"the image file is {size} bytes, over the limit of "
                             f"{limits.max_bytes}", field=field)
        data = path.read_bytes()
    except OSError as exc:
        raise ImageError(f"cannot read image file {str(path)!r}: {exc.strerror or exc}",
                         field=field) from None
    return _decode(data, limits, field)


def _data_url_bytes(url: str, limits: ImageLimits, field: str | None) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header.startswith("data:image/"):
        raise ImageError(f"a data URL must be data:image/<format>;base64,<payload>, got "
                         f"{header[:40]!r}", field=field)
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageError(f"the image is about {len(payload) * 3 // 4} bytes, over the limit "
                         f"of {limits.max_bytes}", field=field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's payload is not valid base64", field=field) from None


def _decode(data: bytes, limits: ImageLimits, field: str | None) -> LoadedImage:
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes, over the limit of "
                         f"{limits.max_bytes}", field=field)
    try:
        with warnings.catch_warnings():  # ImageLimits.max_pixels decides, below PIL's bound
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"not an image (PIL cannot identify {len(data)} bytes starting "
                         f"{data[:8]!r})", field=field) from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageError(f"cannot open the image: {exc}", field=field) from None
    return _checked(image, hashlib.sha256(data).hexdigest(), limits, field)


def _checked(image: Any, digest: str | None, limits: ImageLimits,
             field: str | None) -> LoadedImage:
    from PIL import Image

    width, height = image.size
    if width < 1 or height < 1 or width * height > limits.max_pixels:
        raise ImageError(f"the image is {width}x{height} pixels, over the limit of "
                         f"{limits.max_pixels} pixels", field=field)
    try:
        image.load()  # decode now: a truncated file fails here, for this sample only
        rgb = image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image cannot be decoded ({exc})", field=field) from None
    if digest is None:
        digest = hashlib.sha256(rgb.tobytes()).hexdigest()
        digest = hashlib.sha256(f"{width}x{height}:{digest}".encode()).hexdigest()
    return LoadedImage(rgb, digest, width, height)


def without_image_bytes(message: Mapping[str, Any]) -> dict[str, Any]:
    """``message`` with each image part that carries an image replaced by a description of
    it without its bytes (records of samples whose images were never rendered: a data URL's
    size, a path, a PIL image's size); references (:func:`image_ref`) stay as they are."""
    content = message.get("content")
    parts = list(iter_image_parts(content))
    if not parts:
        return dict(message)
    described = list(content or ())
    for index, part in parts:
        source = part_source(part)
        if source is None:
            continue
        if isinstance(source, str) and source.startswith("data:"):
            described[index] = {"type": "image", "data_url_chars": len(source)}
        elif isinstance(source, str):
            described[index] = {"type": "image", "path": source}
        else:
            size = getattr(source, "size", None)
            described[index] = {"type": "image", "size": list(size) if size else None}
    return {**message, "content": described}
