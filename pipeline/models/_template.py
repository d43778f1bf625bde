"""The tiny model's chat template and the text its tokenizer is trained on.

The template is ChatML with hermes-style tool calls:

* tool schemas go into the system turn, one JSON object per line inside ``<tools>``;
* an assistant turn renders its content, then each call as
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``;
* a tool result is its own turn with role ``tool``, wrapped in ``<tool_response>``.

Every message renders on its own, independent of the ones after it, so the template is
prefix-stable: rendering a conversation and then appending messages never rewrites what was
already rendered. The agent loop relies on that to tokenize only the new turns.
"""

from __future__ import annotations

import json

CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}{{- part.text or '' -}}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set system = messages[0].content -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set system = none -%}{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- if system is not none or tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{{- text(system) -}}"
    "{%- if tools -%}"
    "{%- if system is not none -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- 'Tools you may call, one JSON schema per line:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nCall a tool with <tool_call>\\n"
    "{\"name\": <name>, \"arguments\": <JSON object>}\\n</tool_call>' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{{- text(m.content) -}}"
    "{%- for call in (m.tool_calls or []) -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' ~ (fn.name | tojson) ~ ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}"
    "{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' -}}{{- text(m.content) -}}"
    "{{- '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' -}}{{- text(m.content) -}}{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""Control tokens: pad, turn start, turn end (eos). Skipped when decoding for display."""

MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Single tokens that stay visible in decoded text, so a parser can find tool calls."""

_SENTENCES = (
    "The train leaves at seven and arrives a little after nine.",
    "She counted the apples twice before writing the total down.",
    "A small shop sells pencils in boxes of twelve.",
    "Our garden has four rows of beans and three rows of peas.",
    "He walked to the library, borrowed two books, and came home.",
    "Please add the numbers and tell me the result.",
    "Each bus carries forty people, and there are six buses.",
    "If a recipe needs three eggs, how many are needed for five cakes?",
    "The answer is the number you get after the last step.",
    "Tools help when the arithmetic is long or easy to get wrong.",
    "I will use the calculator to check the sum.",
    "The result of the calculation was returned by the tool.",
    "Think step by step, then give the final answer as a number.",
    "A farmer sold half of his sheep and bought ten more.",
    "Water boils at one hundred degrees at sea level.",
    "Tickets cost eight dollars for adults and five for children.",
    "The tank held 250 liters and lost 12 liters every hour.",
    "You are a helpful assistant that solves word problems.",
    "Reply with a short sentence that contains the answer.",
    "The quotient is rounded to two decimal places.",
)

_NAMES = ("Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana", "Ivan", "Jo")
_ITEMS = ("apples", "books", "coins", "marbles", "stamps", "cards", "shells", "pens")


def training_corpus() -> list[str]:
    """Deterministic text the tiny tokenizer is trained on (no file or network needed).

    It mixes plain sentences, arithmetic, JSON tool calls and chat markup, so common pieces of
    the arithmetic scenario become single tokens.
    """
    lines = list(_SENTENCES)
    for i in range(400):
        a, b = (i * 37) % 97 + 2, (i * 53) % 89 + 3
        op = "+-*/"[i % 4]
        name, item = _NAMES[i % len(_NAMES)], _ITEMS[(i // 3) % len(_ITEMS)]
        lines.append(f"{name} has {a} {item} and gets {b} more. How many {item} now?")
        lines.append(f"{a} {op} {b} = ? The answer is {a + b}.")
        call = {"name": "calculator", "arguments": {"expression": f"{a} {op} {b}"}}
        lines.append(f"<tool_call>\n{json.dumps(call)}\n</tool_call>")
        lines.append(f"<tool_response>\n{a * b}\n</tool_response>")
        lines.append(f"<|im_start|>user\n{name} needs {a} {item}.<|im_end|>\n"
                     "<|im_start|>assistant\n")
    lines.append(json.dumps({"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}))
    return lines
