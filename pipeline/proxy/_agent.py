"""``RemoteAgent``: run a black-box agent against its own proxy session, then fill the item.

Per sample: create a session (sampling fixed to the sample's own), run the agent, complete the
session, and write the trajectory into the standard artifacts, so the default fill builds the
:class:`~pipeline.RolloutSample` and judgers see the conversation. The session is deleted
when the sample ends (its exit stack), aborting any engine request the agent left running.

The agent is either

* a command (argv, or a function of the item returning argv): run as a subprocess in its own
  process group with ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` (the session's endpoint and key;
  ``ANTHROPIC_BASE_URL``/``ANTHROPIC_API_KEY`` too),
  ``OPENAI_MODEL``, ``PIPELINE_SESSION_ID`` and ``PIPELINE_ANSWER_FILE`` set, the task as one
  JSON object on stdin (``messages``, ``tools``, ``extra``, ``uid``, ``group_id``). Its final
  answer is what it wrote to ``PIPELINE_ANSWER_FILE`` if it wrote anything, else its last
  non-empty stdout line (agent libraries print to stdout; ``answer_from="stdout"`` takes all of
  it). The agent is done when its process exits, not when its pipes close: then the rest of
  its group is killed and the pipes are drained for at most ``drain_s`` (a helper it left
  holding stdout cannot stall the sample); at most ``max_output_bytes`` of each pipe are kept
  (the end). Non-zero exit fails the sample with the end of its stderr, unless the session
  ended on a limit (see below). When the sample's deadline or ``timeout_s`` passes, the group
  gets SIGTERM, then SIGKILL after ``kill_grace_s``; or
* an ``async def agent(endpoint) -> str | None`` taking an :class:`AgentEndpoint`.

The session is *held* while the agent runs (it never expires, however long the agent spends in
a tool). When it ends on a limit the sample ends like ``Generate`` ends one: a spent response
budget gives ``finish_reason=length``, ``exit_reason=length``, ``raw_finish_reason=
response_budget``; the proxy's request limit gives ``exit_reason=max_turns``; the agent is
told with a final error, and its exit status then does not fail the sample.

Segments: the sample is the segment of the agent's last turn. When the agent rewrote its
history or ran a second conversation (a sub-agent), earlier segments are kept in
``extra_fields["proxy_segments"]`` (token fields of each: ``prompt_ids``, ``response_ids``,
``response_mask``, ``logprobs``, ``reason``, ``conversation``, ...) and in full under the
:data:`SEGMENTS` artifact; they share the sample's group and reward.

Token integrity: when a live check failed in the session (see the record's
``token_integrity``), the sample is quarantined: it ends ``failed`` (masked) with a
:class:`~pipeline.TokenIntegrityError` naming the reason, the turn and the session, and
``artifacts.TOKEN_INTEGRITY`` set to the reason (counted in ``BatchStats.token_integrity``).

Constraints: ``extra_fields["constraints"]`` lists the decoding constraints the engine enforced
on the session's replies (``json_schema``, ``tool_choice_required``, ...; empty: none).
Hints: ``extra_fields["ignored_fields"]`` lists the request hints the proxy accepted without
acting on them in any turn of the session (``metadata``, ``text.verbosity``, ...; the record's
``ignored_fields`` counts the turns per hint).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from pipeline import artifacts as A
from pipeline._data.models import AgentMessage, AgentRolloutItem, ExitReason, FinishReason
from pipeline._exceptions import TokenIntegrityError
from pipeline._runner.context import Context
from pipeline.multimodal import SampleImages
from pipeline.proxy._compare import content_text
from pipeline.proxy._errors import RemoteAgentError
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
ANSWER_FILE_ENV = "PIPELINE_ANSWER_FILE"
"""Environment variable naming the file a command agent may write its final answer to."""


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
        """The environment variables an OpenAI SDK client picks up, and the ones the
        ``anthropic`` SDK and Claude Code read (their base URL has no ``/v1``)."""
        root = self.base_url.removesuffix("/v1")
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key,
                "OPENAI_MODEL": self.model, "PIPELINE_SESSION_ID": self.session_id,
                "ANTHROPIC_BASE_URL": root, "ANTHROPIC_API_KEY": self.api_key}


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
        answer_from: ``last_line`` (default) or ``stdout``: where a command's answer comes
            from when it wrote no answer file.
        max_output_bytes: the most of each of a command's pipes that is kept (the end).
        drain_s: bound on reading a command's pipes after it exited.
        name: the stage name.
    """

    def __init__(self, agent: Command | AgentFunction, *, proxy: ProxyServer | None = None,
                 timeout_s: float | None = None, kill_grace_s: float = 2.0,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 lock_sampling: bool = True, answer_message: bool = True,
                 max_answer_chars: int = 65536,
                 answer_from: Literal["last_line", "stdout"] = "last_line",
                 max_output_bytes: int = 1 << 20, drain_s: float = 2.0,
                 name: str = "remote_agent") -> None:
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
        self.answer_from = answer_from
        self.max_output_bytes = max_output_bytes
        self.drain_s = drain_s
        self.name = name

    async def run(self, item: AgentRolloutItem, ctx: Context) -> None:
        proxy = self.proxy or ctx.resources.extras.get(PROXY_KEY)
        if not isinstance(proxy, ProxyServer):
            raise RemoteAgentError(f"RemoteAgent needs a started ProxyServer: pass proxy= or "
                                   f"put one in extras[{PROXY_KEY!r}]")
        session = proxy.create_session(sampling=item.sampling, lock_sampling=self.lock_sampling,
                                       metadata={"uid": item.uid, "group_id": item.group_id},
                                       held=True)
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
            if session.ended is None:  # after a limit the agent was told to stop: not a failure
                failure = exc
        finally:  # also on cancellation: the partial trajectory is kept for the dump
            session.held = False
            if proxy.sessions.find(session.id) is not None:
                proxy.sessions.complete(session.id)
            self._fill(item, proxy, session, session_record(session, with_turns=False), answer)
        if failure is not None:
            raise failure
        if session.integrity:  # quarantine: the sample ends failed, the reason named
            first = session.integrity[0]
            item.artifacts[A.TOKEN_INTEGRITY] = first["reason"]
            raise TokenIntegrityError(first["reason"], first["turn"],
                                      f"{first['detail']} (proxy session {session.id})")
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
        with tempfile.TemporaryDirectory(prefix="pipeline-agent-") as tmp:
            answer_file = os.path.join(tmp, "answer")
            env = {**os.environ, **self.env, **endpoint.env(), ANSWER_FILE_ENV: answer_file}
            out, err, code = await self._run_process(argv, env, json.dumps(endpoint.task))
            written = await asyncio.to_thread(_read_answer, answer_file,
                                              self.max_answer_chars + 1)
        log = err.decode(errors="replace")[-4000:]
        item.artifacts[AGENT_LOG] = log
        if code != 0:
            raise RemoteAgentError(f"the agent {argv[0]!r} exited with status "
                                   f"{code}: {log[-1000:].strip()}")
        text = out.decode(errors="replace").strip()
        if written:
            answer = written
        elif self.answer_from == "last_line":
            answer = next((line.strip() for line in reversed(text.splitlines())
                           if line.strip()), "")
        else:
            answer = text
        return answer[:self.max_answer_chars] or None

    async def _run_process(self, argv: list[str], env: dict[str, str],
                           task: str) -> tuple[bytes, bytes, int]:
        """Run the agent until its process exits; ``(stdout tail, stderr tail, status)``."""
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.subprocess_exec(
            lambda: _ExitProtocol(loop), *argv, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
            cwd=self.cwd, start_new_session=True)
        proc = asyncio.subprocess.Process(transport, protocol, loop)
        exited = protocol.exited
        out, err = bytearray(), bytearray()
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        tasks = [asyncio.create_task(_feed(proc.stdin, task.encode()), name="agent-stdin"),
                 asyncio.create_task(_pump(proc.stdout, out, self.max_output_bytes),
                                     name="agent-stdout"),
                 asyncio.create_task(_pump(proc.stderr, err, self.max_output_bytes),
                                     name="agent-stderr")]
        try:
            await exited.wait()  # not proc.wait(): that also waits for the pipes to close
        finally:
            await self._stop(proc, exited)
            await _drain(proc, tasks, self.drain_s)
        assert proc.returncode is not None
        return bytes(out), bytes(err), proc.returncode

    async def _stop(self, proc: asyncio.subprocess.Process, exited: asyncio.Event) -> None:
        """SIGTERM the group, SIGKILL it after the grace time, and kill any leftovers."""
        if not exited.is_set():
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                async with asyncio.timeout(self.kill_grace_s):
                    await exited.wait()
            except TimeoutError:
                _signal_group(proc.pid, signal.SIGKILL)
                await exited.wait()
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
        if current.images:  # the sample's multi_modal_inputs (the engine's, for the trainer)
            art[A.MULTI_MODAL] = SampleImages(None, current.images)
        item.finish_reason, item.raw_finish_reason = main.finish_reason, current.raw_finish_reason
        if session.ended == "max_turns":
            art[A.EXIT_REASON] = ExitReason.MAX_TURNS.value
        elif main.finish_reason is FinishReason.LENGTH:
            art[A.EXIT_REASON] = ExitReason.LENGTH.value
        extra: dict[str, Any] = art.setdefault(A.EXTRA_FIELDS, {})
        extra["proxy_segments"] = [s.trainer_fields() for s in record.segments
                                   if s.index != main.index]
        extra["proxy_session"] = session.id
        extra["proxy_splits"] = record.num_splits
        extra["proxy_split_reasons"] = dict(record.splits)
        extra["ignored_fields"] = sorted(record.ignored_fields)
        extra["constraints"] = sorted(record.constraints)  # what shaped the replies
        extra[A.TEMPLATE_DRIFT] = main.drift


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """The protocol ``create_subprocess_exec`` uses, plus an event set when the process
    exits (whoever still holds its pipes)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=1 << 16, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


def _read_answer(path: str, limit: int) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(limit).strip()
    except FileNotFoundError:
        return None


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    """Write the task to the agent's stdin and close it (an agent may never read it)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        pipe.write(data)
        await pipe.drain()
        pipe.close()


async def _pump(pipe: asyncio.StreamReader, into: bytearray, limit: int) -> None:
    """Read a pipe to its end, keeping the last ``limit`` bytes."""
    while chunk := await pipe.read(65536):
        into += chunk
        if len(into) > 2 * limit:
            del into[:-limit]
    del into[:-limit]


async def _drain(proc: asyncio.subprocess.Process, tasks: list[asyncio.Task[None]],
                 bound_s: float) -> None:
    """Let the pipe readers finish for at most ``bound_s``; then close the pipes."""
    _, pending = await asyncio.wait(tasks, timeout=bound_s)
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: a broken pipe of a gone agent is no news
    # a process outside the group may still hold the pipes: close our ends
    transport = getattr(proc, "_transport", None)
    if transport is not None:
        transport.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
