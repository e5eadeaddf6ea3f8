"""PrefixLeaders' credit for a new admission: the committed prefix it shares with a known
sequence, however the known sequences are ordered and however much they share."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from computed.prefix_wait import MAX_KNOWN_PER_KEY, PrefixLeaders
from computed.sequence import SamplingParams, Sequence

BLOCK = 4


def _seq(sid: int, tokens: list[int], committed: int = 0) -> Sequence:
    seq = Sequence(sid, list(tokens), SamplingParams(), BLOCK)
    seq.token_ids = list(tokens)
    seq.num_committed_blocks = committed
    return seq


def _common(a: list[int], b: list[int]) -> int:
    blocks = 0
    while (blocks + 1) * BLOCK <= min(len(a), len(b)) and a[: (blocks + 1) * BLOCK] == b[
        : (blocks + 1) * BLOCK
    ]:
        blocks += 1
    return blocks


# Token lists over a tiny alphabet with a common first block, so they share prefixes of
# every length and part anywhere.
_tokens = st.lists(st.integers(0, 1), min_size=0, max_size=6 * BLOCK).map(lambda t: [9] * BLOCK + t)


@settings(max_examples=200, deadline=None)
@given(
    known=st.lists(st.tuples(_tokens, st.integers(0, 7)), min_size=1, max_size=MAX_KNOWN_PER_KEY), new=_tokens
)
def test_credit_is_the_longest_committed_common_prefix(known, new) -> None:
    leaders = PrefixLeaders(BLOCK)
    entries = []
    for sid, (tokens, committed) in enumerate(known, start=1):
        committed = min(committed, len(tokens) // BLOCK)
        entries.append((tokens, committed))
        leaders.add_running(_seq(sid, tokens, committed))
    want = max(
        (min(_common(new, tokens), committed) for tokens, committed in entries if committed > 0), default=0
    )
    assert leaders.known_committed_blocks(_seq(99, new)) == want


def test_followers_admitted_together_are_credited_with_the_leaders_prefix() -> None:
    """63 followers behind one leader (the shared workload's shape): each admission is
    credited with the committed shared prefix, not with another follower's private tail."""
    leaders = PrefixLeaders(BLOCK)
    shared = [9] * (16 * BLOCK)
    leaders.add_running(_seq(1, shared + [1] * BLOCK, committed=17))
    for sid in range(2, 65):
        follower = _seq(sid, shared + [sid] * BLOCK)
        assert leaders.known_committed_blocks(follower) == 16
        leaders.add_admitted(follower)
        # Another request waits for the block a follower computes, not for the committed prefix.
        assert leaders.should_wait(_seq(100 + sid, shared + [sid] * BLOCK))
        assert not leaders.should_wait(_seq(200 + sid, shared + [1000 + sid] * BLOCK))
