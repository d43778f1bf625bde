"""Start-up check that our tokenizer and the engine agree, before any sample is wasted.

The pipeline renders prompts with its own tokenizer and sends token ids; the engine stops on
its own eos ids. If the two disagree (another tokenizer revision, another chat template, a
model whose eos is not the tokenizer's), every sample is quietly wrong. The check renders a
probe conversation both ways and compares:

1. our prompt ids vs the engine's rendering of the same conversation;
2. the engine's echo of our prompt ids (``prompt_token_ids``) vs what we sent (no BOS
   added, nothing truncated);
3. our eos id is one the engine stops on, and pad ids agree where both have one.

Engines take part by implementing :class:`SupportsTokenizerProbe`; ``VLLMEngine`` and
``OpenAIEngine`` do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline._exceptions import EngineError
from pipeline._text.tokenizer import Tokenizer

PROBE_MESSAGES: tuple[dict[str, Any], ...] = (
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 17 + 25? Answer with a number {like 42}."},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Thanks! And 3 * 7 = ?  \n\tTabs, unicode é ü 你好."},
)
"""The default probe: system, user, assistant and user turns, braces, whitespace, unicode."""


class ConsistencyError(EngineError):
    """The tokenizer and the engine disagree; the message says where and how."""


@dataclass(frozen=True, slots=True)
class TokenizerProbe:
    """What an engine says about tokenization.

    Attributes:
        prompt_ids: the engine's token ids for the probe conversation (generation prompt
            added), or None when the engine cannot render conversations.
        eos_token_ids: ids the engine stops on, or None when unknown.
        pad_token_id: the engine tokenizer's pad id, or None.
        source: who answered (``"vllm"``, a server URL, ...).
    """

    prompt_ids: list[int] | None
    eos_token_ids: list[int] | None
    pad_token_id: int | None
    source: str


@runtime_checkable
class SupportsTokenizerProbe(Protocol):
    """An engine that can show how it tokenizes (see the module doc)."""

    async def probe_tokenizer(self, messages: Sequence[Mapping[str, Any]],
                              tools: Sequence[Mapping[str, Any]] | None = None
                              ) -> TokenizerProbe:
        """Render ``messages`` with the engine's tokenizer and report its special ids."""
        ...

    async def echo_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt ids the engine reports for a request on ``prompt_ids``."""
        ...


@dataclass
class ConsistencyReport:
    """Outcome of :func:`check_consistency`; ``problems`` is empty when all agree."""

    ours: list[int]
    engine: list[int] | None
    echoed: list[int] | None
    our_eos: int | None
    engine_eos: list[int] | None
    our_pad: int | None
    engine_pad: int | None
    source: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether no problem was found."""
        return not self.problems


async def check_consistency(engine: Any, tokenizer: Tokenizer, *,
                            messages: Sequence[Mapping[str, Any]] = PROBE_MESSAGES,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            raise_on_mismatch: bool = True) -> ConsistencyReport:
    """Compare our tokenizer with the engine's on a probe conversation (see the module doc).

    Args:
        engine: an engine; one without ``probe_tokenizer`` is reported as unchecked.
        tokenizer: the tokenizer the pipeline renders prompts with.
        messages: the probe conversation.
        tools: tool schemas to render with it.
        raise_on_mismatch: raise instead of returning a report with problems.

    Returns:
        The report (``report.ok`` when everything agrees).

    Raises:
        ConsistencyError: a mismatch, with the first differing position in both renderings.
    """
    from pipeline._text.render import render_prompt

    _, ours = render_prompt(tokenizer, [dict(m) for m in messages],
                            [dict(t) for t in tools] if tools else None)
    our_eos, our_pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if not isinstance(engine, SupportsTokenizerProbe):
        return ConsistencyReport(ours, None, None, our_eos, None, our_pad, None,
                                 type(engine).__name__,
                                 [f"{type(engine).__name__} cannot be probed; not checked"]
                                 if raise_on_mismatch is False else [])
    probe = await engine.probe_tokenizer(messages, tools)
    echoed = await engine.echo_prompt(ours)
    report = ConsistencyReport(ours, probe.prompt_ids, echoed, our_eos, probe.eos_token_ids,
                               our_pad, probe.pad_token_id, probe.source)
    if probe.prompt_ids is not None and probe.prompt_ids != ours:
        report.problems.append("prompt ids differ: " + describe_difference(
            ours, probe.prompt_ids, tokenizer))
    if echoed != ours:
        report.problems.append("the engine's prompt_token_ids differ from the ids sent: "
                               + describe_difference(ours, echoed, tokenizer))
    if our_eos is None:
        report.problems.append("our tokenizer has no eos_token_id")
    elif probe.eos_token_ids is not None and our_eos not in probe.eos_token_ids:
        report.problems.append(f"our eos id {our_eos} is not one the engine stops on "
                               f"({probe.eos_token_ids})")
    if probe.eos_token_ids is None and our_eos is not None and hasattr(engine, "tokenize_text"):
        # The engine cannot say what it stops on: at least its vocabulary must map our eos
        # token's text to our eos id.
        eos_text = tokenizer.decode([our_eos], skip_special_tokens=False)
        theirs = await engine.tokenize_text(eos_text)
        if theirs != [our_eos]:
            report.problems.append(f"the engine tokenizes our eos token {eos_text!r} as "
                                   f"{theirs}, not [{our_eos}]")
    if our_pad is not None and probe.pad_token_id is not None and our_pad != probe.pad_token_id:
        report.problems.append(f"pad ids differ: ours {our_pad}, the engine's "
                               f"{probe.pad_token_id}")
    if report.problems and raise_on_mismatch:
        raise ConsistencyError(f"tokenizer/engine mismatch ({probe.source}): "
                               + "; ".join(report.problems)
                               + ". Load the tokenizer from the model directory the engine "
                                 "serves, or fix the chat template.")
    return report


def describe_difference(ours: Sequence[int], theirs: Sequence[int], tokenizer: Any) -> str:
    """Where two id lists first differ, with a few ids and their text on each side."""
    n = min(len(ours), len(theirs))
    at = next((i for i in range(n) if ours[i] != theirs[i]), n)
    if at == n and len(ours) == len(theirs):
        return "identical"

    def window(ids: Sequence[int]) -> str:
        part = list(ids[at:at + 6])
        try:
            text = tokenizer.decode(part, skip_special_tokens=False)
        except Exception:  # decoding is a courtesy in an error message
            text = "?"
        return f"{part} {text!r}"

    return (f"lengths {len(ours)} (ours) vs {len(theirs)} (engine), first difference at "
            f"position {at}: ours {window(ours)}, engine {window(theirs)}")
