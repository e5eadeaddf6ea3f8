"""GenerateMany end to end: real blockd + real computed, many requests on one stream.

Each key must read exactly what its own Generate call reads (greedy tokens equal to
transformers'), a step's news for several keys must share a message, and a request's
failure or cancellation must stay its own.
"""

from __future__ import annotations

import queue
import threading

import grpc
import pytest

from kvcache.v1 import generation_pb2 as pb
from tests.computed.test_generation import BLOCK, _stack, hf_greedy, prompt


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = _stack(tmp_path_factory, "llama", "--num-blocks", "256")
    yield s
    assert s.computed.stop() == 0, s.computed.log()
    assert s.blockd.stop() == 0, s.blockd.log()


class Session:
    """One GenerateMany call driven from the test: `send` messages, `replies` the answers."""

    def __init__(self, stack) -> None:
        self._outgoing: queue.Queue = queue.Queue()
        self.call = stack.gen.GenerateMany(iter(self._outgoing.get, None), timeout=120)
        self.replies: list[pb.GenerateManyResponse] = []

    def generate(self, key: int, tokens: list[int], n: int, **kw) -> None:
        request = pb.GenerateRequest(prompt_token_ids=tokens, max_tokens=n, ignore_eos=True, **kw)
        self._outgoing.put(pb.GenerateManyRequest(key=key, generate=request))

    def cancel(self, key: int) -> None:
        self._outgoing.put(pb.GenerateManyRequest(key=key, cancel=pb.GenerateCancel()))

    def half_close(self) -> None:
        self._outgoing.put(None)

    def read_until(self, done) -> dict[int, list[pb.GenerateUpdate]]:
        """Read replies until done(updates by key) holds; returns the updates by key."""
        by_key: dict[int, list[pb.GenerateUpdate]] = {}
        for reply in self.call:
            self.replies.append(reply)
            for update in reply.updates:
                by_key.setdefault(update.key, []).append(update)
            if done(by_key):
                return by_key
        return by_key


def _ended(update: pb.GenerateUpdate) -> bool:
    return bool(update.error_code or update.response.finish_reason)


def _all_ended(keys):
    return lambda by_key: all(k in by_key and _ended(by_key[k][-1]) for k in keys)


def _tokens(updates: list[pb.GenerateUpdate]) -> list[int]:
    return [t for u in updates for t in u.response.token_ids]


def test_each_key_reads_what_its_own_generate_reads_with_one_message_per_step(stack):
    prompts = {key: prompt(100 + key, 3 * BLOCK + key) for key in range(1, 9)}
    session = Session(stack)
    for key, tokens in prompts.items():
        session.generate(key, tokens, 12)
    by_key = session.read_until(_all_ended(prompts))
    session.half_close()
    assert list(session.call) == [], "after a half-close and every last update, the stream ends"
    for key, tokens in prompts.items():
        updates = by_key[key]
        assert _tokens(updates) == hf_greedy(stack.model_dir, tokens, 12), f"key {key}"
        assert _tokens(updates) == stack.generate(tokens, 12)[0]
        last = updates[-1].response
        assert last.finish_reason == "length" and last.usage.completion_tokens == 12
        assert all(u.error_code == 0 for u in updates)
        assert sum(1 for u in updates if u.response.finish_reason) == 1, "one last update per key"
    # Generate would send a message per request per step (a slow reader's backlog merged).
    num_updates = sum(len(r.updates) for r in session.replies)
    assert len(session.replies) < num_updates / 2, "a step's news for many keys shares one message"
    assert max(len(r.updates) for r in session.replies) >= 4
    assert all(len({u.key for u in r.updates}) == len(r.updates) for r in session.replies)
    assert stack.wait_idle().num_referenced_blocks == 0


