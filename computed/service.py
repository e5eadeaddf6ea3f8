"""gRPC adapter for `kvcache.v1.GenerationService`: messages in, policy and engine calls, messages out.

The only module of computed that knows gRPC status codes: the domain errors map to
them through one table, STATUS_CODES, applied by the `unary`/`streaming` decorators.
What a request may be is decided in computed/request_policy.py (pure); anything
unexpected becomes INTERNAL and is logged; the daemon keeps serving either way.

The decoding and error-mapping helpers mirror blockd/service.py line for line (the
daemons import nothing from each other); tests/test_contract.py keeps them equal.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import structlog
from google.protobuf.message import DecodeError

from computed.admission_batch import AdmissionBatcher
from computed.engine import ChunkSink, Engine, GenerationChunk
from computed.errors import CapacityError, ModelFailed, RequestError, ShuttingDown
from computed.logprobs import TokenLogprobs
from computed.model.tokenizer import IncrementalDecoder, Tokenizer
from computed.outbox import Outbox
from computed.request_policy import AdmittedRequest, GenerateInput, RequestPolicy, WorkerInfo
from kvcache.v1 import cache_policy_pb2
from kvcache.v1 import generation_pb2 as pb
from kvcache.v1 import generation_pb2_grpc as pb_grpc

log = structlog.get_logger("computed.service")

__all__ = ["STATUS_CODES", "GenerationServicer", "WorkerInfo", "add_service"]

STATUS_CODES: dict[type[Exception], grpc.StatusCode] = {
    RequestError: grpc.StatusCode.INVALID_ARGUMENT,
    CapacityError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ShuttingDown: grpc.StatusCode.UNAVAILABLE,
    ModelFailed: grpc.StatusCode.INTERNAL,
}


def _status_of(exc: Exception) -> grpc.StatusCode | None:
    for cls in type(exc).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return None


_MODEL_FAILED = "the model failed on this request's batch; see computed's log"

# Status details travel in trailing metadata (16 KiB at most): a message that echoes a
# huge client value must be cut, or the client sees a transport error instead.
MAX_DETAILS_CHARS = 1_000


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    message_type: str
    error: str


def _details(text: str) -> str:
    return text if len(text) <= MAX_DETAILS_CHARS else text[:MAX_DETAILS_CHARS] + "... (truncated)"


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    code = _status_of(exc)
    if code is None:
        log.exception("internal error", method=method)
        await context.abort(
            grpc.StatusCode.INTERNAL, _details(f"internal error in {method}: {type(exc).__name__}: {exc}")
        )
    await context.abort(code, _details(str(exc)))


def _reject_malformed(request: Any) -> None:
    if isinstance(request, Malformed):
        raise RequestError(
            f"request is not a valid {request.message_type}: {request.error} (string fields must be UTF-8)"
        )


def unary(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Map exceptions of a unary handler to status codes."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _reject_malformed(request)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must become a status
            await _abort(context, method.__name__, exc)

    return handler


def streaming(method: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Map exceptions of a server-streaming handler to status codes."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            _reject_malformed(request)
            async for reply in method(self, request, context):
                yield reply
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, method.__name__, exc)

    return handler


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """Thin handlers: message -> `RequestPolicy` -> engine -> message; errors via STATUS_CODES."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, info: WorkerInfo) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info
        self.policy = RequestPolicy(info, tokenizer)
        self.admissions = AdmissionBatcher(self.policy)

    @streaming
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream the completion; a slow reader gets the backlog as one message."""
        received = time.monotonic()
        admitted = await self._admit(request)
        sequence_id, queue = self._start(admitted, received_at=received)
        request_id = admitted.request_id or f"req-{sequence_id}"
        finished = False
        try:
            while not finished:
                chunks = [await queue.get()]
                while not queue.empty():
                    chunks.append(queue.get_nowait())
                finished = chunks[-1].finish_reason is not None
                if chunks[-1].finish_reason == "error":
                    raise ModelFailed(_MODEL_FAILED)
                yield _response(request_id, chunks, self.tokenizer)
        finally:
            if not finished:
                self.engine.abort(sequence_id)  # client cancelled or went away

    async def GenerateMany(
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateManyResponse]:
        """Many requests, one message per step for all of them (computed/outbox.py).

        A request's failure is its own update (`error_code`, STATUS_CODES' code); only a
        message that breaks the stream's own rules (undecodable, a key in use, no action)
        ends the stream, with its status. Ordering: a key is live from its `generate` until
        the update that ends it is built, so a reused key never meets its old chunks."""
        outbox: Outbox[GenerationChunk | Exception] = Outbox()
        live: dict[int, tuple[int, str]] = {}  # key -> (sequence id, request id)
        # Keys whose admission is under way (a text prompt is tokenized with the others
        # that came with it, `AdmissionBatcher`): the reader reads on meanwhile. A cancel
        # for one of them aborts it as soon as it starts.
        starting: dict[int, asyncio.Task[None]] = {}
        cancelled: set[int] = set()

        async def start(key: int, request: pb.GenerateRequest, received: float) -> None:
            try:
                await self._start_keyed(key, request, outbox, live, received)
                if key in cancelled and key in live:
                    self.engine.abort(live[key][0])
            finally:
                starting.pop(key, None)
                cancelled.discard(key)
                outbox.wake()

        async def read() -> None:
            try:
                async for message in requests:
                    _reject_malformed(message)
                    action = message.WhichOneof("action")
                    key = message.key
                    if action == "cancel":
                        if key in starting:
                            cancelled.add(key)
                        elif key in live:
                            self.engine.abort(live[key][0])
                    elif action == "generate":
                        if key in live or key in starting:
                            raise RequestError(
                                f"key {key} is in use by an unfinished request on this stream; "
                                "use another key, or wait for its last update"
                            )
                        starting[key] = asyncio.create_task(start(key, message.generate, time.monotonic()))
                    else:
                        raise RequestError("a GenerateManyRequest needs generate or cancel")
            finally:
                outbox.wake()

        reader = asyncio.create_task(read())
        self.engine.drain_listeners.add(outbox.wake)
        try:
            while True:
                await outbox.wait()
                taken = outbox.take()
                if taken:
                    yield self._updates(taken, live)
                if reader.done() and reader.exception() is not None:
                    raise reader.exception()  # type: ignore[misc]
                if (
                    (reader.done() or not self.engine.is_accepting)
                    and not live
                    and not starting
                    and not outbox.holds_any()
                ):
                    return  # half-closed or draining, and every request answered to its end
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure must become a status
            await _abort(context, "GenerateMany", exc)
        finally:
            self.engine.drain_listeners.discard(outbox.wake)
            reader.cancel()
            for task in list(starting.values()):
                task.cancel()
            for sequence_id, _ in live.values():
                self.engine.abort(sequence_id)  # the caller cancelled or went away

    async def _start_keyed(
        self,
        key: int,
        request: pb.GenerateRequest,
        outbox: Outbox[GenerationChunk | Exception],
        live: dict[int, tuple[int, str]],
        received: float,
    ) -> None:
        """Admit and start one request of a GenerateMany stream (read from it at
        `received`); a refusal is its update."""
        try:
            admitted = await self._admit(request)
            sequence_id, _ = self._start(admitted, outbox.sink(key), received)
        except Exception as exc:  # noqa: BLE001 - the request's own status
            outbox.put(key, exc)
            return
        live[key] = (sequence_id, admitted.request_id or f"req-{sequence_id}")

    def _updates(
        self, taken: dict[int, list[GenerationChunk | Exception]], live: dict[int, tuple[int, str]]
    ) -> pb.GenerateManyResponse:
        """One message for every key with news; a key whose news ends it leaves `live`."""
        reply = pb.GenerateManyResponse()
        for key, items in taken.items():
            update = reply.updates.add(key=key)
            failure = next((i for i in items if isinstance(i, Exception)), None)
            chunks = [i for i in items if not isinstance(i, Exception)]
            if failure is None and chunks[-1].finish_reason == "error":
                failure = ModelFailed(_MODEL_FAILED)
            if failure is not None:
                code = _status_of(failure)
                if code is None:
                    log.error("internal error", method="GenerateMany", error=repr(failure))
                    code = grpc.StatusCode.INTERNAL
                update.error_code = code.value[0]
                update.error_message = _details(str(failure))
                live.pop(key, None)
                continue
            update.response.CopyFrom(_response(live[key][1], chunks, self.tokenizer))
            if chunks[-1].finish_reason is not None:
                del live[key]
        return reply

    async def _admit(self, request: pb.GenerateRequest) -> AdmittedRequest:
        if not self.engine.is_accepting:
            raise ShuttingDown("computed is shutting down; retry elsewhere")
        return await self.admissions.admit(_generate_input(request))

    def _start(
        self, admitted: AdmittedRequest, sink: ChunkSink | None = None, received_at: float | None = None
    ) -> tuple[int, Any]:
        return self.engine.add_request(
            admitted.prompt_token_ids,
            admitted.params,
            IncrementalDecoder(self.tokenizer),
            admitted.cache_salt,
            admitted.public_prefix_tokens,
            admitted.cache_policy,
            admitted.retention_priority,
            admitted.stream_interval,
            sink,
            received_at,
        )

    @unary
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        token_ids, rendered = self.policy.tokenize(
            request.text, _chat(request.messages), request.add_special_tokens
        )
        return pb.TokenizeResponse(token_ids=token_ids, rendered_text=rendered)

    @unary
    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DetokenizeResponse:
        self.policy.check_token_ids(request.token_ids, "token_ids")
        return pb.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids)))

    @unary
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        info = self.info
        return pb.GetModelInfoResponse(
            model_id=info.model_id,
            model_revision=info.model_revision,
            architecture=info.architecture,
            dtype=info.dtype,
            device=info.device,
            block_size=info.block_size,
            num_blocks=info.num_blocks,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids),
            has_chat_template=self.tokenizer.has_chat_template,
            pool_id=self.engine.pool_id or "",
            blockd_address=info.blockd_address,
        )


def _chat(messages: Any) -> list[tuple[str, str] | tuple[str, str, str]]:
    return [(m.role, m.content, m.name) if m.name else (m.role, m.content) for m in messages]


# Generate's CachePolicy enum -> the request policy's names (unknown values pass as
# their number, which the policy refuses with INVALID_ARGUMENT).
_CACHE_POLICIES = {
    cache_policy_pb2.CACHE_POLICY_UNSPECIFIED: "store",
    cache_policy_pb2.CACHE_POLICY_STORE: "store",
    cache_policy_pb2.CACHE_POLICY_READ_ONLY: "read_only",
    cache_policy_pb2.CACHE_POLICY_NONE: "none",
}


def _token_ids(field: Any) -> list[int]:
    """A repeated uint32 field as a list of ints. Through numpy: upb's container hands its
    values over in one copy, where `list()` steps its iterator once per id (a 4,160-id
    prompt, in process on a 2-core Zen 3: 113-128 us against 206-245)."""
    return np.array(field, dtype=np.uint32).tolist()


def _generate_input(request: pb.GenerateRequest) -> GenerateInput:
    """The message as plain values; an unset optional field becomes None."""

    def optional(name: str) -> Any:
        return getattr(request, name) if request.HasField(name) else None

    return GenerateInput(
        prompt=request.prompt,
        prompt_token_ids=_token_ids(request.prompt_token_ids),
        messages=_chat(request.messages),
        max_tokens=optional("max_tokens"),
        temperature=optional("temperature"),
        top_p=optional("top_p"),
        top_k=optional("top_k"),
        seed=optional("seed"),
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        cache_salt=request.cache_salt,
        public_prefix_tokens=request.public_prefix_tokens,
        request_id=request.request_id,
        cache_policy=_CACHE_POLICIES.get(request.cache_policy, str(request.cache_policy)),
        retention_priority=request.retention_priority,
        stream_interval=request.stream_interval,
        min_p=optional("min_p"),
        presence_penalty=optional("presence_penalty"),
        frequency_penalty=optional("frequency_penalty"),
        repetition_penalty=optional("repetition_penalty"),
        logit_bias=list(request.logit_bias.items()),
        logprobs=optional("logprobs"),
        prompt_logprobs=optional("prompt_logprobs"),
        min_tokens=request.min_tokens,
    )


def _response(request_id: str, chunks: list[GenerationChunk], tokenizer: Tokenizer) -> pb.GenerateResponse:
    last = chunks[-1]
    response = pb.GenerateResponse(
        request_id=request_id,
        token_ids=[t for c in chunks for t in c.token_ids],
        text="".join(c.text for c in chunks),
        finish_reason=last.finish_reason or "",
    )
    for c in chunks:
        if c.prompt_logprobs:
            response.prompt_logprobs.extend(_logprobs_message(e, tokenizer) for e in c.prompt_logprobs)
        if c.logprobs:
            response.logprobs.extend(_logprobs_message(e, tokenizer) for e in c.logprobs)
    if last.usage is not None:
        u = last.usage
        response.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens,
                completion_tokens=u.completion_tokens,
                time_to_first_token_seconds=u.time_to_first_token_seconds,
                total_time_seconds=u.total_time_seconds,
                num_preemptions=u.num_preemptions,
                host_cached_tokens=u.host_cached_tokens,
                shared_cached_tokens=u.shared_cached_tokens,
            )
        )
    return response


def _logprobs_message(entry: TokenLogprobs, tokenizer: Tokenizer) -> pb.PositionLogprobs:
    """One position's logprobs; each token's text decoded alone (special tokens kept)."""

    def token(token_id: int, logprob: float) -> pb.TokenLogprob:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return pb.TokenLogprob(token_id=token_id, logprob=logprob, text=text)

    return pb.PositionLogprobs(
        token=token(entry.token_id, entry.logprob), top=[token(t, lp) for t, lp in entry.top]
    )


def add_service(servicer: Any, server: grpc.aio.Server, service_name: str) -> None:
    """Register like the generated helper does, but hand undecodable requests to the
    handler as `Malformed` (answered INVALID_ARGUMENT) instead of grpc's UNKNOWN."""
    service = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_lenient(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _lenient(message_cls: Any) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:
            return Malformed(message_cls.DESCRIPTOR.name, str(exc) or type(exc).__name__)

    return deserialize
