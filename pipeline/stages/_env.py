"""Gym-style multi-turn environments (SkyRL's ``skyrl-gym``, gymnasium-like text
environments, your own) as a stage list.

A :class:`GymEnvironment` wraps a factory ``make_env(item)``. Its ``reset`` stage makes the
sample's environment, asks it for the first observation (``init(prompt)`` as in skyrl-gym, or
``reset()``) and renders the prompt; its ``step`` stage hands the model's last turn to
``step(action)`` and appends the observation it returns as template tokens with
``response_mask = 0``. The environment's ``close()`` runs once on every outcome (completed,
failed, timeout, aborted) through the sample's exit stack. Per-step rewards go to
``extra_fields["turn_scores"]`` (verl's column) and their sum (or the last one) is the sample's
reward. Environment methods may be ``async def`` or plain; plain ones run in a worker thread.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from pipeline import artifacts as A
from pipeline._data.models import AgentMessage, AgentRolloutItem
from pipeline._exceptions import ConfigError
from pipeline._runner.context import Context
from pipeline._text.render import render_prompt
from pipeline.stages._base import Loop
from pipeline.stages._generate import Generate
from pipeline.stages._observe import append_observation
from pipeline.stages._prompt import template_options

TURN_SCORES = "turn_scores"
"""``extra_fields`` key: the reward of every environment step, in order (verl's column)."""
ENV_DONE = "env_done"
"""Artifact: True once the environment said the episode is over."""
ENV_METADATA = "env_metadata"
"""Artifact: the ``metadata``/``info`` dict of every step, in order (kept for dumps)."""


class GymEnvironment:
    """Run a gym-style text environment as stages: ``[env.reset, Loop([Generate, env.step])]``.

    The environment is made per sample by ``make_env(item)`` and must have ``step(action)``
    and one of ``init(prompt_messages)`` (skyrl-gym: returns ``(messages, info)``) or
    ``reset()`` (returns an observation or ``(observation, info)``); ``close()`` is optional.
    ``step`` returns skyrl-gym's dict (``observations``, ``reward``, ``done``, ``metadata``)
    or gymnasium's tuple ``(observation, reward, terminated, truncated, info)``. An
    observation is a list of chat messages, one message dict, or a string (a user message).

    Args:
        make_env: ``(item) -> environment`` (plain or ``async def``); the row's ``extra``
            usually carries what the environment needs (skyrl-gym's ``reward_spec``).
        step_timeout_s: one ``reset``/``step`` call's limit; past it the sample fails with a
            readable error (a plain method keeps running in its worker thread: Python cannot
            stop a thread; ``close`` still runs).
        reward: ``"sum"`` of the step rewards (SkyRL's per-turn rewards summed) or ``"last"``.
        name: prefix of the stage names (``<name>_reset``, ``<name>_step``).

    Raises:
        ConfigError: a bad argument, naming the field.
    """

    def __init__(self, make_env: Callable[[AgentRolloutItem], Any], *,
                 step_timeout_s: float = 60.0, reward: Literal["sum", "last"] = "sum",
                 name: str = "env") -> None:
        if not callable(make_env):
            raise ConfigError(f"GymEnvironment: make_env must be a callable (item) -> "
                              f"environment, got {make_env!r}", field="make_env")
        if isinstance(step_timeout_s, bool) or not isinstance(step_timeout_s, int | float) or (
                not step_timeout_s > 0):
            raise ConfigError(f"GymEnvironment: step_timeout_s must be a number > 0, got "
                              f"{step_timeout_s!r}", field="step_timeout_s")
        if reward not in ("sum", "last"):
            raise ConfigError(f"GymEnvironment: reward must be 'sum' or 'last', got {reward!r}",
                              field="reward")
        self.make_env = make_env
        self.step_timeout_s = float(step_timeout_s)
        self.reward = reward
        self._envs: dict[str, Any] = {}  # by sample uid, while the sample runs
        self.reset = _Reset(self, f"{name}_reset")
        self.step = _Step(self, f"{name}_step")

    def stages(self, *, max_turns: int, generate: Any = None) -> list[Any]:
        """``[reset, Loop([generate, step], until=done, max_turns=max_turns)]``.

        Args:
            max_turns: the most model turns.
            generate: the generation stage; default ``Generate(parse_tool_calls=False)`` (the
                environment reads the model's whole text, tool syntax included).
        """
        body = [generate if generate is not None else Generate(parse_tool_calls=False),
                self.step]
        return [self.reset, Loop(body, until=self.done, max_turns=max_turns,
                                 name=f"{self.reset.name.removesuffix('_reset')}_loop")]

    @staticmethod
    def done(item: AgentRolloutItem) -> bool:
        """The loop's end condition: the environment said the episode is over."""
        return bool(item.artifacts.get(ENV_DONE))

    def env_of(self, item: AgentRolloutItem) -> Any:
        """The environment of a running sample."""
        try:
            return self._envs[item.uid]
        except KeyError:
            raise RuntimeError(f"no environment for sample {item.uid}: the reset stage must "
                               "run before the step stage") from None

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call an environment method (plain: in a worker thread) under the step timeout."""
        try:
            async with asyncio.timeout(self.step_timeout_s):
                if inspect.iscoroutinefunction(fn):
                    return await fn(*args)
                result = await asyncio.to_thread(fn, *args)
                return await result if inspect.isawaitable(result) else result
        except TimeoutError:
            raise TimeoutError(f"environment {what} did not return within "
                               f"{self.step_timeout_s}s") from None

    async def _close(self, uid: str, env: Any) -> None:
        self._envs.pop(uid, None)
        close = getattr(env, "close", None)
        if close is None:
            return
        result = close() if inspect.iscoroutinefunction(close) else await asyncio.to_thread(
            close)
        if inspect.isawaitable(result):
            await result


class _Reset:
    """Make the sample's environment, take its first observation, render the prompt."""

    requires: frozenset[str] = frozenset()
    provides = frozenset({A.RAW_PROMPT, A.PROMPT_IDS, A.MESSAGES, ENV_DONE})

    def __init__(self, owner: GymEnvironment, name: str) -> None:
        self.owner, self.name = owner, name

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        owner = self.owner
        make = owner.make_env
        env = await make(item) if inspect.iscoroutinefunction(make) else make(item)
        if inspect.isawaitable(env):
            env = await env
        owner._envs[item.uid] = env
        # Registered before anything else awaits: close runs on every outcome.
        ctx.exit_stack.push_async_callback(owner._close, item.uid, env)
        prompt = [dict(m) for m in item.data.messages]
        if callable(getattr(env, "init", None)):
            first = await owner._call("init", env.init, prompt)
        elif callable(getattr(env, "reset", None)):
            first = await owner._call("reset", env.reset)
        else:
            raise TypeError(f"environment {type(env).__name__} has neither init(prompt) nor "
                            "reset()")
        observation = first[0] if isinstance(first, tuple) else first
        messages = _as_messages(observation) or prompt
        text, ids = render_prompt(ctx.tokenizer, messages, item.data.tools,
                                  template_options(item, ctx))
        item.artifacts[A.RAW_PROMPT] = text
        item.artifacts[A.PROMPT_IDS] = ids
        item.artifacts[A.MESSAGES] = [AgentMessage.model_validate(m) for m in messages]
        item.artifacts[ENV_DONE] = False


class _Step:
    """Give the model's last turn to ``step``; append the observation; record the reward."""

    requires: ClassVar[Mapping[str, str]] = MappingProxyType(
        {A.MESSAGES: "the environment's reset", A.RESPONSE_IDS: "Generate"})
    provides = frozenset({A.MESSAGES, A.RESPONSE_IDS, A.RESPONSE_MASK, A.LOGPROBS, A.REWARD,
                          A.REWARD_PAYLOAD, A.EXTRA_FIELDS, A.TEMPLATE_DRIFT, ENV_DONE,
                          ENV_METADATA})

    def __init__(self, owner: GymEnvironment, name: str) -> None:
        self.owner, self.name = owner, name

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        owner = self.owner
        env = owner.env_of(item)
        art = item.artifacts
        messages: list[AgentMessage] = art[A.MESSAGES]
        last = messages[-1]
        if last.role != "assistant":
            return  # the model did not answer (the turn ended on a length limit)
        observation, reward, done, info = _read_step(
            await owner._call("step", env.step, last.content or ""))
        extra: dict[str, Any] = art.setdefault(A.EXTRA_FIELDS, {})
        scores: list[float] = [*(extra.get(TURN_SCORES) or ()), reward]
        extra[TURN_SCORES] = scores
        art.setdefault(ENV_METADATA, []).append(info)
        art[A.REWARD] = sum(scores) if owner.reward == "sum" else reward
        art[A.REWARD_PAYLOAD] = {"score": art[A.REWARD], TURN_SCORES: list(scores)}
        art[ENV_DONE] = done
        new = [AgentMessage.model_validate(m) for m in _as_messages(observation)]
        if not done and new:
            await append_observation(item, ctx, new)
        elif not done:  # nothing to show the model, yet not over: it could only repeat itself
            art[ENV_DONE] = True


def _as_messages(observation: Any) -> list[dict[str, Any]]:
    """An observation as chat messages: a list of messages, one message, or user text."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, Mapping):
        return [dict(observation)]
    if isinstance(observation, Sequence):
        out = []
        for m in observation:
            out.extend(_as_messages(m))
        return out
    raise TypeError(f"environment observation must be messages or text, got "
                    f"{type(observation).__name__}")


def _read_step(result: Any) -> tuple[Any, float, bool, dict[str, Any]]:
    """``(observation, reward, done, info)`` from skyrl-gym's dict or gymnasium's tuple."""
    if isinstance(result, Mapping):
        observation = result.get("observations", result.get("observation"))
        reward, done = result.get("reward", 0.0), result.get("done", False)
        info = result.get("metadata") or result.get("info") or {}
    elif isinstance(result, tuple) and len(result) == 5:
        observation, reward, terminated, truncated, info = result
        done = bool(terminated) or bool(truncated)
    elif isinstance(result, tuple) and len(result) == 4:
        observation, reward, done, info = result
    else:
        raise TypeError(f"environment step returned {type(result).__name__}: expected a dict "
                        "(observations, reward, done, metadata) or a gym tuple")
    try:
        value = float(reward if reward is not None else 0.0)
    except (TypeError, ValueError):
        raise TypeError(f"environment step reward must be a number, got {reward!r}") from None
    return observation, value, bool(done), dict(info or {})
