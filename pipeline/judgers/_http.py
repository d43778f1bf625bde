"""The ``http`` judger: POST the trajectory to a reward service that runs elsewhere.

Request body (JSON)::

    {"uid": ..., "group_id": ..., "data_source": ..., "ground_truth": ..., "response": "...",
     "messages": [<AgentMessage wire form>, ...], "extra": {...}}

Response: a JSON number, or an object with ``score`` (other keys become the payload). Server
errors (5xx, 429), connection errors and timeouts are retried with exponential backoff; other
4xx answers and malformed bodies fail at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp

from pipeline import artifacts as A
from pipeline._data.models import AgentMessage, AgentRolloutItem
from pipeline.judgers._base import JudgeError, JudgeResult, response_text
from pipeline.judgers._registry import register_judger


class _Retryable(Exception):
    pass


@register_judger("http")
class HttpJudger:
    """Scores samples with a remote reward service (see the module doc).

    Args:
        url: the endpoint to POST to.
        timeout_s: limit of one attempt (connect, send, read).
        retries: further attempts after the first one fails in a retryable way.
        backoff_s: wait before the first retry; doubles each time.
        headers: extra request headers (e.g. an authorization header).
        session: a shared ``aiohttp.ClientSession`` (its owner closes it); default: the
            judger's own, opened on first use and closed by :meth:`aclose`.
        name: the judger's name.
    """

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 2,
                 backoff_s: float = 0.2, headers: Mapping[str, str] | None = None,
                 session: aiohttp.ClientSession | None = None, name: str = "http") -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.backoff_s = backoff_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.name = name
        self._session = session
        self._owns_session = session is None

    def body(self, item: AgentRolloutItem) -> dict[str, Any]:
        """The JSON body sent for ``item``."""
        messages = item.artifacts.get(A.MESSAGES) or []
        return {
            "uid": item.uid, "group_id": item.group_id, "data_source": item.data.data_source,
            "ground_truth": item.data.ground_truth, "response": response_text(item),
            "messages": [m.model_dump(mode="json", exclude_none=True)
                         if isinstance(m, AgentMessage) else m for m in messages],
            "extra": item.data.extra,
        }

    async def judge(self, item: AgentRolloutItem) -> JudgeResult:
        """POST ``item`` and return the service's score.

        Raises:
            JudgeError: every attempt failed, the service answered a 4xx, or its answer holds
                no score.
        """
        data = json.dumps(self.body(item), default=str)
        if self._session is None:
            self._session = aiohttp.ClientSession()
        last: str = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                answer = await self._post(self._session, data)
            except _Retryable as exc:
                last = str(exc)
                continue
            result = JudgeResult.coerce(answer)
            result.payload["attempts"] = attempt + 1
            return result
        raise JudgeError(f"reward service {self.url} failed {self.retries + 1} times; "
                         f"last: {last}", payload={"attempts": self.retries + 1})

    async def _post(self, session: aiohttp.ClientSession, data: str) -> Any:
        try:
            async with session.post(self.url, data=data, headers=self.headers,
                                    timeout=self.timeout) as response:
                text = await response.text()
                if response.status >= 500 or response.status == 429:
                    raise _Retryable(f"HTTP {response.status}: {text[:200]}")
                if response.status >= 400:
                    raise JudgeError(f"reward service {self.url} answered HTTP "
                                     f"{response.status}: {text[:200]}")
        except TimeoutError as exc:
            raise _Retryable(f"no answer within {self.timeout.total}s") from exc
        except aiohttp.ClientError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        try:
            return json.loads(text)
        except ValueError as exc:
            raise JudgeError(f"reward service {self.url} sent invalid JSON: {text[:200]!r}"
                             ) from exc

    async def aclose(self) -> None:
        """Close the judger's own HTTP session."""
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
