"""Token-exact session history: turns merge into one token sequence; rewrites split it.

A black-box agent sends its whole conversation with every request, earlier model replies
included, as text. Rendering those again would re-tokenize model output, and the tokens would
no longer be the ones the model sampled. So a session keeps, per *segment*, the token sequence
it built (prompt ids, then response ids with a mask and logprobs) and the messages it stands
for. A request whose messages start with a segment's messages *extends* it: only the new
messages are rendered, as the chat template's delta after the model's last token
(:func:`pipeline.stages._prompt.render_turn_delta`, mask 0), and the model's reply is appended
with mask 1. A request that does not extend any segment (the agent summarised, dropped or
edited turns, retried a request, or changed its tools) starts a new segment. The new segment's
prompt reuses the recorded tokens of the longest matching prefix that ends on a model reply
(so earlier model output is still never re-tokenized, only moved into the prompt), and renders
the rest. Every new segment after the first is a *split*, counted with its reason, except
a *second conversation*: a request whose first message no segment starts with (an agent that
runs a sub-agent in the same session, e.g. openai-agents' agent-as-tool, whose instructions
differ) starts a segment of a new ``conversation`` (reason ``conversation``, not a split);
every segment is labelled with the conversation it belongs to, so both trajectories are kept.

Images (a proxy with a vision processor): a new message's image parts (data URLs only) are
decoded and checked, replaced by their reference (hash and size: the record never holds the
bytes), rendered as the template's placeholders and expanded by the processor, exactly as
``BuildPrompt(processor=...)`` does; the segment keeps the pixel inputs of every image in its
sequence, in order, and hands them to the engine with each turn. An image part is compared by
a digest of its URL, so the history sent back matches the recorded turn and its image tokens
are reused, never rendered again.
Messages are compared in a normalised form (:func:`~pipeline.proxy._compare.message_key`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipeline._data.models import AgentMessage
from pipeline._text.render import chat_form, render, render_prompt, render_turn_delta
from pipeline._text.tokenizer import Tokenizer
from pipeline.multimodal import ImageError, MultiModalInputs, VisionProcessor
from pipeline.proxy._compare import message_key, same_tools
from pipeline.proxy._errors import FinalError, ProxyRequestError
from pipeline.proxy._segments import (
    NEW_CONVERSATION,
    SPLIT_EDITED,
    SPLIT_REASONS,
    SPLIT_RETRY,
    SPLIT_START,
    SPLIT_TOOLS,
    SPLIT_TRUNCATED,
    Entry,
    Match,
    Segment,
    TurnPlan,
    new_images,
)
from pipeline.proxy._wire import WireMessage, parse_message


class History:
    """The segments of one session and the logic that merges and splits them.

    Args:
        tokenizer: the tokenizer with the chat template (the engine's).
        eos_token_id: the template's end-of-turn token; default ``tokenizer.eos_token_id``.
            A reply that did not end on it or on one of ``stop_token_ids`` (length, stop
            string) gets it added as a template token (mask 0) before the next turn's delta.
        stop_token_ids: other tokens that end a turn (the session's sampling stop ids, a
            model family's: gpt-oss's ``<|call|>``, Llama 3.1's ``<|eom_id|>``); the next
            delta follows them as it follows the eos.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_id: int | None = None,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
        self.end_token_ids = frozenset(
            [*stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])])
        """Tokens that close a turn: the eos and the stop ids."""
        self.segments: list[Segment] = []
        self.splits: dict[str, int] = {}
        self.current: Segment | None = None
        """The segment of the latest turn."""
        self.last_message_count = 0
        """How many messages the latest turn's request had (tells a retry apart)."""

    # ----- matching (cheap; on the event loop) --------------------------------------------

    def match(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
              options: dict[str, Any] | None = None) -> Match:
        """Find the segment ``messages`` extend, or how a new segment would start. A segment
        rendered with other tools or chat-template ``options`` is never extended.

        A new segment's reason and reused prefix come from the segment sharing the longest
        prefix with ``messages`` (the latest one on ties).

        Raises:
            ProxyRequestError: a message that has to be compared or rendered is invalid.
        """
        found = self._match(messages, tools, options or {})
        found.options = options or {}
        return found

    def _match(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               options: dict[str, Any]) -> Match:
        order = [self.current] if self.current is not None else []
        order += [s for s in reversed(self.segments) if s is not self.current]
        base, common = None, -1
        for segment in order:
            if not same_tools(segment.tools, tools) or segment.options != options:
                continue
            count = len(segment.entries)
            shared = self._common(messages, segment.entries, min(len(messages), count))
            if shared == count:
                return Match(messages, tools, segment, new=_validated(messages, count),
                             conversation=segment.conversation)
            if shared > common:
                base, common = segment, shared
        if base is None or common == 0:
            if not self.segments:
                return Match(messages, tools, None, SPLIT_START, new=_validated(messages, 0))
            sibling = next((s for s in order if self._common(messages, s.entries, 1) == 1),
                           None)
            if sibling is None:  # no segment starts like this: another conversation
                return Match(messages, tools, None, NEW_CONVERSATION,
                             new=_validated(messages, 0),
                             conversation=max(s.conversation for s in self.segments) + 1)
            if base is None:
                return Match(messages, tools, None, SPLIT_TOOLS, new=_validated(messages, 0),
                             conversation=sibling.conversation)
        at: int | None = None
        if common < len(messages):
            reason, at = SPLIT_EDITED, common
        elif base is self.current and common == self.last_message_count:
            reason = SPLIT_RETRY
        else:
            reason = SPLIT_TRUNCATED
        keep = next((i + 1 for i in range(common - 1, -1, -1)
                     if base.entries[i].end is not None), 0)
        return Match(messages, tools, None, reason, at, base if keep else None, keep,
                     _validated(messages, keep), base.conversation)

    @staticmethod
    def _common(messages: list[dict[str, Any]], entries: list[Entry], limit: int) -> int:
        """How many leading messages match the entries (up to ``limit``)."""
        for i in range(limit):
            raw, entry = messages[i], entries[i]
            if raw == entry.echo:
                continue
            if message_key(parse_message(raw, i)) != entry.key:
                return i
            entry.echo = raw
        return limit

    # ----- rendering (template work; may run in a worker thread) ---------------------------

    def render(self, match: Match, vision: VisionProcessor | None = None) -> TurnPlan:
        """Render what ``match`` needs: the delta for a merge, the prompt for a new segment.
        New messages' images are loaded and expanded by ``vision`` (CPU work: with images,
        call this in the processor's worker thread, see :func:`new_images`).

        Raises:
            FinalError: an image part without a vision processor, or one that is refused
                (not a data URL, not an image, over ``ImageLimits``), naming the part.
            ProxyRequestError: the chat template could not render the messages.
        """
        new_entries = [Entry(w.to_agent_message(), message_key(w), raw) for w, raw in match.new]
        images = self._load_images(match, new_entries, vision)
        new_messages = [e.message for e in new_entries]
        try:
            if match.segment is not None:
                seg = match.segment
                ids, drift, added = self._delta(seg.entries, seg.anchor, new_messages, match,
                                                seg.response_ids[-1:] or seg.prompt_ids[-1:],
                                                images, vision)
                return TurnPlan(match, ids, seg.sequence() + ids, len(seg), None, drift,
                                new_entries, _joined(seg.images, added), added,
                                seg.image_ends + _ends(ids, len(seg), added, vision))
            if match.base is not None:
                kept = match.base.entries[:match.keep]
                end = kept[-1].end
                assert end is not None
                prefix = match.base.sequence()[:end]
                anchor = next((e.message for e in reversed(kept) if e.message.role == "user"),
                              None)
                ids, drift, added = self._delta(kept, anchor, new_messages, match, prefix[-1:],
                                                images, vision)
                reused = [Entry(e.message, e.key, e.echo, e.end, e.closed) for e in kept]
                kept_ends = tuple(e for e in match.base.image_ends if e <= end)
                before = (match.base.images.first(len(kept_ends))
                          if match.base.images and kept_ends else None)
                return TurnPlan(match, ids, prefix + ids, end, None, drift,
                                reused + new_entries, _joined(before, added), added,
                                kept_ends + _ends(ids, end, added, vision))
            if images:
                assert vision is not None
                text = render(self.tokenizer, [chat_form(m) for m in new_messages],
                              match.tools, add_generation_prompt=True, options=match.options)
                expanded = vision.expand(text, images)
                return TurnPlan(match, expanded.ids, expanded.ids, 0, text, (), new_entries,
                                expanded.inputs, expanded.inputs,
                                _ends(expanded.ids, 0, expanded.inputs, vision))
            text, ids = render_prompt(self.tokenizer, [chat_form(m) for m in new_messages],
                                      match.tools, match.options)
            return TurnPlan(match, ids, ids, 0, text, (), new_entries)
        except ProxyRequestError:
            raise
        except ImageError as exc:  # the processor found the placeholders wrong
            raise FinalError(str(exc), param=exc.field or "messages",
                             code="invalid_image") from None
        except Exception as exc:  # a template that cannot render these messages
            raise ProxyRequestError(f"the chat template could not render the messages: "
                                    f"{type(exc).__name__}: {exc}", param="messages",
                                    code="template_error") from exc

    def _delta(self, entries: Sequence[Entry], anchor: AgentMessage | None,
               new_messages: list[AgentMessage], match: Match, last: list[int],
               images: list[Any], vision: VisionProcessor | None
               ) -> tuple[list[int], tuple[str, ...], MultiModalInputs | None]:
        """Template tokens after the model turn ``entries[-1]`` up to the next generation,
        and the inputs of the images among them (placeholders expanded by ``vision``)."""
        reply = entries[-1]
        context = [anchor, reply.message] if anchor is not None else [reply.message]
        tools, options = match.tools, match.options
        closed = reply.closed and bool(last)
        if closed or self.eos_token_id is None:  # else the eos is added before the delta
            after = last[0] if closed else -1
        else:
            after = self.eos_token_id
        delta = render_turn_delta(self.tokenizer, context, new_messages, tools, after, options)
        ids, added = delta.ids, None
        if images:
            assert vision is not None
            expanded = vision.expand(delta.text, images)
            ids, added = expanded.ids, expanded.inputs
        return ([*ids] if closed or self.eos_token_id is None
                else [self.eos_token_id, *ids]), delta.drift, added

    @staticmethod
    def _load_images(match: Match, entries: list[Entry],
                     vision: VisionProcessor | None) -> list[Any]:
        """Decode and check the new messages' images, and put each one's reference (hash and
        size) in its entry's message in place of the image."""
        if not new_images(match):
            return []
        first = len(match.messages) - len(match.new)
        if vision is None:
            where = next(f"messages.{first + i}.content.{j}"
                         for i, (w, _) in enumerate(match.new) for j, _ in w.image_parts())
            raise FinalError(f"{where}: image parts are not served: this proxy has no vision "
                             "processor (ProxyServer(processor=...))", param=f"{where}.type",
                             code="unsupported_parameter")
        dumped = [e.message.model_dump(exclude_none=True) for e in entries]
        try:
            kept, images = vision.load_messages(dumped, first=first)
        except ImageError as exc:
            raise FinalError(str(exc), param=exc.field, code="invalid_image") from None
        for entry, message, (wire, _) in zip(entries, kept, match.new, strict=True):
            if wire.image_parts():
                entry.message = entry.message.model_copy(update={"content": message["content"]})
        return images

    # ----- committing (after the engine answered) ----------------------------------------

    def commit(self, plan: TurnPlan, reply: AgentMessage, turn: int) -> Segment:
        """Append the plan's template tokens and the model's reply; returns the segment.

        ``reply`` carries the sampled ``token_ids`` and ``logprobs`` (mask 1).
        """
        match = plan.match
        seg = match.segment
        if seg is None:
            seg = Segment(index=len(self.segments), reason=match.reason or SPLIT_START,
                          at_message=match.at_message, tools=match.tools,
                          prompt_ids=list(plan.prompt_ids), reused_tokens=plan.reused_tokens,
                          raw_prompt=plan.raw_prompt, entries=list(plan.new_entries),
                          conversation=match.conversation, options=match.options)
            self.segments.append(seg)
            seg.images, seg.image_ends = plan.inputs, plan.image_ends
            if seg.reason in SPLIT_REASONS:
                self.splits[seg.reason] = self.splits.get(seg.reason, 0) + 1
            anchors = plan.new_entries
        else:
            ids = plan.template_ids
            seg.response_ids.extend(ids)
            seg.response_mask.extend([0] * len(ids))
            seg.logprobs.extend([0.0] * len(ids))
            seg.entries.extend(plan.new_entries)
            seg.images, seg.image_ends = plan.inputs, plan.image_ends
            if any(e.message.role == "tool" for e in plan.new_entries):
                seg.tool_turns += 1
            anchors = plan.new_entries
        seg.drift += bool(plan.drift)
        for entry in reversed(anchors):
            if entry.message.role == "user":
                seg.anchor = entry.message
                break
        tokens = reply.token_ids or []
        seg.response_ids.extend(tokens)
        seg.response_mask.extend([1] * len(tokens))
        seg.logprobs.extend(reply.logprobs or [])
        closed = bool(tokens) and tokens[-1] in self.end_token_ids
        seg.entries.append(Entry(reply, message_key(reply), None, len(seg), closed))
        seg.turns.append(turn)
        seg.finish_reason = reply.finish_reason
        self.current = seg
        self.last_message_count = len(match.messages)
        return seg


def _joined(before: MultiModalInputs | None,
            added: MultiModalInputs | None) -> MultiModalInputs | None:
    """The images of a prompt: those of the reused sequence, then the turn's own."""
    if not added:
        return before or None
    return before.plus(added) if before else added


def _ends(ids: list[int], offset: int, added: MultiModalInputs | None,
          vision: VisionProcessor | None) -> tuple[int, ...]:
    """Where each image of ``added`` ends in a sequence whose ``ids`` (the processor's
    expansion) start at ``offset``: the ends of the runs of image tokens, one per image."""
    if not added or vision is None:
        return ()
    pad = vision.image_token_id
    ends = tuple(offset + i + 1 for i, t in enumerate(ids)
                 if t == pad and (i + 1 == len(ids) or ids[i + 1] != pad))
    if len(ends) != len(added.images):  # the template put two images' tokens side by side
        raise ImageError(f"the rendered turn holds {len(ends)} runs of image tokens for "
                         f"{len(added.images)} images", field="messages")
    return ends


def _validated(messages: list[dict[str, Any]],
               start: int) -> list[tuple[WireMessage, dict[str, Any]]]:
    return [(parse_message(messages[i], i), messages[i]) for i in range(start, len(messages))]
