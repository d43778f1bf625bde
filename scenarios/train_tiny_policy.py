"""python -m scenarios.train_tiny_policy [--out DIR] [--seed S] [--steps N] [--threads T]

Train the tiny policy that ``rollout run arith`` uses: a tiny Qwen2 model that really calls the
calculator, right about half of the time.

Recipe, top to bottom:

1. Data: seeded synthetic conversations of the arithmetic scenario (:mod:`scenarios.arith_tools`)
   rendered with the project's own chat template and tokenizer (the tiny model's, built by
   :func:`pipeline.models.tiny.build_tiny_model`): question -> ``<tool_call>`` with the
   calculator expression -> the tool's result -> ``Answer: <number>``. Problems are drawn from
   a string seed (``"train:<seed>"``), a stream disjoint from the integer seeds that
   ``arith_tools.rows`` and the held-out set use.
2. Deliberate imperfection, so RL has room to improve the policy: a seeded share of the
   conversations answers without the tool (a guess), calls it with a wrong expression (a digit
   changed, an operator swapped, numbers exchanged), or misreports the tool's result. Sampled
   at temperature 1 the model reproduces these habits, plus its own copying errors.
3. Train a freshly initialised ``Qwen2ForCausalLM`` of the tiny model's shape with plain torch
   (AdamW, warm-up then cosine decay), loss on the assistant tokens only, on CPU.
4. Save weights (safetensors), tokenizer and chat template into ``DIR`` (default: the package
   data folder ``pipeline/models/tiny_policy``), with ``training.json`` (the recipe, the loss
   curve, the training time and the held-out figures).
5. Measure on held-out problems with the real pipeline (``BuildPrompt -> Loop([Generate,
   CallTools]) -> numeric reward``) on :class:`TransformersEngine` at temperature 1.

Reproducibility: the same seed, steps and thread count give the same data, initial weights and
batch order, and torch's CPU kernels are deterministic for one thread count, so a CPU rerun
follows the shipped run closely (on two different CPUs with torch 2.11 and 2.13 the losses
agreed to 4 decimals over the first 50 steps). The tolerance we claim for a rerun with the same
seed: held-out solve rate in 30-60% and tool-call rate >= 85% (shipped: 34% and 91% on
TransformersEngine). Float rounding can move a run along its learning curve: with
``--device cuda`` the same seed gave 46% and 91%.

Time: 2,000 steps of 32 conversations take about 6 minutes on two idle CPU cores (0.16 s a
step); the shared system prompt is run once per batch, not per conversation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scenarios import arith_tools

HELDOUT_SEED = 20_231
"""Seed of the held-out problems (``arith_tools.rows(count, HELDOUT_SEED)``)."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Everything that decides the trained weights. Defaults ship as the tiny policy."""

    seed: int = 0
    steps: int = 2000
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.01
    p_no_tool: float = 0.08
    p_bad_expression: float = 0.25
    p_bad_answer: float = 0.20
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2


# ---------------------------------------------------------------- data


def _change_digit(number: int, rng: random.Random) -> int:
    digits = list(str(abs(number)))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0"
                                                                 and len(digits) > 1)]
    digits[i] = rng.choice(choices)
    return int("".join(digits)) * (-1 if number < 0 else 1)


def _bad_expression(expression: str, answer: int, rng: random.Random) -> str:
    """A plausible wrong expression: one digit changed, an operator swapped, or two numbers
    exchanged; never one that still gives ``answer`` or that the calculator rejects."""
    from pipeline.tools import CalculatorError, evaluate_arithmetic

    tokens = expression.split(" ")
    for _ in range(20):
        out = list(tokens)
        how = rng.randrange(3)
        numbers = [i for i, t in enumerate(out) if t.isdigit()]
        ops = [i for i, t in enumerate(out) if not t.isdigit()]
        if how == 0:
            i = rng.choice(numbers)
            out[i] = str(_change_digit(int(out[i]), rng))
        elif how == 1:
            i = rng.choice(ops)
            out[i] = rng.choice([o for o in "+-*" if o != out[i]])
        else:
            i, j = rng.sample(numbers, 2)
            out[i], out[j] = out[j], out[i]
        candidate = " ".join(out)
        try:
            if evaluate_arithmetic(candidate) != answer:
                return candidate
        except CalculatorError:
            continue
    return f"{expression} + 1"


