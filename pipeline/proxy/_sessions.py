"""Sessions: one recorded conversation each, with its own key, lock, limits and idle clock.

A session id and its key are unguessable (``secrets``); the key opens only that session's
routes. A session's turns run one at a time (its lock), so a turn always sees the history the
previous one committed. Idle sessions (no request for ``idle_timeout_s``, nothing in flight)
expire, completed ones included, except sessions *held* by their owner (a running
``RemoteAgent``: its agent may spend a long time in a tool or a test suite between requests).
The ids and keys of the latest expired sessions are remembered, so a late request is told its
session expired (404 ``session_expired``, final) instead of getting a puzzling 401.

A session stores each turn compactly (:class:`Turn`); ``_records`` builds what the sessions
API returns from them.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog

from pipeline._data.config import SamplingParams
from pipeline._data.models import AgentMessage
from pipeline._text.tokenizer import Tokenizer
from pipeline.proxy._errors import ProxyLimitError, ProxyRequestError, SessionNotFound
from pipeline.proxy._history import History
from pipeline.proxy._messages import Translated
from pipeline.proxy._responses import ResponseLink

_logger = structlog.get_logger("pipeline.proxy")

EXPIRED_MEMORY = 4096
"""How many expired sessions are remembered (to answer their late requests)."""

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""Session ids a client may choose (``POST /sessions/{sid}``)."""


@dataclass(slots=True)
class Turn:
    """One chat completion served in a session (stored compactly).

    ``prompt_len`` is where the turn's tokens start in its segment's sequence: the turn's
    prompt is ``segment.sequence()[:prompt_len]`` and its request messages are the segment's
    first ``message_count`` messages.
    """

    index: int
    request_id: str
    segment: int
    merged: bool
    split_reason: str | None
    message_count: int
    prompt_len: int
    template_tokens: int
    reused_tokens: int
    reply: AgentMessage
    finish_reason: str
    raw_finish_reason: str | None
    drift: tuple[str, ...]
    stop_string: str | None
    request: dict[str, Any]
    sampling: dict[str, Any]
    policy_version: int | None
    timings: dict[str, float] = field(default_factory=dict)
    ignored_fields: tuple[str, ...] = ()
    """Hints of the request the proxy did not act on (``_policy.read_hints``)."""
    constraints: tuple[str, ...] = ()
    """Decoding constraints the engine enforced on the reply (``_policy.ENFORCEABLE``)."""
    images: tuple[dict[str, Any], ...] = ()
    """The images of the turn's new messages: sha256, width, height, tokens (no bytes)."""


class Session:
    """One session: its history, turns, key and sampling policy.

    Attributes:
        id: the session id (in its URL).
        api_key: the bearer token that opens this session's routes.
        history: the token-exact segments (:class:`~pipeline.proxy._history.History`).
        turns: one :class:`Turn` per chat completion that recorded tokens.
        requests: chat completions served (recorded or not).
        state: ``active`` until completed.
        sampling: the session's sampling parameters (defaults, or fixed: see
            ``lock_sampling``).
        lock_sampling: when True the agent's ``temperature``/``top_p``/``seed`` are ignored
            (recorded only) and its ``max_tokens`` is capped by ``sampling.max_tokens``: the
            trainer, not the agent, decides how the policy samples.
        metadata: anything the creator attached (the sample's uid, ...).
        held: never expires while True (its owner, e.g. a running agent, still needs it).
        ended: why the session cannot go on (``response_budget``, ``max_turns``), once a
            request hit that limit; None while it can.
    """

    def __init__(self, session_id: str, api_key: str, tokenizer: Tokenizer, *,
                 sampling: SamplingParams, lock_sampling: bool,
                 metadata: Mapping[str, Any] | None, eos_token_id: int | None,
                 held: bool = False) -> None:
        self.id = session_id
        self.api_key = api_key
        self.history = History(tokenizer, eos_token_id, sampling.stop_token_ids)
        self.turns: list[Turn] = []
        self.requests = 0
        self.state: Literal["active", "completed"] = "active"
        self.sampling = sampling
        self.lock_sampling = lock_sampling
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.created_at = time.time()
        self.last_active = time.monotonic()
        self.lock = asyncio.Lock()
        self.inflight: set[str] = set()
        """Engine request ids running for this session (aborted when it is deleted)."""
        self.held = held
        self.ended: str | None = None
        self.responses: dict[str, ResponseLink] = {}
        self.translated: list[Translated] = []
        """The Messages API messages of the last request, translated (``_messages.to_chat``
        reuses them for the ones an agent sends again, as it does every turn)."""
        self.integrity: list[dict[str, Any]] = []
        """Failed token-integrity checks: ``{"reason", "turn", "detail"}`` each."""

    def integrity_failed(self, reason: str, turn: int, detail: str) -> None:
        """Record a failed token-integrity check (the sample will be quarantined)."""
        self.integrity.append({"reason": reason, "turn": turn, "detail": detail})
        _logger.warning("token_integrity", session=self.id, reason=reason, turn=turn,
                        detail=detail)
        """Responses API answers by id (what ``previous_response_id`` refers to)."""

    @property
    def busy(self) -> bool:
        """Whether a request is being served."""
        return self.lock.locked() or bool(self.inflight)

    def touch(self) -> None:
        """Reset the idle clock."""
        self.last_active = time.monotonic()

    def __repr__(self) -> str:
        return f"Session({self.id!r}, state={self.state}, turns={len(self.turns)})"


