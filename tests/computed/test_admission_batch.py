"""Text prompts admitted in batches: the same answers as one `admit` each, in call order.

The policy is computed's real `RequestPolicy` over a byte tokenizer that counts its calls.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from computed.admission_batch import AdmissionBatcher
from computed.errors import CapacityError, RequestError
from computed.request_policy import AdmittedRequest, GenerateInput
from tests.computed.test_request_policy import ByteTokenizer, policy

REQUESTS = [
    GenerateInput(prompt="hello"),
    GenerateInput(messages=[("user", "hi")], max_tokens=2),
    GenerateInput(prompt_token_ids=[5, 6, 7]),
    GenerateInput(),  # empty prompt
    GenerateInput(prompt="a", prompt_token_ids=[1]),  # both given
    GenerateInput(prompt="x" * 40),  # over the 32-token context
    GenerateInput(prompt_token_ids=[300]),  # out of the vocab
    GenerateInput(messages=[("", "no role")]),
    GenerateInput(prompt="x" * 30, max_tokens=3),  # max_tokens cannot fit
    GenerateInput(prompt="bye", cache_salt="s" * 2000),  # salt too long
]


class CountingTokenizer(ByteTokenizer):
    """Counts `encode_many` calls and the texts they carried; `encode` must not be used."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.batches: list[int] = []
        self.threads: set[int] = set()
        self.gate = gate

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("a batch must tokenize through encode_many")

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        self.batches.append(len(texts))
        self.threads.add(threading.get_ident())
        return [list(t.encode()) for t in texts]


def _outcome(call) -> tuple[str, object]:
    try:
        admitted = call()
    except (RequestError, CapacityError) as error:
        return type(error).__name__, str(error)
    assert isinstance(admitted, AdmittedRequest)
    return "ok", admitted


def test_admit_many_answers_what_admit_answers_for_each_request() -> None:
    one_by_one = [_outcome(lambda r=r: policy().admit(r)) for r in REQUESTS]
    together = policy().admit_many(REQUESTS)
    assert len(together) == len(REQUESTS)
    for expected, got in zip(one_by_one, together, strict=True):
        if isinstance(got, Exception):
            assert (type(got).__name__, str(got)) == expected
        else:
            assert ("ok", got) == expected
    kinds = [kind for kind, _ in one_by_one]
    assert kinds.count("ok") == 3 and kinds.count("RequestError") == 7, kinds


def _batcher(tokenizer: CountingTokenizer, chunk_size: int = 8, inline_chars: int = 0) -> AdmissionBatcher:
    """inline_chars 0: every text goes through the batch (the tests of batching)."""
    p = policy()
    p.tokenizer = tokenizer
    return AdmissionBatcher(p, chunk_size, inline_chars)


def test_a_burst_of_text_prompts_is_tokenized_together_and_answered_in_call_order() -> None:
    gate = threading.Event()  # holds the batch until every caller waits on it
    tokenizer = CountingTokenizer(gate)
    batcher = _batcher(tokenizer, chunk_size=8)
    prompts = [GenerateInput(prompt=f"prompt {i}") for i in range(32)]
    resumed: list[int] = []

    async def one(i: int) -> AdmittedRequest:
        admitted = await batcher.admit(prompts[i])
        resumed.append(i)
        return admitted

    async def main() -> list[AdmittedRequest]:
        tasks = [asyncio.create_task(one(i)) for i in range(32)]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    # All 32 queued before the drain task first ran: one batch, one hop to one thread (a
    # per-request hop gives 32), tokenized a chunk at a time.
    assert tokenizer.batches == [8, 8, 8, 8]
    assert len(tokenizer.threads) == 1
    assert resumed == list(range(32))
    assert [r.prompt_token_ids for r in results] == [list(p.prompt.encode()) for p in prompts]


def test_each_caller_gets_its_own_error_and_a_caller_that_left_is_skipped() -> None:
    gate = threading.Event()
    tokenizer = CountingTokenizer(gate)
    batcher = _batcher(tokenizer)

    async def main() -> list[object]:
        first = asyncio.create_task(batcher.admit(GenerateInput(prompt="first")))
        await asyncio.sleep(0.01)
        tasks = [
            asyncio.create_task(batcher.admit(r))
            for r in (
                GenerateInput(prompt="x" * 40),
                GenerateInput(prompt="gone"),
                GenerateInput(prompt="ok"),
            )
        ]
        await asyncio.sleep(0.01)
        tasks[1].cancel()  # its caller went away while the first batch ran
        gate.set()
        return await asyncio.gather(first, *tasks, return_exceptions=True)

    first, too_long, gone, ok = asyncio.run(main())
    assert first.prompt_token_ids == list(b"first")
    assert isinstance(too_long, RequestError) and "context is 32" in str(too_long)
    assert isinstance(gone, asyncio.CancelledError)
    assert ok.prompt_token_ids == list(b"ok")
    assert tokenizer.batches == [1, 3]


