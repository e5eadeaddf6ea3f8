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
