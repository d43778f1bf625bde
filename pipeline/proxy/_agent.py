"""``RemoteAgent``: run a black-box agent against its own proxy session, then fill the item.

Per sample: create a session (sampling fixed to the sample's own), run the agent, complete the
session, and write the trajectory into the standard artifacts, so the default fill builds the
:class:`~pipeline.RolloutSample` and judgers see the conversation. The session is deleted
when the sample ends (its exit stack), aborting any engine request the agent left running.

The agent is either

* a command (argv, or a function of the item returning argv): run as a subprocess in its own
  process group with ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` (the session's endpoint and key),
  ``OPENAI_MODEL`` and ``PIPELINE_SESSION_ID`` set, the task as one JSON object on stdin
  (``messages``, ``tools``, ``extra``, ``uid``, ``group_id``), its stdout (stripped) taken as
  the final answer. Non-zero exit fails the sample with the end of its stderr. When the
  sample's deadline or ``timeout_s`` passes, the group gets SIGTERM, then SIGKILL after
  ``kill_grace_s``; leftover processes of the group are killed when the agent exits; or
* an ``async def agent(endpoint) -> str | None`` taking an :class:`AgentEndpoint`.

Segments: the sample is the segment of the agent's last turn. When the agent rewrote its
history, earlier segments are kept in ``extra_fields["proxy_segments"]`` (token fields of
each: ``prompt_ids``, ``response_ids``, ``response_mask``, ``logprobs``, ``reason``, ...) and
in full under the :data:`SEGMENTS` artifact; they share the sample's group and reward.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from pipeline import artifacts as A
from pipeline._context import Context
from pipeline._models import AgentMessage, AgentRolloutItem
from pipeline.proxy._errors import RemoteAgentError
from pipeline.proxy._history import content_text
from pipeline.proxy._records import SessionRecord, session_record
from pipeline.proxy._server import ProxyServer
from pipeline.proxy._sessions import Session

FINAL_ANSWER = "proxy.final_answer"
"""Artifact: the agent's final answer (its stdout, or what the function returned), or None."""
SEGMENTS = "proxy.segments"
"""Artifact: every :class:`~pipeline.proxy.SegmentRecord` of the session, in order."""
AGENT_LOG = "proxy.agent_log"
"""Artifact: the end of the agent process's stderr (commands only)."""
PROXY_KEY = "proxy"
"""``ctx.resources.extras`` key where :class:`RemoteAgent` finds the proxy if not given one."""


