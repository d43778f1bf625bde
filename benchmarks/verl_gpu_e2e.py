"""verl 0.9.1's own PPO trainer (``verl.trainer.main_ppo``) end to end on one GPU: our
``PipelineAgentLoop`` against verl's ``ToolAgentLoop``, same data, model and config.

Run on the GPU machine, after the parts of ``scripts/gpu/prepare_verl.sh`` are installed
(``docs/vllm_gpu.md``, "verl's trainer end to end")::

    python benchmarks/verl_gpu_e2e.py prepare --out /tmp/e2e --tokenizer TOKENIZER_DIR
    python benchmarks/verl_gpu_e2e.py train --work /tmp/e2e --loop pipeline   # ~4 min
    python benchmarks/verl_gpu_e2e.py train --work /tmp/e2e --loop verl
    python benchmarks/verl_gpu_e2e.py report --work /tmp/e2e                  # JSON result

``prepare`` writes the arith tool task (``scenarios/arith_tools.rows``) as verl's parquet
(``prompt`` messages, ``reward_model.ground_truth``), the agent-loop YAML naming our entry,
and a model folder: Qwen2.5-0.5B's shape with seeded random bf16 weights and the tokenizer
folder given (the Qwen2.5 family tokenizer: the real vocabulary), built on the GPU.

``train`` runs ``python -m verl.trainer.main_ppo`` with the same overrides for both loops
(rollout ``vllm`` in ``async`` mode, ``grpo_masked``, the calculator tool, verl's reward loop
with one reward function, ``trainer.total_training_steps``, console logger) except
``rollout.agent.default_agent_loop``: ``arith_pipeline`` (our entry) or ``tool_agent``
(verl's). Its log goes to ``WORK/<loop>.log``; the console logger's per-step lines are parsed
from it.

``report`` takes verl's own per-step timings (``timing_s/gen``, ``reward``, ``old_log_prob``,
``adv``, ``update_actor``, ``update_weights``, ``step``) and the generated tokens of each step
(``response_length/mean`` x samples), and compares the generate phase per generated token,
median over steps 2..N (step 1 warms up). One JSON file: ``benchmarks/results/verl_gpu_e2e.json``.
verl's V1 trainer measures ``gen`` around a replay-buffer wait that polls every 2 s, so each
step's figure is quantised to the poll; ``train --poll-s`` (default 0.05) makes verl's replay
buffer poll that often in both runs (``gen_timer_resolution_s``); with a reward loop
worker (the default) the reward is computed inside the rollout and there is no
``timing_s/reward``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import write_result

ROOT = Path(__file__).resolve().parents[1]
AGENTS = ROOT / "scripts" / "gpu"

QWEN_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
            "max_position_embeddings": 32768, "tie_word_embeddings": True,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
"""Qwen2.5-0.5B's shape (494M parameters), as ``engine_efficiency.CONFIGS["qwen2-0.5b"]``."""

LOOPS = {"pipeline": "arith_pipeline", "verl": "tool_agent"}
"""``--loop`` -> the agent loop verl's workers run (``default_agent_loop``)."""

VERL_POLL_S = 2.0
"""verl 0.9.1's ``ReplayBuffer.poll_interval``: the resolution of ``timing_s/gen`` on V1
unless ``train --poll-s`` sets another."""

TIMINGS = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights", "step")


def agents_yaml(max_turns: int, response_length: int) -> str:
    """Our entry: the arith tool loop; verl's reward loop scores (as for ``tool_agent``)."""
    return (f"- name: {LOOPS['pipeline']}\n"
            "  _target_: pipeline.integrations.verl.PipelineAgentLoop\n"
            "  factory: verl_e2e_agents.arith_tool_agent\n"
            f"  factory_kwargs: {{max_turns: {max_turns}}}\n"
            f"  sampling: {{max_tokens: {response_length}}}\n"
            "  judges: false\n")


def prepare(args: argparse.Namespace) -> None:
    import pandas as pd

    sys.path.insert(0, str(ROOT))
    from scenarios.arith_tools import DATA_SOURCE, rows

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = [{"data_source": DATA_SOURCE, "prompt": row["messages"], "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
                "extra_info": {"index": i}}
               for i, row in enumerate(rows(args.prompts, seed=args.seed))]
    pd.DataFrame(records).to_parquet(out / "train.parquet")
    (out / "agents.yaml").write_text(agents_yaml(args.max_turns, args.response_length))
    if args.tokenizer:
        build_model(Path(args.tokenizer), out / "model")
    print(f"prepared {len(records)} prompts in {out}")