def tool_text(value: float) -> str:
    """The calculator tool's reply for ``value`` (ints plainly, floats to 10 digits)."""
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def conversation(problem: arith_tools.Problem, recipe: Recipe,
                 rng: random.Random) -> list[dict[str, Any]]:
    """The messages of one training conversation after the system and user turns."""
    from pipeline.tools import evaluate_arithmetic

    if rng.random() < recipe.p_no_tool:  # answers from memory: a guess
        numbers = [int(n) for n in arith_tools._NUMBER.findall(problem.question)]
        guess = sum(numbers) if rng.random() < 0.5 else _change_digit(problem.answer, rng)
        return [{"role": "assistant", "content": f"Answer: {guess}"}]
    expression = problem.expression
    if rng.random() < recipe.p_bad_expression:
        expression = _bad_expression(expression, problem.answer, rng)
    result = tool_text(evaluate_arithmetic(expression))
    answer = result
    if rng.random() < recipe.p_bad_answer:
        value = float(result)
        answer = (str(_change_digit(int(value), rng)) if value.is_integer()
                  else tool_text(round(value)))
    arguments = json.dumps({"expression": expression})
    return [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": f"Answer: {answer}"},
    ]


_ASSISTANT = "<|im_start|>assistant\n"
_END = "<|im_end|>"


def encode(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
           start: int = 0) -> tuple[list[int], list[int]]:
    """Token ids of a conversation rendered by the chat template, from character ``start`` on,
    and a loss mask: 1 on assistant tokens (their text and the closing ``<|im_end|>``), 0 on
    the prompt, template and tool tokens.

    ``start`` must fall on a token boundary (after a control token's line, e.g. the end of
    ``<|im_start|>user\n``); the shared prefix is then encoded once, not per conversation.
    """
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)[start:]
    spans = []
    at = text.find(_ASSISTANT)
    while at >= 0:
        head = at + len(_ASSISTANT)
        end = text.find(_END, head)
        if end < 0:
            break
        spans.append((head, end + len(_END)))
        at = text.find(_ASSISTANT, end)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = encoded["input_ids"]
    mask = [int(any(lo <= a and b <= hi for lo, hi in spans))
            for a, b in encoded["offset_mapping"]]
    return ids, mask


def shared_prefix(tokenizer: Any) -> tuple[str, list[int]]:
    """The text every conversation starts with (system turn, tools, ``<|im_start|>user\n``)
    and its ids."""
    row = arith_tools.rows(1)[0]
    text = tokenizer.apply_chat_template(
        [row["messages"][0], {"role": "user", "content": ""}], tools=row["tools"],
        tokenize=False)
    text = text[:text.rindex("<|im_start|>user\n") + len("<|im_start|>user\n")]
    return text, tokenizer.encode(text, add_special_tokens=False)


def training_examples(tokenizer: Any, count: int,
                      recipe: Recipe) -> list[tuple[list[int], list[int]]]:
    """``count`` encoded conversations drawn from the ``"train:<seed>"`` stream, each without
    the :func:`shared_prefix` (which is the same for all)."""
    rng = random.Random(f"train:{recipe.seed}")
    tools = arith_tools.rows(1)[0]["tools"]
    prefix, prefix_ids = shared_prefix(tokenizer)
    out = []
    for i in range(count):
        problem = arith_tools.draw_problem(rng)
        messages = [{"role": "system", "content": arith_tools.SYSTEM_PROMPT},
                    {"role": "user", "content": problem.question},
                    *conversation(problem, recipe, rng)]
        ids, mask = encode(tokenizer, messages, tools, start=len(prefix))
        if i < 8:  # the split encodes exactly like the whole conversation
            whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
            assert whole.startswith(prefix)
            assert prefix_ids + ids == tokenizer.encode(whole, add_special_tokens=False)
        out.append((ids, mask))
    return out


