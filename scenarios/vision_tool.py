"""python -m scenarios.vision_tool [--engine simulated|transformers] [--count N] [--n K]

Look at the image, call a tool, answer: a vision-language agent loop on synthetic images.

Each row's image is a grey canvas with one coloured square somewhere on it. The agent sees
the image in its prompt, calls ``crop`` with a box (the tool returns that part of the image,
which the next turn sees as image tokens), then answers ``Answer: <colour>``; the reward is 1
when the colour is the square's. The stage list is ``BuildPrompt(processor) ->
Loop([Generate, CallTools]) -> colour_reward``.

The model is the tiny random-weight Qwen2.5-VL (:func:`pipeline.multimodal.ensure_tiny_vl_model`,
built locally), with trl's Qwen3-VL chat template (it renders tools and images in tool
results; Qwen2.5-VL's own renders no tools). ``--engine transformers`` runs it: random
weights write no tool call, so that shows the machinery (image tokens in, model tokens out),
not skill. ``--engine simulated`` (default) runs a scripted agent (:func:`responder`) that
crops the image's centre and names a colour: the tool's image goes through the processor and
the token accounting exactly as a real model's call would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
from typing import Any

from PIL import Image

from pipeline import AgentRolloutItem, BuildPrompt, CallTools, Context, Generate, Loop, Pipeline
from pipeline import artifacts as A
from pipeline.multimodal import ensure_tiny_vl_model, tiny_vl_processor
from pipeline.tools import ResourceTool, tool_schema

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}
CANVAS = (224, 224)
SQUARE = 56
SYSTEM_PROMPT = ("Find the coloured square in the image. Call crop with a box to look closer, "
                 "then reply with one line: Answer: <red|green|blue>.")


def draw(colour: str, seed: int) -> Image.Image:
    """A grey canvas with one ``colour`` square at a place drawn from ``seed``."""
    rng = random.Random(seed)
    image = Image.new("RGB", CANVAS, (128, 128, 128))
    x, y = rng.randrange(CANVAS[0] - SQUARE), rng.randrange(CANVAS[1] - SQUARE)
    image.paste(Image.new("RGB", (SQUARE, SQUARE), COLOURS[colour]), (x, y))
    return image


def rows(count: int = 6, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` rows: a PIL image in the user turn, the crop tool's schema, the colour."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        colour = rng.choice(sorted(COLOURS))
        out.append({
            "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                         {"role": "user", "content": [
                             {"type": "image", "image": draw(colour, seed * 1000 + i)},
                             {"type": "text", "text": "Which colour is the square?"}]}],
            "tools": [tool_schema(crop_tool())], "ground_truth": colour})
    return out


def crop_tool() -> ResourceTool:
    """``crop(box=[x0, y0, x1, y1])``: that part of the sample's image, twice enlarged (the
    sample's image is the tool's per-trajectory resource)."""

    async def image_of(item: AgentRolloutItem) -> Any:
        return item.data.messages[1]["content"][0]["image"]

    async def crop(image: Any, box: list[int]) -> Any:
        x0, y0, x1, y1 = (int(v) for v in box)
        if not (0 <= x0 < x1 <= CANVAS[0] and 0 <= y0 < y1 <= CANVAS[1]):
            return f"Error: the box must lie inside the {CANVAS[0]}x{CANVAS[1]} image"
        part = image.crop((x0, y0, x1, y1)).resize((2 * (x1 - x0), 2 * (y1 - y0)))
        return [part, {"type": "text", "text": f"crop {x0},{y0},{x1},{y1} (x2)"}]

    return ResourceTool(name="crop", description="Crop the image to a box and enlarge it.",
                        create=image_of, call=crop, parameters={
                            "type": "object", "required": ["box"], "properties": {"box": {
                                "type": "array", "items": {"type": "integer"},
                                "minItems": 4, "maxItems": 4}}})


def responder(tokenizer: Any, seed: int = 0) -> Any:
    """A scripted agent for the simulated engine: crop the centre, then name a colour
    (drawn, so about a third are right)."""
    rng = random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    call = ('<tool_call>\n{"name": "crop", "arguments": {"box": [56, 56, 168, 168]}}'
            "\n</tool_call>")

    def reply(prompt_ids: list[int], _: random.Random) -> list[int]:
        text = tokenizer.decode(prompt_ids)
        said = call if "<tool_response>" not in text else \
            f"Answer: {rng.choice(sorted(COLOURS))}"
        return [*tokenizer.encode(said, add_special_tokens=False), end]

    return reply


async def colour_reward(item: AgentRolloutItem, ctx: Context) -> None:
    """1.0 when the last answer names the square's colour, else 0.0."""
    messages = item.artifacts.get(A.MESSAGES) or []
    last = next((m for m in reversed(messages) if m.role == "assistant"), None)
    found = re.search(r"Answer:\s*(\w+)", str(last.content or "")) if last else None
    right = found is not None and found.group(1).lower() == item.data.ground_truth
    item.artifacts[A.REWARD] = 1.0 if right else 0.0


def make_engine(engine: str, model_dir: Any, tokenizer: Any, seed: int) -> Any:
    """The tiny model on the transformers engine, or the scripted agent (simulated)."""
    if engine == "transformers":
        from pipeline.engines.transformers import TransformersEngine

        return TransformersEngine.from_pretrained(model_dir)
    from pipeline.testing import SimulatedEngine

    return SimulatedEngine(responder=responder(tokenizer, seed), latency_s=0.0)


async def run(engine: str = "simulated", count: int = 6, n: int = 2, seed: int = 0,
              max_turns: int = 3) -> Any:
    """One batch of ``count`` rows x ``n`` samples."""
    model_dir = ensure_tiny_vl_model()
    processor = tiny_vl_processor(model_dir, template="qwen3_vl")
    tokenizer = processor.tokenizer
    made = make_engine(engine, model_dir, tokenizer, seed)
    rollout = Pipeline([BuildPrompt(processor=processor),
                        Loop([Generate(), CallTools()], max_turns=max_turns), colour_reward],
                       engine=made, tokenizer=tokenizer, tools=[crop_tool()],
                       sampling={"max_tokens": 48, "temperature": 1.0, "seed": seed})
    try:
        return await rollout.run_batch(rows(count, seed), n=n)
    finally:
        await made.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    parser.add_argument("--engine", choices=("simulated", "transformers"), default="simulated")
    parser.add_argument("--count", type=int, default=6)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = asyncio.run(run(args.engine, args.count, args.n, args.seed))
    image_pad = 151655
    for item, sample in zip(result.items, result.samples, strict=True):
        images = sample.multi_modal_inputs.summary() if sample.multi_modal_inputs else []
        print(json.dumps({
            "uid": sample.uid, "status": sample.status.value, "reward": sample.reward,
            "tool_turns": sample.tool_turns, "images": [(i["width"], i["height"], i["tokens"])
                                                         for i in images],
            "prompt_image_tokens": sample.prompt_ids.count(image_pad),
            "response_image_tokens_mask0": sum(
                1 for t, m in zip(sample.response_ids, sample.response_mask, strict=True)
                if t == image_pad and m == 0),
            "error": item.error}))
    print(json.dumps({"stats": {"by_status": result.stats.by_status,
                                "mean_reward": sum(s.reward or 0.0 for s in result.samples)
                                / max(1, len(result.samples))}}))


if __name__ == "__main__":
    main()