def test_token_id_prompts_are_checked_inline_without_the_tokenizer() -> None:
    tokenizer = CountingTokenizer()
    batcher = _batcher(tokenizer)

    async def main() -> AdmittedRequest:
        return await batcher.admit(GenerateInput(prompt_token_ids=[1, 2, 3]))

    assert asyncio.run(main()).prompt_token_ids == [1, 2, 3]
    assert tokenizer.batches == []
    with pytest.raises(RequestError, match="out of range"):
        asyncio.run(batcher.admit(GenerateInput(prompt_token_ids=[999])))


def test_a_chunk_s_callers_are_answered_before_the_next_chunk_is_tokenized() -> None:
    """The first prompts of a burst reach the engine after their own chunk's time, not the
    whole burst's."""
    second_chunk = threading.Event()
    answered_first: list[int] = []

    class HeldSecondChunk(CountingTokenizer):
        def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
            if self.batches:  # the second chunk waits until the first one's callers resumed
                assert second_chunk.wait(10), "the first chunk's callers were never answered"
            return super().encode_many(texts, add_special_tokens)

    tokenizer = HeldSecondChunk()
    batcher = _batcher(tokenizer, chunk_size=2)

    async def one(i: int) -> AdmittedRequest:
        admitted = await batcher.admit(GenerateInput(prompt=f"p{i}"))
        if i < 2:
            answered_first.append(i)
            if len(answered_first) == 2:
                second_chunk.set()
        return admitted

    async def main() -> list[AdmittedRequest]:
        return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(main())
    assert answered_first == [0, 1]
    assert tokenizer.batches == [2, 2]
    assert [r.prompt_token_ids for r in results] == [list(f"p{i}".encode()) for i in range(4)]


class InlineCountingTokenizer(CountingTokenizer):
    """Also counts single `encode` calls (an inline admission's) and their threads."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__(gate)
        self.singles: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.singles.append(threading.get_ident())
        return list(text.encode())


def test_a_short_text_that_finds_the_batcher_idle_is_admitted_on_the_loop() -> None:
    tokenizer = InlineCountingTokenizer()
    batcher = _batcher(tokenizer, inline_chars=10)

    async def main() -> list[AdmittedRequest]:
        assert batcher.is_idle
        return [
            await batcher.admit(GenerateInput(prompt="hello")),
            await batcher.admit(GenerateInput(messages=[("user", "hi")], max_tokens=2)),
        ]

    text, chat = asyncio.run(main())
    assert tokenizer.singles == [threading.get_ident()] * 2, "admitted off the loop's thread"
    assert tokenizer.batches == []
    assert text.prompt_token_ids == list(b"hello")
    assert chat == policy().admit(GenerateInput(messages=[("user", "hi")], max_tokens=2))


def test_a_long_text_goes_through_the_batch_even_when_it_is_idle() -> None:
    tokenizer = InlineCountingTokenizer()
    batcher = _batcher(tokenizer, inline_chars=10)
    admitted = asyncio.run(batcher.admit(GenerateInput(prompt="x" * 11)))
    assert admitted.prompt_token_ids == list(b"x" * 11)
    assert tokenizer.singles == [] and tokenizer.batches == [1]


def test_a_short_text_behind_a_running_batch_keeps_its_turn() -> None:
    """Inline only when nothing is queued or running: a short text never overtakes."""
    gate = threading.Event()
    tokenizer = InlineCountingTokenizer(gate)
    batcher = _batcher(tokenizer, inline_chars=10)
    order: list[str] = []

    async def one(name: str, text: str) -> AdmittedRequest:
        admitted = await batcher.admit(GenerateInput(prompt=text))
        order.append(name)
        return admitted

    async def main() -> None:
        long = asyncio.create_task(one("long", "y" * 20))
        await asyncio.sleep(0.01)  # its batch is running, held at the gate
        assert not batcher.is_idle
        short = asyncio.create_task(one("short", "hi"))
        await asyncio.sleep(0.01)
        assert order == [], "the short text overtook the running batch"
        gate.set()
        await asyncio.gather(long, short)

    asyncio.run(main())
    assert order == ["long", "short"]
    assert tokenizer.singles == [] and tokenizer.batches == [1, 1]
