"""The turn-delta shortcut: after an added token that strips no whitespace, the real tokenizer
tokenizes what follows the same with or without that token, so the boundary check's second
encode can be skipped; a token that may strip whitespace is still checked."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline._render import _splits_cleanly_after

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