def test_a_refused_request_is_its_own_update_and_the_others_go_on(stack):
    session = Session(stack)
    good = prompt(201, 2 * BLOCK + 1)
    session.generate(1, good, 6)
    session.generate(2, [10**9], 6)  # not a token of the tiny model's vocabulary
    session.generate(3, good, 0)  # max_tokens must be >= 1
    by_key = session.read_until(_all_ended([1, 2, 3]))
    session.half_close()
    list(session.call)
    assert _tokens(by_key[1]) == hf_greedy(stack.model_dir, good, 6)
    for key in (2, 3):
        (update,) = by_key[key]
        assert update.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], update
        assert update.error_message, "the message says what to fix"
    assert "max_tokens" in by_key[3][0].error_message


def test_cancel_ends_one_request_and_releases_its_blocks(stack):
    session = Session(stack)
    long, short = prompt(301, 4 * BLOCK), prompt(302, 2 * BLOCK + 2)
    session.generate(7, long, 200)
    session.read_until(lambda by_key: 7 in by_key)  # its first token: it is running
    session.cancel(7)
    session.generate(8, short, 5)
    by_key = session.read_until(_all_ended([7, 8]))
    assert by_key[7][-1].response.finish_reason == "cancelled"
    assert len(_tokens(by_key[7])) < 200
    assert _tokens(by_key[8]) == hf_greedy(stack.model_dir, short, 5)
    session.cancel(7)  # finished: nothing happens
    session.generate(7, short, 5)  # a finished request's key may be used again
    again = session.read_until(_all_ended([7]))
    assert _tokens(again[7]) == _tokens(by_key[8])
    session.half_close()
    list(session.call)
    assert stack.wait_idle().num_referenced_blocks == 0


def test_a_burst_of_text_prompts_reads_what_each_generate_reads(stack):
    """Text prompts are tokenized together while the reader reads on (AdmissionBatcher):
    each key still reads its own Generate's answer; a cancel sent right behind its
    generate, while the prompt is being tokenized, still cancels it; a key whose
    admission is under way is in use."""
    texts = {
        key: f"burst {key}: " + " ".join(f"w{key * 7 + i}" for i in range(30 + key)) for key in range(1, 13)
    }
    session = Session(stack)
    for key, text in texts.items():
        session._outgoing.put(
            pb.GenerateManyRequest(
                key=key, generate=pb.GenerateRequest(prompt=text, max_tokens=6, ignore_eos=True)
            )
        )
    session._outgoing.put(
        pb.GenerateManyRequest(
            key=20, generate=pb.GenerateRequest(prompt=texts[1], max_tokens=500, ignore_eos=True)
        )
    )
    session.cancel(20)
    by_key = session.read_until(_all_ended([*texts, 20]))
    for key, text in texts.items():
        alone = list(stack.gen.Generate(pb.GenerateRequest(prompt=text, max_tokens=6, ignore_eos=True)))
        assert _tokens(by_key[key]) == [t for r in alone for t in r.token_ids], f"key {key}"
    assert by_key[20][-1].response.finish_reason == "cancelled"
    assert len(_tokens(by_key[20])) < 500
    session._outgoing.put(
        pb.GenerateManyRequest(key=30, generate=pb.GenerateRequest(prompt=texts[2], max_tokens=3))
    )
    session._outgoing.put(
        pb.GenerateManyRequest(key=30, generate=pb.GenerateRequest(prompt=texts[3], max_tokens=3))
    )
    with pytest.raises(grpc.RpcError) as caught:
        session.read_until(lambda by_key: False)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "key 30 is in use" in caught.value.details()
    assert stack.wait_idle().num_referenced_blocks == 0


def test_a_key_in_use_ends_the_stream_with_invalid_argument_and_aborts_its_requests(stack):
    session = Session(stack)
    tokens = prompt(401, 3 * BLOCK)
    session.generate(5, tokens, 200)
    session.read_until(lambda by_key: 5 in by_key)
    session.generate(5, tokens, 4)
    with pytest.raises(grpc.RpcError) as caught:
        session.read_until(lambda by_key: False)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "key 5 is in use" in caught.value.details()
    assert stack.wait_idle().num_referenced_blocks == 0, "the stream's requests were aborted"
    _, usage = stack.generate(tokens, 3)  # the worker serves on
    assert usage.completion_tokens == 3


