"""Rendering shortcuts, each proven equal to the slow path on the real tokenizer.

The turn-delta shortcut: after an added token that strips no whitespace, the real tokenizer
tokenizes what follows the same with or without that token, so the boundary check's second
encode can be skipped; a token that may strip whitespace is still checked. ``decode_text``
goes straight to the Rust tokenizer only where ``decode`` would give the same text, and
``encode_text`` only where ``encode`` would give the same ids."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline._text.render import (
    _splits_cleanly_after,
    decode_text,
    encode_text,
    plain_fast_backend,
)
from pipeline.testing import ByteTokenizer

pytest_plugins = ["_model_fixtures"]

TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_text_after_a_clean_added_token_tokenizes_alone(tiny_tokenizer, text):
    for token_id, added in tiny_tokenizer.added_tokens_decoder.items():
        assert _splits_cleanly_after(tiny_tokenizer, token_id)
        with_token = tiny_tokenizer.encode(added.content + text, add_special_tokens=False)
        alone = tiny_tokenizer.encode(text, add_special_tokens=False)
        assert with_token == [token_id, *alone]


def test_ordinary_tokens_and_stripping_tokens_are_still_checked(tiny_model_dir):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ordinary = tokenizer.encode("hello", add_special_tokens=False)[0]
    assert not _splits_cleanly_after(tokenizer, ordinary)
    tokenizer.add_tokens([AddedToken("<strip>", rstrip=True)])
    stripping = tokenizer.convert_tokens_to_ids("<strip>")
    # It eats the whitespace after it: the shortcut would be wrong, so it is not taken.
    assert tokenizer.encode("<strip>  x", add_special_tokens=False) != [
        stripping, *tokenizer.encode("  x", add_special_tokens=False)]
    assert not _splits_cleanly_after(tokenizer, stripping)


IDS = st.lists(st.integers(min_value=0, max_value=1030), max_size=64)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=IDS, skip=st.booleans())
def test_decode_text_equals_decode(tiny_tokenizer, ids, skip):
    assert plain_fast_backend(tiny_tokenizer) is not None  # the shortcut is taken here
    assert decode_text(tiny_tokenizer, ids, skip_special_tokens=skip) == tiny_tokenizer.decode(
        ids, skip_special_tokens=skip)


def test_decode_text_leaves_other_tokenizers_to_their_decode(tiny_model_dir):
    from transformers import AutoTokenizer

    cleaning = AutoTokenizer.from_pretrained(tiny_model_dir)
    cleaning.clean_up_tokenization_spaces = True
    assert plain_fast_backend(cleaning) is None

    class Overriding(type(cleaning)):  # type: ignore[misc]
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "overridden"

    custom = AutoTokenizer.from_pretrained(tiny_model_dir)
    custom.__class__ = Overriding
    assert decode_text(custom, [5, 6], skip_special_tokens=True) == "overridden"
    byte = ByteTokenizer()
    ids = byte.encode("héllo")
    assert decode_text(byte, ids, skip_special_tokens=True) == "héllo"


SPECIAL_TEXT = st.lists(st.one_of(TEXT, st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "assistant\n"])), max_size=6)


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=SPECIAL_TEXT)
def test_encode_text_equals_encode(tiny_tokenizer, parts):
    text = "".join(parts)
    assert plain_fast_backend(tiny_tokenizer, encoding=True) is not None  # the shortcut
    assert encode_text(tiny_tokenizer, text) == tiny_tokenizer.encode(
        text, add_special_tokens=False)


def test_encode_text_leaves_other_tokenizers_to_their_encode(tiny_model_dir):
    from transformers import AutoTokenizer

    splitting = AutoTokenizer.from_pretrained(tiny_model_dir)
    splitting.split_special_tokens = True  # encode then splits "<|im_end|>" into pieces
    assert plain_fast_backend(splitting, encoding=True) is None
    assert encode_text(splitting, "<|im_end|>") == splitting.encode(
        "<|im_end|>", add_special_tokens=False)
    byte = ByteTokenizer()
    assert encode_text(byte, "héllo") == byte.encode("héllo")