@dataclass(frozen=True, slots=True)
class AgentEndpoint:
    """What an agent needs to talk to its session, and its task.

    Attributes:
        base_url: the session's OpenAI base URL (``.../sessions/{sid}/v1``).
        api_key: the session's key (a bearer token that opens only this session).
        model: the model name to send.
        session_id: the session id.
        task: ``messages``, ``tools``, ``extra``, ``uid``, ``group_id`` of the sample.
    """

    base_url: str
    api_key: str
    model: str
    session_id: str
    task: dict[str, Any]

    def env(self) -> dict[str, str]:
        """The environment variables an OpenAI SDK client picks up."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key,
                "OPENAI_MODEL": self.model, "PIPELINE_SESSION_ID": self.session_id}


AgentFunction = Callable[[AgentEndpoint], Awaitable[str | None]]
"""An in-process agent: gets its endpoint, returns its final answer (or None)."""
Command = Sequence[str] | Callable[[AgentRolloutItem], Sequence[str]]
"""A subprocess agent: argv, or a function of the item that returns argv."""


class RemoteAgent:
    """Runs a black-box agent through the proxy (see the module doc).

    Args:
        agent: a command (argv or ``item -> argv``) or an ``async def agent(endpoint)``.
        proxy: the started :class:`ProxyServer`; default ``ctx.resources.extras["proxy"]``.
        timeout_s: the agent's own limit (the sample's deadline applies anyway).
        kill_grace_s: time between SIGTERM and SIGKILL of the process group.
        env: extra environment variables for a command.
        cwd: working directory of a command.
        lock_sampling: the session samples with the item's parameters, whatever the agent
            asks (``max_tokens`` is capped by them).
        answer_message: append the agent's final answer as an assistant message (extra field
            ``source="agent"``, no token ids) when it differs from the model's last reply, so
            judgers that read the last assistant message judge the answer.
        max_answer_chars: longer answers are cut.
        name: the stage name.
    """

    def __init__(self, agent: Command | AgentFunction, *, proxy: ProxyServer | None = None,
                 timeout_s: float | None = None, kill_grace_s: float = 2.0,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 lock_sampling: bool = True, answer_message: bool = True,
                 max_answer_chars: int = 65536, name: str = "remote_agent") -> None:
        is_function = inspect.iscoroutinefunction(agent) or (
            callable(agent) and inspect.iscoroutinefunction(type(agent).__call__))
        if not is_function and not callable(agent) and (
                isinstance(agent, str | bytes) or not agent):
            raise TypeError("RemoteAgent: agent must be a non-empty argv list, a function "
                            "item -> argv, or an async function endpoint -> answer")
        self.function: AgentFunction | None = cast(AgentFunction, agent) if is_function else None
        self.command: Command | None = None if is_function else cast(Command, agent)
        self.proxy = proxy
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.env = dict(env or {})
        self.cwd = cwd
        self.lock_sampling = lock_sampling
        self.answer_message = answer_message
        self.max_answer_chars = max_answer_chars
        self.name = name

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        proxy = self.proxy or ctx.resources.extras.get(PROXY_KEY)
        if not isinstance(proxy, ProxyServer):
            raise RemoteAgentError(f"RemoteAgent needs a started ProxyServer: pass proxy= or "
                                   f"put one in extras[{PROXY_KEY!r}]")
        session = proxy.create_session(sampling=item.sampling, lock_sampling=self.lock_sampling,
                                       metadata={"uid": item.uid, "group_id": item.group_id})
        ctx.exit_stack.push_async_callback(proxy.delete_session, session.id)
        row = item.data
        endpoint = AgentEndpoint(
            base_url=proxy.session_url(session), api_key=session.api_key,
            model=proxy.config.model_name, session_id=session.id,
            task={"messages": row.messages, "tools": row.tools, "extra": row.extra,
                  "uid": item.uid, "group_id": item.group_id})
        failure: RemoteAgentError | None = None
        answer: str | None = None
        try:
            answer = await self._run_agent(endpoint, item)
        except RemoteAgentError as exc:
            failure = exc
        finally:  # also on cancellation: the partial trajectory is kept for the dump
            if proxy.sessions.find(session.id) is not None:
                proxy.sessions.complete(session.id)
            self._fill(item, proxy, session, session_record(session, with_turns=False), answer)
        if failure is not None:
            raise failure
        if not session.history.segments:
            raise RemoteAgentError(f"the agent made no model request (session {session.id})")

    async def _run_agent(self, endpoint: AgentEndpoint, item: AgentRolloutItem) -> str | None:
        try:
            async with asyncio.timeout(self.timeout_s):
                if self.function is not None:
                    answer = await self.function(endpoint)
                    return None if answer is None else str(answer)[:self.max_answer_chars]
                return await self._run_command(endpoint, item)
        except TimeoutError:
            raise RemoteAgentError(f"the agent ran past timeout_s={self.timeout_s}") from None

    async def _run_command(self, endpoint: AgentEndpoint, item: AgentRolloutItem) -> str | None:
        command = self.command
        assert command is not None
        argv = [str(a) for a in (command(item) if callable(command) else command)]
        env = {**os.environ, **self.env, **endpoint.env()}
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env, cwd=self.cwd, start_new_session=True)
        try:
            out, err = await proc.communicate(json.dumps(endpoint.task).encode())
        finally:
            await self._stop(proc)
        log = err.decode(errors="replace")[-4000:]
        item.artifacts[AGENT_LOG] = log
        if proc.returncode != 0:
            raise RemoteAgentError(f"the agent {argv[0]!r} exited with status "
                                   f"{proc.returncode}: {log[-1000:].strip()}")
        answer = out.decode(errors="replace").strip()
        return answer[:self.max_answer_chars] or None

    async def _stop(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the group, SIGKILL it after the grace time, and kill any leftovers."""
        if proc.returncode is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(self.kill_grace_s):
                    await proc.wait()
            except TimeoutError:
                _signal_group(proc.pid, signal.SIGKILL)
                await proc.wait()
        _signal_group(proc.pid, signal.SIGKILL)  # grandchildren the agent left behind

    def _fill(self, item: AgentRolloutItem, proxy: ProxyServer, session: Session,
              record: SessionRecord, answer: str | None) -> None:
        art = item.artifacts
        art[FINAL_ANSWER] = answer
        art[SEGMENTS] = record.segments
        current = session.history.current
        if current is None:
            return
        main = record.segments[current.index]
        art[A.PROMPT_IDS] = main.prompt_ids
        art[A.RAW_PROMPT] = main.raw_prompt if main.raw_prompt is not None else (
            proxy.sessions.tokenizer.decode(main.prompt_ids, skip_special_tokens=False))
        art[A.RESPONSE_IDS] = main.response_ids
        art[A.RESPONSE_MASK] = main.response_mask
        art[A.LOGPROBS] = main.logprobs
        messages = main.agent_messages()
        last = next((m for m in reversed(messages) if m.role == "assistant"), None)
        if (self.answer_message and answer is not None
                and (last is None or content_text(last.content).strip() != answer)):
            messages.append(AgentMessage.model_validate(
                {"role": "assistant", "content": answer, "source": "agent"}))
        art[A.MESSAGES] = messages
        art[A.TURNS] = len(main.turns)
        art[A.TOOL_TURNS] = main.tool_turns
        art[A.TEMPLATE_DRIFT] = main.drift
        if main.policy_version is not None:
            art[A.POLICY_VERSION] = main.policy_version
        if current.routed_experts is not None:
            art[A.ROUTED_EXPERTS] = current.routed_experts
        item.finish_reason, item.raw_finish_reason = main.finish_reason, current.raw_finish_reason
        extra: dict[str, Any] = art.setdefault(A.EXTRA_FIELDS, {})
        extra["proxy_segments"] = [s.trainer_fields() for s in record.segments
                                   if s.index != main.index]
        extra["proxy_session"] = session.id
        extra["proxy_splits"] = record.num_splits
        extra["proxy_split_reasons"] = dict(record.splits)
        extra[A.TEMPLATE_DRIFT] = main.drift


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
