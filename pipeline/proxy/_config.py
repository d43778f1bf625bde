"""``ProxyConfig``: the options of a proxy server, validated once (pydantic, frozen)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from pipeline._data.config import SamplingParams


class ProxyConfig(BaseModel):
    """Options of a :class:`~pipeline.proxy.ProxyServer`.

    Attributes:
        host / port: where to listen (127.0.0.1 by default; port 0 lets the OS choose, a
            fixed port is retried while busy).
        api_key: the server's bearer token (None: the routes that need it are open).
        model_name: the model id the proxy reports.
        max_sessions: sessions held at once.
        max_turns: chat completions per session.
        max_body_bytes: largest request body (413 above it).
        idle_timeout_s: sessions idle this long expire.
        max_tokens: cap on one reply, whatever the agent asks (None: no cap beyond the
            session's sampling; the engine's context applies anyway).
        sampling: sampling of sessions created over HTTP without their own.
        offload_chars: render in a worker thread when a request's new messages hold more text.
        abort_timeout_s: bound on one engine abort (a client gone, a session deleted); a
            failed or slow abort is logged, never an error of the request.
        read_timeout_s: a request body must arrive within this (408 after it).
        offload_bytes: decode, validate and match larger bodies in a worker thread.
        token_integrity_checks: check every turn's tokens live (see
            ``pipeline.TokenIntegrityError``); a failure is recorded on the session record
            (``token_integrity``) and quarantines the sample ``RemoteAgent`` builds from it.
        strict_fields: refuse the hints the proxy cannot act on (``metadata``, ``store``,
            ``verbosity``, ``reasoning_effort`` where the chat template has no such option,
            ...) with the final error, instead of accepting them and listing them in
            ``ignored_fields`` (see ``pipeline.proxy._policy``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=8)
    model_name: str = "pipeline-proxy"
    max_sessions: int = Field(4096, ge=1)
    max_turns: int = Field(512, ge=1)
    max_body_bytes: int = Field(16 * 2**20, ge=1024)
    idle_timeout_s: float = Field(900.0, gt=0)
    max_tokens: int | None = Field(16384, ge=1)
    sampling: SamplingParams = SamplingParams()
    offload_chars: int = Field(32768, ge=0)
    abort_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(60.0, gt=0)
    offload_bytes: int = Field(256 * 1024, ge=0)
    token_integrity_checks: bool = True
    strict_fields: bool = False