def training_questions(count: int, seed: int = 0) -> set[str]:
    """The questions of the first ``count`` training conversations (to check overlap)."""
    rng = random.Random(f"train:{seed}")
    recipe = Recipe(seed=seed)
    out = set()
    for _ in range(count):
        problem = arith_tools.draw_problem(rng)
        out.add(problem.question)
        conversation(problem, recipe, rng)  # keep the stream aligned with training
    return out


# ---------------------------------------------------------------- training


def train(out: Path, recipe: Recipe, *, threads: int = 2, device: str = "cpu",
          log_every: int = 25) -> dict[str, Any]:
    """Train and save the policy into ``out``; returns what ``training.json`` records.

    ``device="cuda"`` trains faster on a GPU (for trying recipes); the shipped weights come
    from a CPU run (see the module docstring for the tolerance)."""
    import torch
    import transformers

    from pipeline.models.tiny import TinyModelSpec, build_tiny_model

    torch.set_num_threads(threads)
    torch.manual_seed(recipe.seed)
    spec = TinyModelSpec()
    with tempfile.TemporaryDirectory() as scratch:  # the project's tokenizer and template
        built = build_tiny_model(Path(scratch) / "tiny", spec)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(built))
    started = time.perf_counter()
    examples = training_examples(tokenizer, recipe.steps * recipe.batch_size, recipe)
    data_s = time.perf_counter() - started
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, dtype="float32")
    model = transformers.Qwen2ForCausalLM(config).to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=recipe.lr, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        done = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    prefix = torch.tensor([shared_prefix(tokenizer)[1]], device=device)
    losses: list[float] = []
    model.train()
    for step in range(recipe.steps):
        batch = examples[step * recipe.batch_size:(step + 1) * recipe.batch_size]
        rows, width = len(batch), max(len(ids) for ids, _ in batch)
        input_ids = torch.full((rows, width), pad, dtype=torch.long)
        attention = torch.zeros((rows, prefix.shape[1] + width), dtype=torch.long)
        attention[:, :prefix.shape[1]] = 1
        labels = torch.full((rows, width), -100, dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, prefix.shape[1]:prefix.shape[1] + len(ids)] = 1
            labels[row, :len(ids)] = torch.tensor(
                [t if m else -100 for t, m in zip(ids, mask, strict=True)])
        # the shared system prompt runs once per step, its keys and values are repeated for
        # the batch (gradients flow back through them): about 4x less work than per example
        cache = model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(rows)
        positions = torch.arange(prefix.shape[1], prefix.shape[1] + width,
                                 device=device).expand(rows, -1)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                     position_ids=positions, past_key_values=cache, use_cache=False,
                     labels=labels.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % log_every == 0 or step == 0:
            print(f"step {step + 1:4d}/{recipe.steps}  loss {loss.item():.4f}  "
                  f"{time.perf_counter() - started:6.1f}s", flush=True)
    train_s = time.perf_counter() - started
    model = model.to("cpu").eval()
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    info = {"recipe": asdict(recipe), "threads": threads, "torch": torch.__version__,
            "data_s": round(data_s, 1), "train_s": round(train_s, 1),
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss_first": round(losses[0], 4),
            "loss_last_25_mean": round(sum(losses[-25:]) / len(losses[-25:]), 4)}
    return info


# ---------------------------------------------------------------- evaluation


