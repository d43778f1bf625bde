"""The proxy's errors. Each carries the HTTP status and the OpenAI error fields it is sent as.

::

    PipelineError
    ├── ProxyError               anything the proxy reports as an OpenAI-style error body
    │   ├── ProxyRequestError    a request that cannot be served as sent (4xx)
    │   │   ├── ProxyAuthError   missing or wrong bearer token (401)
    │   │   ├── SessionNotFound  no such session, or it expired (404, final)
    │   │   ├── ProxyLimitError  a limit was reached: sessions, body size (429 / 413)
    │   │   └── FinalError       the session cannot go on: turns or response budget spent,
    │   │                        completed, a refused field (404, final)
    │   └── ...                  engine failures (502 / 503)
    └── RemoteAgentError         the black-box agent failed (exit status, timeout, no turns)

*Final* errors are the answers an agent must not retry. Clients disagree on what they retry:
the OpenAI SDK (and openai-agents over it) retries 408, 409, 429 and 5xx unless the answer
carries ``x-should-retry: false``; mini-swe-agent retries every error except 401, 403, 404,
context-window and unsupported-parameter errors, for minutes, with back-off — and litellm,
which it calls, maps a 403 from an OpenAI-compatible server to a plain ``APIError``. So a
final error is a 404 with ``x-should-retry: false`` (401 would read as a bad key): the only
answer all of them give up on at once. Its ``code`` says what happened.
"""

from __future__ import annotations

from typing import Any

from pipeline._exceptions import PipelineError


class ProxyError(PipelineError):
    """An error the proxy answers with ``{"error": {message, type, param, code}}``.

    Attributes:
        status: the HTTP status.
        type: OpenAI's error ``type`` (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if one is.
        code: a short machine-readable code.
    """

    status = 500
    type = "server_error"
    final = False
    """Sent with ``x-should-retry: false`` (see the module doc)."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The OpenAI-style error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class ProxyRequestError(ProxyError):
    """A request that cannot be served as sent (bad JSON, bad field, wrong state)."""

    status = 400
    type = "invalid_request_error"


class ProxyAuthError(ProxyRequestError):
    """No bearer token, or one that does not open this route."""

    status = 401
    type = "authentication_error"


class SessionNotFound(ProxyRequestError):
    """The session does not exist (never created, deleted, or expired)."""

    status = 404
    type = "not_found_error"
    final = True


class FinalError(ProxyRequestError):
    """The session cannot serve this request and never will: retrying is pointless."""

    status = 404
    final = True


class ProxyLimitError(ProxyRequestError):
    """A configured limit was reached (sessions held, body size)."""

    status = 429
    type = "limit_error"


class RemoteAgentError(PipelineError):
    """The black-box agent failed: non-zero exit, its own time limit, or no model request."""