def build_model(tokenizer_dir: Path, target: Path) -> None:
    """Qwen2.5-0.5B's shape, seeded N(0, 0.02) bf16 weights, the given tokenizer."""
    if (target / "model.safetensors").exists():
        return
    import torch
    import transformers as hf

    tokenizer = hf.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = hf.Qwen2Config(**QWEN_05B, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                            torch_dtype="bfloat16")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = hf.Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    hf.GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id).save_pretrained(target)


def overrides(args: argparse.Namespace) -> list[str]:
    """Hydra overrides of ``verl.trainer.main_ppo``: the same for both loops but the loop."""
    work = Path(args.work)
    batch, n = args.batch, args.n
    return [
        "algorithm.adv_estimator=grpo_masked",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={work / 'train.parquet'}",
        f"data.val_files={work / 'train.parquet'}",
        f"data.train_batch_size={batch}",
        f"data.max_prompt_length={args.prompt_length}",
        f"data.max_response_length={args.response_length}",
        "data.return_raw_chat=True",
        "data.filter_overlong_prompts=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={work / 'model'}",
        # No flash-attn package on the GPU image: PyTorch's SDPA in the trainer, no unpadding
        # (verl defaults to flash_attention_2 and remove-padding; vLLM has its own kernels).
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.agent.num_workers={args.agent_workers}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={work / 'agents.yaml'}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={LOOPS[args.loop]}",
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={args.max_turns}",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path="
        f"{AGENTS / 'verl_calculator_tool.py'}",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"reward.custom_reward_function.path={AGENTS / 'verl_e2e_agents.py'}",
        "reward.custom_reward_function.name=compute_score",
        "+ray_kwargs.ray_init.include_dashboard=False",  # its web page is not carried
        "trainer.logger=[console]",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.project_name=pipeline_verl_e2e",
        f"trainer.experiment_name={args.loop}",
        f"trainer.default_local_dir={work / 'ckpt' / args.loop}",
        *args.extra,
    ]


def train(args: argparse.Namespace) -> None:
    work = Path(args.work)
    env = dict(os.environ)
    # verl's worker processes import our entry's factory and the estimator hook by name.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(AGENTS), str(ROOT), env.get("PYTHONPATH")) if p)
    env["VERL_USE_EXTERNAL_MODULES"] = "verl_e2e_agents"  # grpo_masked in every verl process
    env["VERL_E2E_POLL_S"] = str(args.poll_s)  # the gen timer's resolution (verl_e2e_agents)
    env.setdefault("HF_HUB_OFFLINE", "1")
    command = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(args)]
    log = work / f"{args.loop}.log"
    (work / f"{args.loop}.command.json").write_text(json.dumps(command, indent=1))
    start = time.monotonic()
    with log.open("w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  cwd=ROOT, timeout=args.timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:  # the steps logged so far are still kept
            code = 124
            print(f"{args.loop}: stopped at --timeout-s {args.timeout_s:.0f} s")
    wall = time.monotonic() - start
    steps = parse_steps(log.read_text(errors="replace"))
    (work / f"{args.loop}.steps.json").write_text(json.dumps(
        {"returncode": code, "wall_s": wall, "poll_s": args.poll_s, "steps": steps}, indent=1))
    print(f"{args.loop}: exit {code} after {wall:.0f} s, {len(steps)} steps logged")
    for step in steps:
        print("  step", step.get("step"), {k: round(step[f"timing_s/{k}"], 2)
                                           for k in TIMINGS if f"timing_s/{k}" in step})
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-60:]
        print("\n".join(tail))
        sys.exit(code)


_STEP_LINE = re.compile(r"step:(\d+) - (.*)")
_NUMBER = re.compile(r"^(?:np\.\w+\()?([-+]?(?:[0-9.]+(?:[eE][-+]?\d+)?|nan|inf))\)?$")


def parse_steps(text: str) -> list[dict[str, float]]:
    """verl's console logger lines (``step:N - key:value - key:value ...``), one per step."""
    steps = []
    for line in text.splitlines():
        found = _STEP_LINE.search(line)
        if not found:
            continue
        record: dict[str, float] = {"step": int(found.group(1))}
        for part in found.group(2).split(" - "):
            key, sep, value = part.rpartition(":")
            number = _NUMBER.match(value.strip()) if sep else None
            if number:  # numpy scalars print as np.float64(x) under numpy 2
                record[key.strip()] = float(number.group(1))
        steps.append(record)
    return steps


