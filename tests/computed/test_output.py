"""OutputText: streamed text never shows a stop string and equals the one-shot text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from computed.output import OutputText


class CharDecoder:
    """Each token id is one character (its code point): enough to test the text logic."""

    def push(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


def stream(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    out = OutputText(CharDecoder(), stop)
    pieces, stopped = [], False
    for ch in text:
        piece, stopped = out.push(ord(ch))
        pieces.append(piece)
        if stopped:
            break
    pieces.append(out.finish(stopped))
    return "".join(pieces), stopped


def test_stop_string_is_cut_and_not_returned():
    assert stream("hello world. bye", ("world",)) == ("hello ", True)


def test_no_stop_returns_everything():
    assert stream("abc", ("zz",)) == ("abc", False)


def test_text_is_held_back_until_it_cannot_start_a_stop_string():
    out = OutputText(CharDecoder(), ("END",))
    assert out.push(ord("a")) == ("", False)
    assert out.push(ord("E")) == ("", False)
    assert out.push(ord("x")) == ("a", False)
    assert out.finish(False) == "Ex"


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="abcE", max_size=40),
    st.lists(st.text(alphabet="abcE", min_size=1, max_size=4), max_size=3),
)
def test_streaming_equals_one_shot(text, stops):
    got, stopped = stream(text, tuple(stops))
    want, want_stopped = text, False
    for k in range(1, len(text) + 1):  # the first stop string to COMPLETE ends the text
        hits = [i for i in (text[:k].find(s) for s in stops) if i >= 0]
        if hits:
            want, want_stopped = text[: min(hits)], True
            break
    assert (got, stopped) == (want, want_stopped)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abcé€", max_size=30), st.lists(st.booleans(), max_size=30), st.booleans())
def test_deferred_tokens_give_the_same_text(text, defers, stopped):
    """A token pushed with defer=True (its chunk held back) gets its text with the next
    undeferred push or at finish, also when the request ends early: the same text in total."""
    out = OutputText(CharDecoder(), ())
    pieces = []
    for i, ch in enumerate(text):
        piece, hit = out.push(ord(ch), defer=i < len(defers) and defers[i])
        assert not hit
        pieces.append(piece)
    pieces.append(out.finish(stopped))
    assert "".join(pieces) == text


def test_stop_strings_decode_every_token_even_when_deferred():
    out = OutputText(CharDecoder(), ("b",))
    assert out.push(ord("a"), defer=True) == ("a", False)
    assert out.push(ord("b"), defer=True) == ("", True)


def test_incremental_decoder_many_ids_at_once_equals_one_each():
    import random

    from computed.config import DEFAULT_MODEL_DIR
    from computed.model.tokenizer import IncrementalDecoder, Tokenizer

    tokenizer = Tokenizer(DEFAULT_MODEL_DIR)
    rng = random.Random(5)
    ids = [
        rng.randrange(3, tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 4096)
        for _ in range(50)
    ]
    one_each = IncrementalDecoder(tokenizer)
    want = "".join(one_each.push(i) for i in ids) + one_each.flush()
    grouped = IncrementalDecoder(tokenizer)
    got = "".join(grouped.push_many(ids[k : k + 7]) for k in range(0, len(ids), 7)) + grouped.flush()
    assert got == want == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_silent_stop_token_adds_no_text_of_its_own():
    """The token that ended a completion (EOS, a stop token id) is dropped from the text, as
    vLLM drops it; what came before it is emitted, and with stop strings set, the text held
    back for them comes out at the finish."""
    out = OutputText(CharDecoder(), ())
    assert out.push(ord("a")) == ("a", False)
    assert out.push(ord("!"), silent=True) == ("", False)
    assert out.finish(False) == ""
    held = OutputText(CharDecoder(), ("END",))
    pieces = [held.push(ord(c))[0] for c in "abE"]
    pieces.append(held.push(ord("!"), silent=True)[0])
    pieces.append(held.finish(False))
    assert "".join(pieces) == "abE"
    deferred = OutputText(CharDecoder(), ())
    assert deferred.push(ord("x"), defer=True) == ("", False)
    assert deferred.push(ord("!"), silent=True) == ("x", False)  # the deferred text still leaves
