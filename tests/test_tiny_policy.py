"""The shipped tiny policy: package data, the project's tokenizer and template, real tool use
through the real pipeline, and the training script that makes it."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from _model_fixtures import torch

from pipeline import Pipeline
from pipeline.engines.transformers import TransformersEngine
from pipeline.models import tiny_policy_dir, tiny_policy_info
from pipeline.models._template import CHAT_TEMPLATE
from pipeline.observability import read_trajectories
from pipeline.tools import evaluate_arithmetic
from scenarios import arith_tools
from scenarios.train_tiny_policy import (
    HELDOUT_SEED,
    Recipe,
    conversation,
    encode,
    evaluate,
    main,
    shared_prefix,
    tool_text,
    training_examples,
    training_questions,
)

pytest_plugins = ["_model_fixtures"]


@pytest.fixture(scope="module")
def policy():
    return TransformersEngine.from_pretrained(tiny_policy_dir(), max_batch_size=64,
                                              max_model_len=2048)


def test_shipped_policy_is_small_complete_and_uses_the_projects_tokenizer(tiny_tokenizer):
    directory = tiny_policy_dir()
    size = sum(p.stat().st_size for p in directory.iterdir())
    assert size <= 10 * 2**20
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64  # vLLM CPU head size
    engine = TransformersEngine.from_pretrained(directory)
    tok = engine.tokenizer
    assert tok.get_vocab() == tiny_tokenizer.get_vocab()
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token == "<|im_end|>"
    info = tiny_policy_info()
    assert info["recipe"]["seed"] == 0 and 0.3 <= info["heldout_transformers"]["solve_rate"] <= 0.6


async def test_policy_calls_the_calculator_and_solves_about_half(policy):
    """Held-out problems (a seed training never draws from), the real stage list, sampling at
    temperature 1: most samples make a real tool call; some are right, some wrong."""
    figures = await evaluate(policy, policy.tokenizer, count=96, seed=HELDOUT_SEED + 1)
    assert figures["by_status"] == {"completed": 96}
    assert figures["tool_call_rate"] >= 0.75
    assert 0.15 <= figures["solve_rate"] <= 0.8
    assert 0.15 <= figures["right_expression_rate"] <= 0.9
    assert figures["solve_rate_with_tool"] >= 0.1


async def test_a_solved_trajectory_is_a_real_tool_call_and_its_result(policy):
    tok = policy.tokenizer
    rows = arith_tools.rows(24, seed=HELDOUT_SEED)
    pipe = Pipeline(arith_tools.stages(), engine=policy, tokenizer=tok,
                    tools=arith_tools.tools(), seed=3,
                    sampling={"max_tokens": 96, "max_response_tokens": 512})
    result = await pipe.run_batch(rows, n=2)
    solved = [(s, i) for s, i in zip(result.samples, result.items, strict=True)
              if s.reward == 1.0 and s.tool_turns == 1]
    assert solved and len(solved) < len(result.samples)
    for sample, item in solved:
        messages = item.artifacts["messages"]
        call, reply, final = messages[2], messages[3], messages[4]
        expression = json.loads(call.tool_calls[0].function.arguments)["expression"]
        assert evaluate_arithmetic(expression) == int(item.data.ground_truth)
        assert reply.role == "tool" and reply.content == item.data.ground_truth
        assert final.content == f"Answer: {item.data.ground_truth}"
        # model tokens, then the tool turn (mask 0), then model tokens again
        mask = sample.response_mask
        assert mask[0] == 1 and mask[-1] == 1 and 0 in mask
        full = sample.prompt_ids + sample.response_ids
        rendered = tok.apply_chat_template(
            [m.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
             for m in messages], tools=item.data.tools, tokenize=False)
        assert tok.encode(rendered) == [*full, *tok.encode("\n")]


def test_training_data_is_the_chat_template_with_loss_on_assistant_tokens_only(tiny_tokenizer):
    tok = tiny_tokenizer
    prefix, prefix_ids = shared_prefix(tok)
    examples = training_examples(tok, 64, Recipe())  # also checks split == whole encoding
    assert examples == training_examples(tok, 64, Recipe())
    assert examples != training_examples(tok, 64, Recipe(seed=1))
    taught = [tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
              for ids, mask in examples]
    calls = [t for t in taught if t.startswith("<tool_call>")]
    assert len(calls) > 48
    assert all(t.endswith("<|im_end|>") for t in taught)
    assert all("<tool_response>" not in t and "<|im_start|>" not in t for t in taught)
    for ids, mask in examples:  # question and tool result are context, never targets
        assert mask[0] == 0 and len(mask) == len(ids)
    assert prefix.endswith("<|im_start|>user\n") and prefix_ids == tok.encode(prefix)


def test_training_noise_rates_and_a_held_out_set_apart_from_training():
    recipe = Recipe()
    rng = random.Random("noise-check")
    counts = {"no_tool": 0, "bad_expression": 0, "bad_answer": 0}
    draws = 4000
    for _ in range(draws):
        problem = arith_tools.draw_problem(rng)
        turns = conversation(problem, recipe, rng)
        if len(turns) == 1:
            counts["no_tool"] += 1
            continue
        expression = json.loads(turns[0]["tool_calls"][0]["function"]["arguments"])["expression"]
        counts["bad_expression"] += evaluate_arithmetic(expression) != problem.answer
        counts["bad_answer"] += turns[2]["content"] != f"Answer: {turns[1]['content']}"
    with_tool = draws - counts["no_tool"]
    assert counts["no_tool"] / draws == pytest.approx(recipe.p_no_tool, abs=0.02)
    assert counts["bad_expression"] / with_tool == pytest.approx(recipe.p_bad_expression,
                                                                 abs=0.03)
    assert counts["bad_answer"] / with_tool == pytest.approx(recipe.p_bad_answer, abs=0.03)
    seen = training_questions(4000)
    heldout = [r["messages"][1]["content"] for r in arith_tools.rows(256, HELDOUT_SEED)]
    # another stream: repeats only by chance, mostly the small "shares" family (17,280 texts)
    assert sum(q in seen for q in heldout) <= 16


def test_encode_masks_each_assistant_turn_through_its_end_token(tiny_tokenizer):
    tok = tiny_tokenizer
    row = arith_tools.rows(1, seed=5)[0]
    problem = arith_tools.draw_problem(random.Random(5))
    turns = conversation(problem, Recipe(p_no_tool=0, p_bad_expression=0, p_bad_answer=0),
                         random.Random(0))
    ids, mask = encode(tok, [*row["messages"], *turns], row["tools"])
    taught = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert taught == (f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": '
                      f'"{problem.expression}"}}}}\n</tool_call><|im_end|>'
                      f"Answer: {problem.answer}<|im_end|>")


@pytest.mark.slow
def test_training_script_writes_a_loadable_model(tmp_path):
    out = tmp_path / "policy"
    main(["--out", str(out), "--steps", "4", "--threads", "1", "--eval", "8"])
    info = json.loads((out / "training.json").read_text())
    assert info["recipe"]["steps"] == 4 and info["heldout_transformers"]["problems"] == 8
    engine = TransformersEngine.from_pretrained(out)
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE
    weights = dict(engine.model.named_parameters())
    shipped = TransformersEngine.from_pretrained(tiny_policy_dir()).model
    assert not torch.equal(weights["lm_head.weight"], shipped.lm_head.weight)  # 4 steps only


@pytest.mark.slow
def test_main_job_shows_tool_calls_and_a_reward_in_range(tmp_path):
    """The main job's scenario on the transformers engine (vLLM is tested apart): the report
    and the trajectories it writes."""
    out = tmp_path / "traj.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "run", "arith", "--engine", "transformers",
         "--rows", "16", "--n", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TransformersEngine" in proc.stdout or "WeightSyncedEngine" in proc.stdout
    samples = read_trajectories(out).samples
    assert len(samples) == 32
    for sample in samples:
        assert sample.status == "completed" and sample.response_len > 0
        assert [r.name for r in sample.records][:3] == ["build_prompt", "loop", "generate"]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("tool calls/errors"))
    calls = int(line.split()[-5])
    assert calls >= 20  # of 32 samples
    reward = float(next(x for x in proc.stdout.splitlines()
                        if x.startswith("reward mean")).split()[-3])
    assert 0.1 <= reward <= 0.8


async def test_training_tool_text_is_what_the_calculator_replies():
    tool = arith_tools.tools()["calculator"]
    for expression in ("24 / 3", "7 / 3", "12 + 5 * 3", "100 - 250"):
        assert await tool.fn(expression=expression) == tool_text(evaluate_arithmetic(expression))