async def evaluate(engine: Any, tokenizer: Any, *, count: int = 256, seed: int = HELDOUT_SEED,
                   sampling_seed: int = 0) -> dict[str, Any]:
    """Run the real arithmetic pipeline on ``count`` held-out problems (one rollout each, the
    main job's sampling: temperature 1, 96 tokens a turn, 512 a trajectory) and summarise."""
    from pipeline import Pipeline
    from pipeline.tools import CalculatorError, evaluate_arithmetic

    pipeline = Pipeline(arith_tools.stages(), engine=engine, tokenizer=tokenizer,
                        tools=arith_tools.tools(), max_concurrency=256,
                        config={"seed": sampling_seed, "sample_timeout_s": 600,
                                "sampling": {"max_tokens": 96, "max_response_tokens": 512}})
    started = time.perf_counter()
    result = await pipeline.run_batch(arith_tools.rows(count, seed), n=1)
    wall_s = time.perf_counter() - started
    solved = with_tool = called = right_expression = tool_errors = 0
    per_sample = []
    for sample, item in zip(result.samples, result.items, strict=True):
        per_sample.append(sample.reward == 1.0)
        calls = sample.extra_fields.get("tool_calls", 0) or 0
        errors = sample.extra_fields.get("tool_errors", 0) or 0
        called += calls > 0
        tool_errors += errors > 0
        solved += sample.reward == 1.0
        with_tool += sample.reward == 1.0 and calls > 0 and errors == 0
        first = next((m for m in item.artifacts.get("messages", ())
                      if m.role == "assistant" and m.tool_calls), None)
        if first is not None:
            try:
                expression = json.loads(first.tool_calls[0].function.arguments)["expression"]
                value = evaluate_arithmetic(expression)
            except (ValueError, KeyError, TypeError, CalculatorError):
                continue
            right_expression += value == float(item.data.ground_truth)
    n = len(result.samples)
    return {"problems": n, "solve_rate": solved / n, "solve_rate_with_tool": with_tool / n,
            "tool_call_rate": called / n, "tool_error_rate": tool_errors / n,
            "right_expression_rate": right_expression / n,
            "by_status": dict(result.stats.by_status), "wall_s": round(wall_s, 2),
            "solved": per_sample}


async def evaluate_dir(model_dir: Path, engine_name: str = "transformers", *,
                       count: int = 256, seed: int = HELDOUT_SEED) -> dict[str, Any]:
    """:func:`evaluate` on an engine the factory builds (``transformers`` or ``vllm``)."""
    from pipeline.engines import make_engine

    started = time.perf_counter()
    engine, tokenizer = await make_engine(engine_name, model_dir=model_dir, notify=lambda _: None)
    init_s = time.perf_counter() - started
    try:
        figures = await evaluate(engine, tokenizer, count=count, seed=seed)
    finally:
        await engine.aclose()
    return {"engine": engine_name, "engine_init_s": round(init_s, 1), **figures}


def default_out() -> Path:
    """The package-data folder the shipped policy lives in."""
    import pipeline.models

    return Path(pipeline.models.__file__).resolve().parent / "tiny_policy"


def main(argv: list[str] | None = None) -> None:
    """Train, save, then measure on the held-out set with the transformers engine."""
    parser = argparse.ArgumentParser(prog="python -m scenarios.train_tiny_policy")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: the package's tiny_policy folder)")
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--eval", type=int, default=256, help="held-out problems (0: skip)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override another Recipe field (for trying recipes)")
    args = parser.parse_args(argv)
    out: Path = args.out or default_out()
    fields = {"seed": args.seed, "steps": args.steps}
    for item in args.set:
        key, _, value = item.partition("=")
        fields[key] = type(getattr(Recipe(), key))(value)
    recipe = Recipe(**fields)
    info = train(out, recipe, threads=args.threads, device=args.device)
    print(f"trained in {info['train_s']:.1f}s ({info['parameters']} parameters) -> {out}")
    if args.eval:
        figures = asyncio.run(evaluate_dir(out, count=args.eval))
        figures.pop("solved")
        info["heldout_transformers"] = figures
        print(json.dumps(info["heldout_transformers"], indent=1))
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
