"""The tiny local model: deterministic build, cache, command line, tokenizer and template."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _model_fixtures import torch

from pipeline import ConfigError
from pipeline.models.tiny import (
    MARKER,
    TinyModelSpec,
    build_tiny_model,
    default_model_dir,
    ensure_tiny_model,
)

pytest_plugins = ["_model_fixtures"]

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate arithmetic.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function",
     "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}]},
    {"role": "tool", "tool_call_id": "c0", "content": "5"},
    {"role": "assistant", "content": "Answer: 5"},
]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir())}


def test_same_seed_gives_the_same_files_and_another_seed_other_weights(tiny_model_dir,
                                                                       tmp_path):
    again = build_tiny_model(tmp_path / "again")
    assert digests(again) == digests(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            MARKER} <= set(digests(again))
    config = json.loads((again / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["num_hidden_layers"] == 2
    assert config["hidden_size"] // config["num_attention_heads"] == 64


def test_ensure_builds_once_and_guards_foreign_directories(tiny_model_dir, tmp_path,
                                                          monkeypatch):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    assert ensure_tiny_model(tiny_model_dir) == tiny_model_dir
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a tiny-model build"):
        ensure_tiny_model(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    monkeypatch.setenv("ROLLOUT_TINY_MODEL_DIR", str(tmp_path / "override"))
    assert default_model_dir() == tmp_path / "override"
    monkeypatch.delenv("ROLLOUT_TINY_MODEL_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "xdg" / "rollout-pipeline" / "tiny-qwen2"


def test_command_line_prints_the_directory_and_refuses_foreign_ones(tiny_model_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "pipeline.models.tiny", str(tiny_model_dir)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tiny_model_dir)
    (tmp_path / "x.txt").write_text("x")
    refused = subprocess.run([sys.executable, "-m", "pipeline.models.tiny", str(tmp_path)],
                             capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "not a tiny-model build" in refused.stderr


def test_tokenizer_has_chatml_controls_and_visible_tool_markup(tiny_tokenizer):
    tok = tiny_tokenizer
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    for marker in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        [token] = tok.encode(marker)
        assert tok.decode([token], skip_special_tokens=True) == marker
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"
    text = "Ava has 12 apples; 12 * 3 = 36. Émile"
    assert tok.decode(tok.encode(text)) == text  # byte-level: lossless


def test_chat_template_renders_tools_and_is_prefix_stable(tiny_tokenizer):
    full = tiny_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert '"name": "calculator"' in full.split("</tools>")[0]
    assert ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n'
            "</tool_call><|im_end|>") in full
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n" in full
    for k in range(1, len(CONVERSATION)):
        shorter = tiny_tokenizer.apply_chat_template(CONVERSATION[:k], tools=TOOLS,
                                                     tokenize=False)
        assert full.startswith(shorter)
        prompt = tiny_tokenizer.apply_chat_template(CONVERSATION[:k], tools=TOOLS,
                                                    tokenize=False, add_generation_prompt=True)
        assert prompt == shorter + "<|im_start|>assistant\n"


def test_model_loads_and_gives_varied_next_token_distributions(engine_model, tiny_tokenizer):
    ids = tiny_tokenizer.apply_chat_template(CONVERSATION[:2], tools=TOOLS,
                                             add_generation_prompt=True)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(engine_model(input_ids=torch.tensor([ids])).logits[0], -1)
    entropy = -(logp.exp() * logp).sum(-1)
    assert 2.0 < float(entropy.mean()) < 6.5  # neither one repeated token nor uniform noise
    assert sum(p.numel() for p in engine_model.parameters()) < 1_000_000


def test_spec_change_rebuilds_in_place(tmp_path):
    directory = ensure_tiny_model(tmp_path / "m", TinyModelSpec(seed=1, num_hidden_layers=1))
    first = digests(directory)["model.safetensors"]
    ensure_tiny_model(directory, TinyModelSpec(seed=2, num_hidden_layers=1))
    assert digests(directory)["model.safetensors"] != first
    assert json.loads((directory / MARKER).read_text())["spec"]["seed"] == 2
