"""Admission of text prompts in batches: one hop off the event loop per burst, not per request.

`AdmissionBatcher.admit` of a request whose prompt is text or a chat queues it; one drain
task at a time takes everything queued and, in one hop to a worker thread, runs
`RequestPolicy.admit_many` on it a chunk of prompts at a time (the tokenizer releases the
GIL there and spreads a chunk over the cores), answering each chunk's callers as soon as
it is done. Token-id prompts are only checked, inline (18 us for 1,088 ids: cheaper than
the hop).

Why: each text prompt used to take its own thread hop, and a GenerateMany stream admitted
its requests one after another, so a burst of 32 streamed 1,040-token prompts reached the
engine 2.3 ms apart: the last one 70 ms after the first, behind two or three decode steps
(`bench.serving_http`, shared workload, 32 in flight).

Ordering: callers are answered in the order they called, so a burst reaches the engine in
the order it arrived. A caller that goes away before its answer is skipped.

A short text (at most `inline_chars` characters of prompt or message content) that finds
the batcher idle (no batched caller still waiting for its answer or yet to resume with it)
is admitted inline, on the loop: nothing can be overtaken, and the hop off the loop and
back costs more than its tokenizing. Measured on the built-in model's tokenizer: an
11-character prompt 9 us inline against 84 us through an idle batcher, in process; in the
daemon, 60 lone short requests through the gateway, 3 interleaved runs a side, the
admission phase (`computed_request_admission_seconds`) went from 0.22-0.31 ms to
0.13-0.17 ms (a one-line prompt) and from 0.26-0.39 to 0.22-0.25 ms (a two-message chat);
the client's time to first token, ~3-4 ms, moved within the machine's drift. 1,000
characters cost ~0.2 ms inline, the most a turn of the loop may take here.
"""

from __future__ import annotations

import asyncio
import os

from computed.request_policy import AdmittedRequest, GenerateInput, RequestPolicy

Entry = tuple[GenerateInput, "asyncio.Future[AdmittedRequest]"]
# Prompts tokenized per call on the worker thread: one per core (the tokenizer spreads a
# call over the cores), so the first callers of a burst are answered after one prompt's
# time, not the whole burst's. A burst of 10-15 1,040-token prompts had taken 9-20 ms in
# one call, and each of them waited for all (`bench.serving_http`, shared workload).
DEFAULT_CHUNK = max(2, os.cpu_count() or 2)
# Prompt or message characters admitted inline when the batcher is idle (see the module
# docstring): ~0.2 ms of the loop at the most (500 characters: 98 us, 2,000: 362 us).
DEFAULT_INLINE_CHARS = 1_000


class AdmissionBatcher:
    """`RequestPolicy.admit`, with concurrent text prompts tokenized together."""

    def __init__(
        self, policy: RequestPolicy, chunk_size: int = DEFAULT_CHUNK, inline_chars: int = DEFAULT_INLINE_CHARS
    ) -> None:
        assert chunk_size >= 1, f"chunk_size must be >= 1, got {chunk_size}"
        assert inline_chars >= 0, f"inline_chars must be >= 0, got {inline_chars}"
        self._policy = policy
        self._chunk_size = chunk_size
        self._inline_chars = inline_chars
        self._queue: list[Entry] = []
        self._drain: asyncio.Task[None] | None = None
        # Batched callers not yet resumed with their answer (a batch done on its thread has
        # answered callers that have yet to run: an inline admission must not pass them).
        self._num_waiting = 0

    async def admit(self, given: GenerateInput) -> AdmittedRequest:
        """The admitted request, or the policy's error for it (RequestError, CapacityError)."""
        if not (given.prompt or given.messages):
            return self._policy.admit(given)
        if self.is_idle and _num_chars(given) <= self._inline_chars:
            return self._policy.admit(given)
        future: asyncio.Future[AdmittedRequest] = asyncio.get_running_loop().create_future()
        self._queue.append((given, future))
        if self._drain is None or self._drain.done():
            self._drain = asyncio.create_task(self._run(), name="admission-batch")
        self._num_waiting += 1
        try:
            return await future
        finally:
            self._num_waiting -= 1

    @property
    def is_idle(self) -> bool:
        """No batched caller is waiting or yet to resume: an inline admission overtakes nobody."""
        return self._num_waiting == 0

    async def _run(self) -> None:
        """Batches until the queue is empty; what arrives during one batch is the next."""
        loop = asyncio.get_running_loop()
        while self._queue:
            batch, self._queue = self._queue, []
            try:
                await asyncio.to_thread(self._tokenize, batch, loop)
            except asyncio.CancelledError:  # the loop is closing: nobody is left to answer
                for _, future in batch + self._queue:
                    future.cancel()
                raise

    def _tokenize(self, batch: list[Entry], loop: asyncio.AbstractEventLoop) -> None:
        """On a worker thread: `admit_many` of `chunk_size` requests at a time, each chunk's
        callers answered as soon as it is done, in order (the loop runs the callbacks in
        the order they were scheduled)."""
        for start in range(0, len(batch), self._chunk_size):
            chunk = batch[start : start + self._chunk_size]
            try:
                results = self._policy.admit_many([given for given, _ in chunk])
            except Exception as error:  # noqa: BLE001 - a policy bug fails its chunk, not the loop
                results = [error] * len(chunk)
            loop.call_soon_threadsafe(_answer, chunk, results)


def _answer(chunk: list[Entry], results: list[AdmittedRequest | Exception]) -> None:
    for (_, future), result in zip(chunk, results, strict=True):
        if future.done():  # its caller went away
            continue
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)


def _num_chars(given: GenerateInput) -> int:
    """The characters a text prompt or a chat's messages carry (what tokenizing costs by)."""
    return len(given.prompt) + sum(len(m[1]) for m in given.messages)