def per_token(step: dict[str, float], samples: int) -> float | None:
    """Seconds of the generate phase per generated (response) token of one step."""
    gen, mean_len = step.get("timing_s/gen"), step.get("response_length/mean")
    if gen is None or not mean_len:
        return None
    return gen / (mean_len * samples)


def report(args: argparse.Namespace) -> None:
    work = Path(args.work)
    samples = args.batch * args.n
    figures: dict[str, Any] = {"parameters": {
        "model": "Qwen2.5-0.5B shape, random bf16 weights, Qwen2.5 tokenizer",
        "prompts_per_step": args.batch, "n": args.n, "samples_per_step": samples,
        "prompt_length": args.prompt_length, "response_length": args.response_length,
        "max_turns": args.max_turns, "steps": args.steps}, "loops": {}}
    for loop in LOOPS:
        path = work / f"{loop}.steps.json"
        if not path.exists():
            figures["loops"][loop] = {"ran": False}
            continue
        run = json.loads(path.read_text())
        steps = run["steps"]
        later = [t for t in (per_token(s, samples) for s in steps[1:]) if t is not None]
        figures["loops"][loop] = {
            "ran": True, "returncode": run["returncode"], "wall_s": round(run["wall_s"], 1),
            "gen_timer_resolution_s": run.get("poll_s", VERL_POLL_S),
            "steps": [{"step": s["step"],
                       **{f"{k}_s": s.get(f"timing_s/{k}") for k in TIMINGS},
                       "response_length_mean": s.get("response_length/mean"),
                       "num_turns_mean": s.get("num_turns/mean"),
                       "score_mean": s.get("critic/score/mean"),
                       "gen_s_per_token": per_token(s, samples)} for s in steps],
            "gen_s_per_token_median_after_step_1": statistics.median(later) if later else None,
        }
    ours = figures["loops"].get("pipeline", {}).get("gen_s_per_token_median_after_step_1")
    theirs = figures["loops"].get("verl", {}).get("gen_s_per_token_median_after_step_1")
    figures["pipeline_over_verl_gen_per_token"] = ours / theirs if ours and theirs else None
    # verl's V1 trainer times "gen" around a replay-buffer wait (ReplayBuffer.poll_interval):
    # each step's figure is a whole number of polls after the rollout ends, so two loops closer
    # than the coarser of the two runs' polls cannot be told apart by it.
    figures["gen_timer_resolution_s"] = max(
        (run.get("gen_timer_resolution_s", VERL_POLL_S) for run in figures["loops"].values()
         if run.get("ran")), default=VERL_POLL_S)
    figures["card"] = args.card
    path = write_result(args.name, figures)
    print(json.dumps(figures, indent=1))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name in ("prepare", "train", "report"):
        p = sub.add_parser(name)
        p.add_argument("--batch", type=int, default=64, help="prompts per step")
        p.add_argument("--n", type=int, default=4, help="samples per prompt")
        p.add_argument("--prompt-length", type=int, default=512)
        p.add_argument("--response-length", type=int, default=512)
        p.add_argument("--max-turns", type=int, default=4)
        p.add_argument("--steps", type=int, default=5)
        if name == "prepare":
            p.add_argument("--out", required=True)
            p.add_argument("--tokenizer", help="tokenizer folder for the model (built if given)")
            p.add_argument("--prompts", type=int, default=512)
            p.add_argument("--seed", type=int, default=0)
        else:
            p.add_argument("--work", required=True)
        if name == "train":
            p.add_argument("--loop", choices=sorted(LOOPS), required=True)
            p.add_argument("--micro-batch", type=int, default=16)
            p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
            p.add_argument("--agent-workers", type=int, default=2)
            p.add_argument("--timeout-s", type=float, default=560)
            p.add_argument("--poll-s", type=float, default=0.05,
                           help="verl's replay-buffer poll: the resolution of timing_s/gen")
            p.add_argument("extra", nargs="*", help="more hydra overrides")
        if name == "report":
            p.add_argument("--card", default=None, help="the GPU, as nvidia-smi names it")
            p.add_argument("--name", default="verl_gpu_e2e")
    args = parser.parse_args(argv)
    {"prepare": prepare, "train": train, "report": report}[args.what](args)


if __name__ == "__main__":
    main()
