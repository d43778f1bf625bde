"""Serving one chat completion in a session: match, render, generate, cut, parse, commit.

The session's history is changed only after the engine answered (``History.commit``): a
request that fails, is cancelled (the client went away) or is aborted leaves the session as it
was, so the agent may simply retry.

Limits that end a session: the per-session request limit (``max_turns``) and the sampling's
``max_response_tokens`` (the response budget, counted like ``Generate`` counts it: model and
template tokens of the segment). The request that finds one spent gets a final error (404),
``session.ended`` names the limit, and the segment it would have extended ends with
``finish_reason=length`` and ``raw_finish_reason="response_budget"`` (a turn cut short by the
budget gets the same raw reason), so the sample ends the way ``Generate`` ends one.

Strict tools (``"strict": true``, openai-agents' default): the engine cannot constrain the
arguments, so each call to a strict tool is checked against its schema after generation; a call
off its schema comes back as text with ``tool_call_errors``, like an unreadable call (the agent
never receives a call that violates a strict schema; the record keeps the sampled tokens).

``stop`` strings: the engine stops on token ids only. A stop string that is one token is also
passed as a stop id (to end early); after generation the reply is cut at the first stop
string: the agent gets the text before it, the record keeps the sampled tokens up to the one
that completed it (a prefix of what the engine produced, never re-tokenized).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, NoReturn

from pipeline._concurrency.cancel import abort_request
from pipeline._data.config import SamplingParams
from pipeline._data.models import TOOL_CALL_ERRORS, AgentMessage, FinishReason
from pipeline._exceptions import EngineError
from pipeline._text import integrity
from pipeline._text.render import decode_text
from pipeline._text.tokenizer import Tokenizer
from pipeline.engines import Engine, Generation, Route
from pipeline.multimodal import VisionProcessor
from pipeline.proxy._errors import FinalError, ProxyError, ProxyRequestError
from pipeline.proxy._logprobs import TokenLogprobs
from pipeline.proxy._policy import Constraints
from pipeline.proxy._segments import TurnPlan, new_images
from pipeline.proxy._sessions import Session, Turn
from pipeline.proxy._wire import ChatCompletionRequest
from pipeline.tools import ToolParser, read_turn, validate_arguments


def session_route(session: Session) -> Route:
    """The routing key of a session's requests: the session, and its group (the creator's
    ``metadata["group_id"]``, which ``RemoteAgent`` sets to the sample's group, so the n
    sessions of one prompt share a server; the session alone when there is none)."""
    group = session.metadata.get("group_id")
    return Route(session=session.id, group=session.id if group is None else str(group))


@dataclass(slots=True)
class TurnOutcome:
    """What the HTTP layer needs to answer one chat completion."""

    reply: AgentMessage
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[dict[str, Any]] | None
    turn: Turn | None


class TurnRunner:
    """Runs chat completions of sessions against one engine.

    Args:
        engine: the engine (token ids in, token ids and logprobs out).
        tokenizer: its tokenizer, with the chat template.
        parser: finds tool calls in replies.
        max_tokens: cap on one reply's tokens (None: the session's ``sampling.max_tokens``
            when the agent asks for none, else what the agent asks).
        max_turns: chat completions one session may make.
        offload_chars: render in a worker thread when the new messages hold more text.
        abort_timeout_s: bound on the engine abort when a client goes away.
        check_integrity: run the live token-integrity checks on every turn (see
            :mod:`pipeline._text.integrity`); a failed one is recorded on the session
            (``Session.integrity``, the record's ``token_integrity``), never an error of the
            request: the agent goes on, and the sample built from the session is quarantined.
        processor: renders image parts (data URLs) and their pixel inputs; None refuses
            image parts (``_history``).
    """

    def __init__(self, engine: Engine, tokenizer: Tokenizer, parser: ToolParser, *,
                 max_tokens: int | None, max_turns: int, offload_chars: int,
                 abort_timeout_s: float, check_integrity: bool = True,
                 processor: VisionProcessor | None = None) -> None:
        self.engine = engine
        self.processor = processor
        self.check_integrity = check_integrity
        self.abort_timeout_s = abort_timeout_s
        self.tokenizer = tokenizer
        self.parser = parser
        self.max_tokens = max_tokens
        self.max_turns = max_turns
        self.offload_chars = offload_chars
        self.max_model_len: int | None = getattr(engine, "max_model_len", None)
        self.routes_sessions = bool(getattr(engine, "routes_sessions", False))
        """The engine takes ``route=`` (sticky routing over several servers)."""
        self._logprobs = TokenLogprobs(tokenizer)

    async def run(self, session: Session, request: ChatCompletionRequest, *,
                  offload: bool = False,
                  constraints: Constraints | None = None) -> TurnOutcome:
        """Serve ``request`` in ``session`` (see the module doc).

        ``offload``: match the messages in a worker thread (a large request).
        ``constraints``: decoding constraints the engine declared it enforces (passed to its
        ``generate`` as ``constraints=``).

        Raises:
            FinalError: the session is completed, or used up its requests or its response
                budget (404, final).
            ProxyRequestError: a message is invalid, or the prompt does not fit the context.
            ProxyError: the engine failed (502) or aborted the request (503).
        """
        received, start = time.time(), time.perf_counter()
        async with session.lock:
            queued = time.perf_counter()
            if session.state != "active":
                raise FinalError(f"session {session.id!r} is completed",
                                 code="session_completed")
            if session.requests >= self.max_turns:
                session.ended = session.ended or "max_turns"
                raise FinalError(f"session {session.id!r} reached its limit of "
                                 f"{self.max_turns} requests", code="too_many_turns")
            session.requests += 1
            session.touch()
            history = session.history
            options = request.chat_template_kwargs
            if offload:
                match = await asyncio.to_thread(history.match, request.messages,
                                                request.tool_schemas, options)
            else:
                match = history.match(request.messages, request.tool_schemas, options)
            vision = self.processor
            if vision is not None and new_images(match):  # decoding and patching: CPU work
                plan = await vision.submit(history.render, match, vision)
            elif offload or match.render_chars() > self.offload_chars:
                plan = await asyncio.to_thread(history.render, match, vision)
            else:
                plan = history.render(match, vision)
            rendered = time.perf_counter()
            sampling, binding = self._sampling(session, request, plan)
            if sampling is None:
                self._end_on_budget(session, plan)
            request_id = f"{session.id}-{session.requests}"
            if constraints is not None:  # the model's call format, as the parser reads it
                constraints = dataclasses.replace(
                    constraints,
                    call_format=getattr(self.parser, "tool_parser_name", None) or "hermes",
                    reasoning=getattr(self.parser, "reasoning_parser_name", None) is not None)
            gen = await self._generate(session, request_id, plan.prompt_ids, sampling,
                                       constraints, plan.inputs)
            generated = time.perf_counter()
            if self.check_integrity:
                gen = self._check(session, plan, gen)
            outcome = self._commit(session, request, plan, gen, sampling, request_id)
            if constraints is not None and outcome.turn is not None:
                outcome.turn.constraints = tuple(sorted(constraints.features))
            if binding == "response_budget" and gen.finish_reason is FinishReason.LENGTH:
                seg = session.history.segments[outcome.turn.segment] if outcome.turn else None
                if seg is not None:
                    seg.raw_finish_reason = "response_budget"
            assert outcome.turn is not None
            outcome.turn.timings = {
                "received_at": received, "queued_s": queued - start,
                "render_s": rendered - queued, "engine_s": generated - rendered,
                "total_s": time.perf_counter() - start}
            session.touch()
            return outcome

    @staticmethod
    def _check(session: Session, plan: TurnPlan, gen: Generation) -> Generation:
        """The prefix and logprobs checks of a turn; a failure is recorded on the session,
        and logprobs are aligned with the tokens so that the record stays well formed."""
        turn = len(session.turns)
        seg = plan.match.segment
        if seg is not None:  # a merge: the prompt extends the segment's whole sequence
            bad = integrity.prefix_mismatch(seg.sequence(), plan.prompt_ids)
            if bad is not None:
                session.integrity_failed(integrity.PREFIX, turn, bad)
        bad = integrity.logprobs_mismatch(gen.token_ids, gen.logprobs)
        if bad is not None:
            session.integrity_failed(integrity.LOGPROBS, turn, bad)
            n = len(gen.token_ids)
            gen = dataclasses.replace(gen, logprobs=[*gen.logprobs[:n],
                                                     *[0.0] * (n - len(gen.logprobs))])
        return gen

    @staticmethod
    def _end_on_budget(session: Session, plan: TurnPlan) -> NoReturn:
        """The response budget is spent before this turn: end the segment, refuse finally."""
        session.ended = "response_budget"
        seg = plan.match.segment
        if seg is not None:
            seg.finish_reason, seg.raw_finish_reason = FinishReason.LENGTH, "response_budget"
        raise FinalError(f"session {session.id!r} spent its response budget of "
                         f"{session.sampling.max_response_tokens} tokens",
                         code="response_budget_exhausted")

    def _sampling(self, session: Session, request: ChatCompletionRequest,
                  plan: TurnPlan) -> tuple[SamplingParams, str | None] | tuple[None, None]:
        """The turn's sampling, and the limit that bound its ``max_tokens`` (None: the
        per-turn cap); ``(None, None)`` when the response budget is spent."""
        base = session.sampling
        asked = request.max_completion_tokens or request.max_tokens
        if asked is None:
            max_tokens = base.max_tokens
        else:
            max_tokens = min(asked, base.max_tokens) if session.lock_sampling else asked
        if self.max_tokens is not None:
            max_tokens = min(max_tokens, self.max_tokens)
        binding: str | None = None
        prompt_len = len(plan.prompt_ids)
        if self.max_model_len is not None:
            room = self.max_model_len - prompt_len
            if room <= 0:  # OpenAI's wording, which clients recognise as a context error
                raise ProxyRequestError(
                    f"This model's maximum context length is {self.max_model_len} tokens; "
                    f"the prompt has {prompt_len} tokens", param="messages",
                    code="context_length_exceeded")
            if room < max_tokens:
                max_tokens, binding = room, "context"
        if base.max_response_tokens is not None:
            seg = plan.match.segment
            used = 0 if seg is None else len(seg.response_ids) + len(plan.template_ids)
            left = base.max_response_tokens - used
            if left <= 0:
                return None, None
            if left <= max_tokens:
                max_tokens, binding = left, "response_budget"
        update: dict[str, Any] = {"max_tokens": max_tokens}
        if not session.lock_sampling:
            for name in ("temperature", "top_p", "seed"):
                value = getattr(request, name)
                if value is not None:
                    update[name] = value
        stop_ids = [ids[0] for ids in (self.tokenizer.encode(s, add_special_tokens=False)
                                       for s in request.stops) if len(ids) == 1]
        if stop_ids:
            update["stop_token_ids"] = tuple(dict.fromkeys([*base.stop_token_ids, *stop_ids]))
        return base.model_copy(update=update), binding

    async def _generate(self, session: Session, request_id: str, prompt: list[int],
                        sampling: SamplingParams, constraints: Constraints | None = None,
                        images: Any = None) -> Generation:
        session.inflight.add(request_id)
        # optional keywords, passed only when used: engines of one's own need neither
        extra: dict[str, Any] = {}
        if constraints is not None:  # an engine that declared it enforces them (``_policy``)
            extra["constraints"] = constraints
        if images:  # the pixel inputs of every image in the prompt, in order
            extra["multi_modal"] = images
        if self.routes_sessions:  # one server's prefix cache for the session and its group
            extra["route"] = session_route(session)
        try:
            generate: Any = self.engine.generate
            gen: Generation = await generate(prompt, sampling, request_id, **extra)
        except asyncio.CancelledError:  # the client went away, or the session was deleted
            await abort_request(self.engine, request_id, self.abort_timeout_s,
                                session=session.id)
            raise
        except EngineError as exc:
            raise ProxyError(f"the engine failed: {exc}", status=502,
                             code="engine_error") from exc
        finally:
            session.inflight.discard(request_id)
        if gen.finish_reason is FinishReason.ABORT:
            raise ProxyError("the engine aborted the request; retry it", status=503,
                             code="engine_aborted")
        return gen

    def _commit(self, session: Session, request: ChatCompletionRequest, plan: TurnPlan,
                gen: Generation, sampling: SamplingParams, request_id: str) -> TurnOutcome:
        tokens, logprobs = list(gen.token_ids), list(gen.logprobs)
        if len(logprobs) != len(tokens):  # with the integrity checks off (they align them)
            raise ProxyError(f"the engine returned {len(logprobs)} logprobs for {len(tokens)} "
                             "sampled tokens", status=502, code="engine_error")
        text = decode_text(self.tokenizer, tokens, skip_special_tokens=True)
        if self.check_integrity and gen.text is not None:
            bad = integrity.decode_mismatch(text, gen.text)
            if bad is not None:
                session.integrity_failed(integrity.DECODE, len(session.turns), bad)
        finish, stop_string = gen.finish_reason, None
        if request.stop:
            cut = self._cut(tokens, text, request.stops)
            if cut is not None:
                kept, text, stop_string = cut
                tokens, logprobs, finish = tokens[:kept], logprobs[:kept], FinishReason.STOP
        turn_index = len(session.turns)
        reply, agent_finish = self._reply(request, text, tokens, logprobs, finish, turn_index,
                                          session.history.end_token_ids)
        match = plan.match
        seg = session.history.commit(plan, reply, turn_index)
        seg.raw_finish_reason = "stop_string" if stop_string is not None else gen.raw_finish_reason
        if gen.policy_version is not None:
            seg.policy_version = gen.policy_version
        if gen.routed_experts is not None:
            seg.routed_experts = gen.routed_experts
        turn = Turn(
            index=turn_index, request_id=request_id, segment=seg.index,
            merged=match.segment is not None,
            split_reason=None if match.segment is not None else match.reason,
            message_count=len(seg.entries) - 1, prompt_len=len(plan.prompt_ids),
            template_tokens=len(plan.template_ids), reused_tokens=plan.reused_tokens,
            reply=reply,
            finish_reason=agent_finish, raw_finish_reason=seg.raw_finish_reason,
            drift=plan.drift, stop_string=stop_string,
            request={"model": request.model, "temperature": request.temperature,
                     "top_p": request.top_p,
                     "max_tokens": request.max_completion_tokens or request.max_tokens,
                     "seed": request.seed, "stop": request.stops,
                     "stream": bool(request.stream),
                     "tool_choice": request.choice},
            sampling=sampling.model_dump(mode="json"), policy_version=gen.policy_version,
            images=tuple(plan.new_images.summary()) if plan.new_images else ())
        session.turns.append(turn)
        entries = self._logprobs.entries(tokens, logprobs) if request.logprobs else None
        return TurnOutcome(reply, agent_finish, len(plan.prompt_ids), plan.reused_tokens,
                           entries, turn)

    def _cut(self, tokens: list[int], text: str,
             stops: list[str]) -> tuple[int, str, str] | None:
        """``(tokens kept, text before the stop, stop string)`` at the first stop string."""
        found = [(text.find(s), s) for s in stops if s in text]
        if not found:
            return None
        at, stop = min(found)
        low, high = 1, len(tokens)  # fewest tokens whose text holds the stop string
        while low < high:
            mid = (low + high) // 2
            if stop in self.tokenizer.decode(tokens[:mid], skip_special_tokens=True)[
                    :at + len(stop)]:
                high = mid
            else:
                low = mid + 1
        return low, text[:at], stop

    def _reply(self, request: ChatCompletionRequest, text: str, tokens: list[int],
               logprobs: list[float], finish: FinishReason, turn: int,
               end_token_ids: frozenset[int]) -> tuple[AgentMessage, str]:
        agent_finish = "length" if finish is FinishReason.LENGTH else "stop"
        wants_calls = bool(request.tools) and request.choice != "none"
        reads_reasoning = getattr(self.parser, "reasoning_parser_name", None) is not None
        if finish is not FinishReason.STOP or not (wants_calls or reads_reasoning):
            return AgentMessage(role="assistant", content=text, token_ids=tokens,
                                logprobs=logprobs, finish_reason=finish), agent_finish
        # a stop-string cut leaves no closing token at the end
        closed = bool(tokens) and tokens[-1] in end_token_ids
        parsed, content = read_turn(self.parser, self.tokenizer, text, tokens, closed=closed)
        extra: dict[str, Any] = {}
        if parsed.reasoning is not None:
            extra["reasoning_content"] = parsed.reasoning
        if not wants_calls or not parsed.calls:
            if parsed.calls:  # calls without tools offered: the text as the model wrote it
                content, extra = text, {}
            return AgentMessage(role="assistant", content=content, token_ids=tokens,
                                logprobs=logprobs, finish_reason=finish, **extra), agent_finish
        errors = {f"call_{turn}_{i}": c.error for i, c in enumerate(parsed.calls)
                  if c.error is not None}
        strict = _strict_schemas(request)
        for i, c in enumerate(parsed.calls):
            schema = strict.get(c.name or "")
            if c.error is None and schema is not None:
                problems = validate_arguments(schema, c.arguments)
                if problems:  # a strict tool: the agent never gets a call off its schema
                    errors[f"call_{turn}_{i}"] = "; ".join(problems)
        if errors:  # an unreadable call: the agent gets the text as the model wrote it
            return AgentMessage(role="assistant", content=text, token_ids=tokens,
                                logprobs=logprobs, finish_reason=finish,
                                **{TOOL_CALL_ERRORS: errors}), agent_finish
        calls = [c.to_tool_call(f"call_{turn}_{i}") for i, c in enumerate(parsed.calls)]
        return AgentMessage(role="assistant", content=parsed.content or None, tool_calls=calls,
                            token_ids=tokens, logprobs=logprobs, finish_reason=finish,
                            **extra), "tool_calls"


def _strict_schemas(request: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """The parameter schemas of the request's ``strict`` function tools, by name."""
    out: dict[str, dict[str, Any]] = {}
    for tool in request.tools or ():
        extra = tool.function.model_extra or {}
        if extra.get("strict") is True:
            schema = extra.get("parameters")
            out[tool.function.name] = schema if isinstance(schema, dict) else {}
    return out