class SessionStore:
    """All sessions of one proxy, by id and by key, with the session limits.

    Args:
        tokenizer: the engine's tokenizer (each session's history renders with it).
        max_sessions: sessions held at once (completed ones count until deleted or expired).
        idle_timeout_s: a session with no request for this long expires.
        sampling: default sampling of sessions created without their own.
        eos_token_id: the template's end-of-turn token (default: the tokenizer's eos).
        stop_token_ids: tokens every session stops on, whatever its own sampling says (a
            model family's: gpt-oss's ``<|call|>``); they end turns as the eos does.
    """

    def __init__(self, tokenizer: Tokenizer, *, max_sessions: int, idle_timeout_s: float,
                 sampling: SamplingParams | None = None,
                 eos_token_id: int | None = None, stop_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.stop_token_ids = tuple(stop_token_ids)
        self.sampling = self._stopping(sampling or SamplingParams())
        self.eos_token_id = eos_token_id
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, Session] = {}
        self._expired: OrderedDict[str, str] = OrderedDict()
        """Expired session ids and keys -> the session id (bounded: EXPIRED_MEMORY each)."""
        self.expired_count = 0

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[Session]:
        """Every session held now."""
        return list(self._by_id.values())

    def create(self, session_id: str | None = None, *, sampling: SamplingParams | None = None,
               lock_sampling: bool = False,
               metadata: Mapping[str, Any] | None = None, held: bool = False) -> Session:
        """Create a session (a server-generated id unless ``session_id`` is given).

        Raises:
            ProxyRequestError: ``session_id`` is malformed (400) or taken (409).
            ProxyLimitError: ``max_sessions`` sessions exist already.
        """
        if session_id is not None and not SESSION_ID.fullmatch(session_id):
            raise ProxyRequestError("a session id is 1-128 characters of A-Z a-z 0-9 _ -",
                                    param="session_id", code="invalid_session_id")
        if session_id is not None and session_id in self._by_id:
            raise ProxyRequestError(f"session {session_id!r} exists already", status=409,
                                    code="session_exists")
        if len(self._by_id) >= self.max_sessions:
            raise ProxyLimitError(f"the proxy holds {self.max_sessions} sessions already; "
                                  "complete and delete some first", code="too_many_sessions")
        sid = session_id or "sess_" + secrets.token_urlsafe(18)
        session = Session(sid, "sk-proxy-" + secrets.token_urlsafe(24), self.tokenizer,
                          sampling=self._stopping(sampling or self.sampling),
                          lock_sampling=lock_sampling,
                          metadata=metadata, eos_token_id=self.eos_token_id, held=held)
        self._by_id[sid] = session
        self._by_key[session.api_key] = session
        return session

    def _stopping(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` stopping on :attr:`stop_token_ids` too."""
        if set(self.stop_token_ids) <= set(sampling.stop_token_ids):
            return sampling
        merged = tuple(dict.fromkeys([*sampling.stop_token_ids, *self.stop_token_ids]))
        return sampling.model_copy(update={"stop_token_ids": merged})

    def find(self, session_id: str) -> Session | None:
        """The session, or None."""
        return self._by_id.get(session_id)

    def get(self, session_id: str) -> Session:
        """The session.

        Raises:
            SessionNotFound: no such session (never created, deleted or expired).
        """
        session = self._by_id.get(session_id)
        if session is None:
            self.raise_expired(session_id)
            raise SessionNotFound(f"no session {session_id!r}", code="session_not_found")
        return session

    def raise_expired(self, id_or_key: str) -> None:
        """Raise :class:`SessionNotFound` (``session_expired``) if this id or key expired."""
        sid = self._expired.get(id_or_key)
        if sid is not None:
            raise SessionNotFound(
                f"session {sid!r} expired: no request for idle_timeout_s="
                f"{self.idle_timeout_s:g} s; start a new session", code="session_expired")

    def expire(self, session_id: str) -> Session:
        """Remove an idle session and remember its id and key as expired."""
        session = self.remove(session_id)
        for name in (session.id, session.api_key):
            self._expired[name] = session.id
        while len(self._expired) > 2 * EXPIRED_MEMORY:
            self._expired.popitem(last=False)
        self.expired_count += 1
        return session

    def by_key(self, api_key: str) -> Session | None:
        """The session ``api_key`` opens, or None."""
        return self._by_key.get(api_key)

    def complete(self, session_id: str) -> Session:
        """Mark a session completed: later chat requests get 409. Idempotent.

        Raises:
            SessionNotFound: no such session.
        """
        session = self.get(session_id)
        session.state = "completed"
        session.touch()
        return session

    def remove(self, session_id: str) -> Session:
        """Forget a session (its key stops working at once).

        Raises:
            SessionNotFound: no such session.
        """
        session = self.get(session_id)
        del self._by_id[session_id]
        self._by_key.pop(session.api_key, None)
        return session

    def idle(self, now: float | None = None) -> list[Session]:
        """Sessions idle for longer than ``idle_timeout_s``, not busy and not held."""
        now = time.monotonic() if now is None else now
        limit = self.idle_timeout_s
        return [s for s in self._by_id.values()
                if now - s.last_active > limit and not s.busy and not s.held]
