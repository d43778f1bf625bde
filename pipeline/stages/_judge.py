"""``Judge``: run judgers on a finished trajectory and fill ``reward`` / ``reward_payload``.

Judgers of a sample run concurrently, each under its own timeout; the reward is the weighted
mean of their scores. Every judger's outcome (score, payload, duration, error) is recorded
under :data:`pipeline.judgers.JUDGE_RECORDS`.

Failure policy (a judger raised, returned garbage, or ran past its timeout):

- ``on_error="mask"`` (the default): the stage raises :class:`JudgeError`, so the runner
  ends the sample ``status=failed`` and masks it out of the loss. A judge failure says
  nothing about the answer; scoring it 0 would teach the policy that a possibly right answer
  is wrong. The records and ``reward_payload`` (``score: None`` plus the errors) are kept.
- ``on_error="score"``: the failed judger counts as ``failure_score`` (default 0.0) in the
  weighted mean and the sample completes; the error is in ``reward_payload["errors"]``.

Either way nothing escapes the batch and no score is ever a silent 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Literal

from pipeline import artifacts as A
from pipeline._concurrency.callables import is_async_callable
from pipeline._concurrency.cancel import run_owned
from pipeline._data.models import AgentRolloutItem
from pipeline._exceptions import ConfigError
from pipeline._runner.context import Context
from pipeline.judgers import (
    JUDGE_RECORDS,
    JudgeError,
    Judger,
    JudgeResult,
    JudgerRecord,
    JudgerRegistry,
    default_registry,
)

OnError = Literal["mask", "score"]


@dataclass(frozen=True)
class JudgerSpec:
    """One judger of a ``Judge`` stage, with its weight and overrides.

    Attributes:
        judger: a judger, or a registered name (built with ``config``).
        weight: its weight in the sample's reward (>= 0).
        name: its name in records (default: the judger's ``name``, or the registered name).
        timeout_s: limit of one judge call (default: the stage's).
        on_error: failure policy for this judger (default: the stage's).
        config: keyword arguments for a judger given by name.
    """

    judger: Judger | str
    weight: float = 1.0
    name: str | None = None
    timeout_s: float | None = None
    on_error: OnError | None = None
    config: Mapping[str, Any] = field(default_factory=dict)


JudgerLike = Judger | str | JudgerSpec | tuple[Judger | str, float]
"""A judger, a registered name, a :class:`JudgerSpec`, or a ``(judger, weight)`` pair."""


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    judger: Judger
    weight: float
    timeout_s: float | None
    on_error: OnError


class Judge:
    """Scores each sample with one or more judgers (see the module doc).

    Contract: needs the conversation (``messages``, with the model's answer from
    ``Generate``); writes ``reward`` and ``reward_payload``.

    Args:
        judgers: the judgers for every sample (or for samples no route matches). None, with
            no ``routes``: use the pipeline's ``judgers`` resource.
        routes: ``data_source -> judgers``; a sample whose data source has no route uses
            ``judgers`` (and fails when there are none).
        timeout_s: default limit of one judge call (None: no limit).
        on_error: default failure policy, ``"mask"`` or ``"score"``.
        failure_score: the score a failed judger counts as under ``on_error="score"``.
        registry: where judger names are looked up (default: the default registry).
        name: the stage's name.

    Raises:
        ConfigError: an invalid policy, weight or timeout, or weights that sum to 0.
        JudgerRegistryError: an unknown judger name or a config it does not accept.
    """

    requires: ClassVar[Mapping[str, str]] = MappingProxyType({A.MESSAGES: "Generate"})
    provides = frozenset({A.REWARD, A.REWARD_PAYLOAD})

    def __init__(self, judgers: JudgerLike | Sequence[JudgerLike] | None = None, *,
                 routes: Mapping[str, JudgerLike | Sequence[JudgerLike]] | None = None,
                 timeout_s: float | None = 60.0, on_error: OnError = "mask",
                 failure_score: float = 0.0, registry: JudgerRegistry | None = None,
                 name: str = "judge") -> None:
        if on_error not in ("mask", "score"):
            raise ConfigError(f"Judge: on_error must be 'mask' or 'score', got {on_error!r}")
        if timeout_s is not None and (isinstance(timeout_s, bool)
                                      or not isinstance(timeout_s, int | float)
                                      or not timeout_s > 0):
            raise ConfigError(f"Judge: timeout_s must be > 0 or None, got {timeout_s!r}",
                              field="timeout_s")
        self.name = name
        self.timeout_s = timeout_s
        self.on_error: OnError = on_error
        self.failure_score = float(failure_score)
        self._registry = registry or default_registry
        self._owned: list[Judger] = []
        self.judgers = None if judgers is None else self._resolve(judgers, "judgers")
        self.routes = None if routes is None else {
            source: self._resolve(value, f"routes[{source!r}]") for source, value in routes.items()}
        self._from_resources: tuple[int, list[_Entry]] | None = None

    def _resolve(self, value: JudgerLike | Sequence[JudgerLike], where: str) -> list[_Entry]:
        items: Sequence[Any] = [value] if _is_single(value) else value  # type: ignore[assignment]
        entries: list[_Entry] = []
        for item in items:
            spec = item if isinstance(item, JudgerSpec) else (
                JudgerSpec(item[0], weight=item[1]) if isinstance(item, tuple)
                else JudgerSpec(item))
            judger = spec.judger
            if isinstance(judger, type):
                raise ConfigError(f"Judge {where}: {judger.__name__} is a class, not a judger: "
                                  f"write {judger.__name__}()", field=where)
            if isinstance(judger, str):
                default_name = judger
                judger = self._registry.create(judger, **spec.config)
                self._owned.append(judger)
            else:
                default_name = getattr(judger, "name", None) or type(judger).__name__
            if not is_async_callable(getattr(judger, "judge", None)):
                raise ConfigError(f"Judge {where}: {judger!r} has no 'async def judge(item)' "
                                  "(a plain 'def judge' would never be awaited)", field=where)
            if not isinstance(spec.weight, int | float) or not spec.weight >= 0:
                raise ConfigError(f"Judge {where}: weight must be a number >= 0, "
                                  f"got {spec.weight!r}")
            if spec.timeout_s is not None and spec.timeout_s <= 0:
                raise ConfigError(f"Judge {where}: timeout_s must be > 0, got {spec.timeout_s}")
            if spec.on_error not in (None, "mask", "score"):
                raise ConfigError(f"Judge {where}: on_error must be 'mask' or 'score'")
            name = spec.name or str(default_name)
            taken = {e.name for e in entries}
            unique, k = name, 2
            while unique in taken:
                unique, k = f"{name}#{k}", k + 1
            entries.append(_Entry(unique, judger, float(spec.weight),
                                  spec.timeout_s if spec.timeout_s is not None else self.timeout_s,
                                  spec.on_error or self.on_error))
        if entries and sum(e.weight for e in entries) <= 0:
            raise ConfigError(f"Judge {where}: the weights sum to 0")
        return entries

    def _select(self, item: AgentRolloutItem, ctx: Context) -> list[_Entry]:
        source = item.data.data_source
        entries = None
        if self.routes is not None:
            entries = self.routes.get(source)
        if entries is None:
            entries = self.judgers
        if entries is None and self.routes is None:
            given = ctx.resources.judgers
            if self._from_resources is None or self._from_resources[0] != id(given):
                self._from_resources = (id(given), self._resolve(list(given), "resources"))
            entries = self._from_resources[1]
        if not entries:
            known = sorted(self.routes) if self.routes else []
            raise JudgeError(f"no judger for data_source {source!r} (routes: {known}); give "
                             f"Judge(judgers=...) as the default")
        return entries

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        """Judge ``item``; write the reward, the payload and the records.

        Raises:
            JudgeError: a judger failed under ``on_error="mask"``, or no judger applies.
        """
        entries = self._select(item, ctx)
        if len(entries) == 1:
            records = [await self._judge_one(entries[0], item)]
        else:
            records = await run_owned([self._judge_one(e, item) for e in entries])
        item.artifacts[JUDGE_RECORDS] = records
        failed = [r for r in records if r.status != "ok"]
        for record in failed:
            ctx.log.warning("judger_failed", judger=record.name, status=record.status,
                            error_type=record.error_type, error=record.error,
                            policy=record.policy)
        masked = [r for r in failed if r.policy == "mask"]
        reward = None if masked else (
            sum(r.weight * (r.applied_score or 0.0) for r in records)
            / sum(r.weight for r in records))
        item.artifacts[A.REWARD_PAYLOAD] = _payload(reward, records, failed)
        if masked:
            item.artifacts.pop(A.REWARD, None)
            first = masked[0]
            raise JudgeError(f"judger '{first.name}' {first.status}: {first.error_type}: "
                             f"{first.error} (on_error='mask': the sample is masked)")
        item.artifacts[A.REWARD] = reward

    async def _judge_one(self, entry: _Entry, item: AgentRolloutItem) -> JudgerRecord:
        """One judge call; never raises but for cancellation."""
        start = time.monotonic()
        scope = asyncio.timeout(entry.timeout_s)
        try:
            async with scope:
                raw = await entry.judger.judge(item)
            result = JudgeResult.coerce(raw)
        except TimeoutError as exc:
            status: Literal["error", "timeout"] = "timeout"
            error = (f"no result within the {entry.timeout_s}s judge timeout" if scope.expired()
                     else str(exc) or "timed out")
            failure: Exception = exc
        except Exception as exc:
            status, error, failure = "error", str(exc) or repr(exc), exc
        else:
            return JudgerRecord(name=entry.name, weight=entry.weight, status="ok",
                                score=result.score, applied_score=result.score,
                                payload=result.payload, duration_s=time.monotonic() - start,
                                policy=entry.on_error)
        return JudgerRecord(
            name=entry.name, weight=entry.weight, status=status, score=None,
            applied_score=self.failure_score if entry.on_error == "score" else None,
            payload=dict(getattr(failure, "payload", None) or {}),
            duration_s=time.monotonic() - start, error_type=type(failure).__name__,
            error=error, policy=entry.on_error)

    async def aclose(self) -> None:
        """Close every judger this stage was given or built (those with ``aclose``).

        Judgers taken from the pipeline's resources belong to whoever built them.
        """
        seen: set[int] = set()
        everything = [*(self.judgers or []),
                      *(e for entries in (self.routes or {}).values() for e in entries)]
        for judger in [*(e.judger for e in everything), *self._owned]:
            if id(judger) in seen:
                continue
            seen.add(id(judger))
            close = getattr(judger, "aclose", None)
            if close is not None:
                await close()

    async def __aenter__(self) -> Judge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        names = [e.name for e in self.judgers or []]
        return f"Judge({names}, routes={sorted(self.routes or {})}, on_error={self.on_error!r})"


def _is_single(value: Any) -> bool:
    if isinstance(value, str | JudgerSpec) or hasattr(value, "judge"):
        return True
    return (isinstance(value, tuple) and len(value) == 2 and not isinstance(value[1], str)
            and isinstance(value[1], int | float))


def _payload(reward: float | None, records: list[JudgerRecord],
             failed: list[JudgerRecord]) -> dict[str, Any]:
    payload: dict[str, Any] = {"score": reward, "judgers": {
        r.name: {"score": r.applied_score, "weight": r.weight, "status": r.status,
                 "duration_s": round(r.duration_s, 6), "payload": r.payload,
                 **({"error": f"{r.error_type}: {r.error}"} if r.error else {})}
        for r in records}}
    if failed:
        payload["errors"] = {r.name: f"{r.error_type}: {r.error}" for r in failed}
    return payload
