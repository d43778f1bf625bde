"""Names of the artifacts the built-in stages read and write.

``AgentRolloutItem.artifacts`` is a plain dict. Stages written by different people agree on
what lives there through these constants; custom stages should add their own keys with a
prefix of their own (``"myteam.search_hits"``) to stay clear of future built-in ones.
"""

from __future__ import annotations

from typing import Final

RAW_PROMPT: Final = "raw_prompt"
"""str: the prompt as rendered by the chat template (kept to make template mistakes visible)."""

PROMPT_IDS: Final = "prompt_ids"
"""list[int]: token ids of the rendered prompt."""

MESSAGES: Final = "messages"
"""list[AgentMessage]: the whole conversation, prompt messages first."""

RESPONSE_IDS: Final = "response_ids"
"""list[int]: every token after the prompt: model tokens and tool/template tokens."""

RESPONSE_MASK: Final = "response_mask"
"""list[int]: aligned with RESPONSE_IDS; 1 = sampled by the model, 0 = tool/template token."""

LOGPROBS: Final = "logprobs"
"""list[float]: aligned with RESPONSE_IDS; the sampled token's logprob, 0.0 where mask is 0."""

TOOL_TURNS: Final = "tool_turns"
"""int: number of tool-call rounds executed."""

TURNS: Final = "turns"
"""int: number of model generations (assistant turns)."""

REWARD: Final = "reward"
"""float: the sample's scalar reward."""

REWARD_PAYLOAD: Final = "reward_payload"
"""dict: the judgers' full results; always has ``score``."""

ROUTED_EXPERTS: Final = "routed_experts"
"""numpy int array ``[len, num_layers, topk]``: MoE router choices, when the engine gives them."""

EXIT_REASON: Final = "exit_reason"
"""str: why the agent loop ended (see ``pipeline.ExitReason``)."""

POLICY_VERSION: Final = "policy_version"
"""int: version of the weights that generated the sample (set by engines with weight sync)."""

TOKEN_VERSIONS: Final = "token_versions"
"""list[int]: aligned with ``RESPONSE_IDS``: the policy version that sampled each token, -1 on
tokens the model did not sample; set by ``Generate`` when the engine reports versions."""

MULTI_MODAL: Final = "multi_modal"
"""``pipeline.multimodal.SampleImages``: the sample's vision processor and the pixel inputs of
its image tokens so far (prompt, then tool turns); set by ``BuildPrompt(processor=...)``."""

RAW_FINISH_REASON: Final = "raw_finish_reason"
"""str: the engine's own finish reason for the last generation, kept beside ours."""

EXTRA_FIELDS: Final = "extra_fields"
"""dict: anything a stage wants passed through to the trainer untouched."""

TOOL_CALLS: Final = "tool_calls"
"""int: tool calls the model made (parsed or not)."""

TOOL_ERRORS: Final = "tool_errors"
"""int: tool calls that ended in an error message fed back to the model."""

TEMPLATE_DRIFT: Final = "template_drift"
"""int: turns where the chat template was not prefix-stable (the delta had to be recovered)."""

TOKEN_INTEGRITY: Final = "token_integrity"
"""str: the token-integrity check that failed (``decode``, ``logprobs``, ``prefix``); set only
on a quarantined sample (see ``pipeline.TokenIntegrityError``)."""

LIMITER_WAIT_S: Final = "limiter_wait_s"
"""float: seconds the sample's tool calls waited for rate-limiter tokens."""

JUDGE_RECORDS: Final = "judge_records"
"""list[JudgerRecord]: one per judger the Judge stage ran (score, payload, duration, error)."""