def test_the_callers_cancel_aborts_every_request_on_the_stream(stack):
    session = Session(stack)
    for key in (1, 2, 3):
        session.generate(key, prompt(500 + key, 3 * BLOCK), 300)
    session.read_until(lambda by_key: len(by_key) == 3)
    session.call.cancel()
    assert stack.wait_idle().num_referenced_blocks == 0


def test_an_undecodable_message_ends_the_stream_with_invalid_argument(stack):
    channel = grpc.insecure_channel(stack.computed.address)
    call = channel.stream_stream(
        "/kvcache.v1.GenerationService/GenerateMany",
        request_serializer=lambda b: b,
        response_deserializer=pb.GenerateManyResponse.FromString,
    )
    # Field 2 (generate) holding a GenerateRequest whose prompt (field 1) is invalid UTF-8.
    bad = b"\x12\x04\x0a\x02\xff\xfe"
    with pytest.raises(grpc.RpcError) as caught:
        list(call(iter([bad]), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in caught.value.details()
    channel.close()


def test_a_message_with_no_action_ends_the_stream_with_invalid_argument(stack):
    session = Session(stack)
    session._outgoing.put(pb.GenerateManyRequest(key=1))
    with pytest.raises(grpc.RpcError) as caught:
        session.read_until(lambda by_key: False)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "generate or cancel" in caught.value.details()


def test_many_streams_at_once_each_get_their_own_answers(stack):
    tokens = {i: prompt(600 + i, 2 * BLOCK + i) for i in range(4)}
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        session = Session(stack)
        session.generate(1, tokens[i], 7)
        by_key = session.read_until(_all_ended([1]))
        session.half_close()
        list(session.call)
        results[i] = _tokens(by_key[1])

    threads = [threading.Thread(target=run, args=(i,)) for i in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {i: results.get(i) for i in tokens} == {
        i: hf_greedy(stack.model_dir, tokens[i], 7) for i in tokens
    }


def test_sigterm_drains_the_streams_requests_refuses_new_ones_and_ends_the_stream(tmp_path_factory):
    import signal
    import time

    own = _stack(tmp_path_factory, "llama", "--num-blocks", "512", "--drain-seconds", "120")
    try:
        idle = Session(own)  # a stream with nothing in flight when the drain begins
        idle.generate(1, prompt(700, BLOCK), 2)
        idle.read_until(_all_ended([1]))
        session = Session(own)
        tokens = prompt(701, 2 * BLOCK + 1)
        session.generate(1, tokens, 1500)  # seconds of decoding: it outlives the steps below
        head = session.read_until(lambda by_key: 1 in by_key)[1]
        own.computed.proc.send_signal(signal.SIGTERM)
        # The idle stream ends as the drain begins (not at the server's grace): from here on
        # computed admits nothing.
        assert list(idle.call) == [], "an idle stream ends cleanly when the drain begins"
        session.generate(2, tokens, 4)  # during the drain: refused, the other goes on
        by_key = session.read_until(_all_ended([1, 2]))
        assert by_key[2][-1].error_code == grpc.StatusCode.UNAVAILABLE.value[0]
        last = by_key[1][-1].response
        assert last.finish_reason == "length" and last.usage.completion_tokens == 1500
        assert len(_tokens(head + by_key[1])) == 1500, "the drain let it finish"
        started = time.monotonic()
        assert list(session.call) == [], "the stream ends once its last request is answered"
        assert own.computed.proc.wait(20) == 0, own.computed.log()[-3000:]
        assert time.monotonic() - started < 5, "the open stream did not hold the exit"
    finally:
        own.computed.stop()
        own.blockd.stop()
