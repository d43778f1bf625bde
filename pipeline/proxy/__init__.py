"""An OpenAI-compatible proxy that records black-box agents token-exactly.

Agents that only speak the OpenAI API (coding CLIs, SWE-agent, customer agents) talk to a
per-session endpoint of :class:`ProxyServer`. The proxy applies the chat template itself,
generates token in / token out on the pipeline's engine, and records every turn's exact token
ids and logprobs. When the agent sends its history back, the recorded tokens are reused and
only the new messages are rendered, so turns merge into one token sequence; a rewritten
history splits the session into segments. :class:`RemoteAgent` runs an agent per sample and
fills the standard artifacts from its session; :class:`AgentReward` takes the reward an
agent program reported. Chat completions and the Responses API are
served; every request field is served, enforced by an engine that declares it (its optional
``enforces`` attribute, :data:`ENFORCEABLE`, :class:`Constraints`) or refused. Image parts
(data URLs) are served by a proxy with a vision processor (``ProxyServer(processor=...)``),
token-exactly, their pixels handed to the engine and carried by the sample. See
``_history`` for the token rules, ``_app`` for the routes and ``_policy`` for the fields.
"""

from pipeline._exceptions import AddressInUseError
from pipeline.proxy._agent import (
    AGENT_LOG,
    FINAL_ANSWER,
    PROXY_KEY,
    SEGMENTS,
    AgentEndpoint,
    AgentFunction,
    Command,
    RemoteAgent,
)
from pipeline.proxy._compare import message_key
from pipeline.proxy._config import ProxyConfig
from pipeline.proxy._errors import (
    ProxyAuthError,
    ProxyError,
    ProxyLimitError,
    ProxyRequestError,
    RemoteAgentError,
    SessionNotFound,
)
from pipeline.proxy._history import History
from pipeline.proxy._policy import ENFORCEABLE, Constraints
from pipeline.proxy._records import SegmentRecord, SessionRecord, TurnRecord
from pipeline.proxy._reward import AgentReward
from pipeline.proxy._segments import SPLIT_REASONS, Segment
from pipeline.proxy._server import ProxyServer
from pipeline.proxy._sessions import Session, SessionStore
from pipeline.proxy._wire import ChatCompletionRequest

__all__ = [
    "AGENT_LOG",
    "ENFORCEABLE",
    "FINAL_ANSWER",
    "PROXY_KEY",
    "SEGMENTS",
    "SPLIT_REASONS",
    "AddressInUseError",
    "AgentEndpoint",
    "AgentFunction",
    "AgentReward",
    "ChatCompletionRequest",
    "Command",
    "Constraints",
    "History",
    "ProxyAuthError",
    "ProxyConfig",
    "ProxyError",
    "ProxyLimitError",
    "ProxyRequestError",
    "ProxyServer",
    "RemoteAgent",
    "RemoteAgentError",
    "Segment",
    "SegmentRecord",
    "Session",
    "SessionNotFound",
    "SessionRecord",
    "SessionStore",
    "TurnRecord",
    "message_key",
]
