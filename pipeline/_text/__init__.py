"""Text rendering and tokenizing: the tokenizer protocol, chat-template rendering of prompts
and turn deltas, and batched encoding off the event loop. Private: users import from
:mod:`pipeline` and :mod:`pipeline.stages`."""
