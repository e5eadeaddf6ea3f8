"""gRPC adapter for `kvcache.v1.GenerationService`: messages in, engine calls, messages out.

The only module of computed that knows gRPC status codes: RequestError ->
INVALID_ARGUMENT, CapacityError -> RESOURCE_EXHAUSTED, draining -> UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import structlog
from google.protobuf.message import DecodeError

from computed.engine import Engine, GenerationChunk
from computed.errors import CapacityError, RequestError
from computed.model.tokenizer import IncrementalDecoder, Tokenizer
from computed.sequence import SamplingParams
from kvcache.v1 import generation_pb2 as pb
from kvcache.v1 import generation_pb2_grpc as pb_grpc

log = structlog.get_logger("computed.service")

DEFAULT_MAX_TOKENS = 64
MAX_SALT_BYTES = 1024
MAX_MESSAGES = 1024
# The request id is echoed in every response message: unbounded, a 16 MiB id would turn
# each generated token into a 16 MiB message.
MAX_REQUEST_ID_CHARS = 256
# A positive temperature below this samples greedily (its limit): dividing logits by a
# denormal such as 1e-45 overflows float32 to inf, the softmax turns NaN and every step
# of the batch would fail. vLLM's _SAMPLING_EPS is the same.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class WorkerInfo:
    """Runtime facts about the served model and pool (known after loading and sizing)."""

    model_id: str
    model_revision: str
    architecture: str
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    blockd_address: str


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse (e.g. invalid UTF-8 in a string field)."""

    message_type: str
    error: str


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    def __init__(self, engine: Engine, tokenizer: Tokenizer, info: WorkerInfo) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.info = info

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        await _reject_malformed(request, context)
        if not self.engine.is_accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "computed is shutting down; retry elsewhere")
        try:
            # Tokenizing a long prompt takes a while: keep the event loop (every stream) free.
            prompt = await asyncio.to_thread(self._prompt_tokens, request)
            params = self._sampling_params(request, len(prompt))
            salt = _check_salt(request.cache_salt)
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise RequestError(f"request_id is over {MAX_REQUEST_ID_CHARS} characters "
                                   f"(it is echoed in every response)")
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except CapacityError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        seq_id, queue = self.engine.add_request(prompt, params, IncrementalDecoder(self.tokenizer),
                                                salt, request.public_prefix_tokens)
        request_id = request.request_id or f"req-{seq_id}"
        finished = False
        try:
            while not finished:
                chunks = [await queue.get()]
                while not queue.empty():  # a slow reader gets the backlog as one message
                    chunks.append(queue.get_nowait())
                finished = chunks[-1].finish_reason is not None
                if chunks[-1].finish_reason == "error":
                    await context.abort(grpc.StatusCode.INTERNAL,
                                        "the model failed on this request's batch; see computed's log")
                yield _response(request_id, chunks)
        finally:
            if not finished:
                self.engine.abort(seq_id)  # client cancelled or went away

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        await _reject_malformed(request, context)
        try:
            if request.messages and request.text:
                raise RequestError("give either text or messages, not both")
            if request.messages:
                rendered = self._render_chat(request.messages)
                return pb.TokenizeResponse(token_ids=self.tokenizer.encode(rendered, add_special_tokens=False),
                                           rendered_text=rendered)
            return pb.TokenizeResponse(
                token_ids=self.tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens))
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        await _reject_malformed(request, context)
        try:
            self._check_token_ids(request.token_ids, "token_ids")
        except RequestError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids)))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.GetModelInfoResponse:
        await _reject_malformed(request, context)
        info, lease = self.info, self.engine.directory.lease
        return pb.GetModelInfoResponse(
            model_id=info.model_id, model_revision=info.model_revision, architecture=info.architecture,
            dtype=info.dtype, device=info.device, block_size=info.block_size, num_blocks=info.num_blocks,
            max_model_len=info.max_model_len, vocab_size=info.vocab_size,
            eos_token_ids=list(info.eos_token_ids), has_chat_template=self.tokenizer.has_chat_template,
            pool_id=lease.pool_id if lease else "", blockd_address=info.blockd_address)

    # ------------------------------------------------------------ validation

    def _prompt_tokens(self, request: pb.GenerateRequest) -> list[int]:
        given = [bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)]
        if sum(given) == 0:
            raise RequestError("empty prompt: set one of prompt, prompt_token_ids or messages")
        if sum(given) > 1:
            raise RequestError("set exactly one of prompt, prompt_token_ids or messages")
        if request.prompt_token_ids:
            tokens = list(request.prompt_token_ids)
            self._check_token_ids(tokens, "prompt_token_ids")
        elif request.messages:
            tokens = self.tokenizer.encode(self._render_chat(request.messages), add_special_tokens=False)
        else:
            tokens = self.tokenizer.encode(request.prompt, add_special_tokens=True)
        if not tokens:
            raise RequestError("the prompt tokenized to nothing; send some text")
        limit = self.info.max_model_len
        if len(tokens) >= limit:
            raise RequestError(f"prompt has {len(tokens)} tokens but the model's context is {limit}: "
                               f"send at most {limit - 1} prompt tokens")
        blocks = -(-(len(tokens) + 1) // self.info.block_size)
        if blocks > self.info.num_blocks:
            raise CapacityError(f"prompt needs {blocks} KV blocks but the pool holds {self.info.num_blocks}; "
                                f"shorten it or start computed with more --num-blocks")
        return tokens

    def _sampling_params(self, request: pb.GenerateRequest, num_prompt_tokens: int) -> SamplingParams:
        # Refused, not silently clamped, when an explicit max_tokens cannot fit beside the
        # prompt (as vLLM and OpenAI do); the default alone never refuses a prompt that fits.
        room = self.info.max_model_len - num_prompt_tokens  # >= 1: _prompt_tokens refused the rest
        if not request.HasField("max_tokens"):
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        else:
            max_tokens = request.max_tokens
            if max_tokens > room:
                raise RequestError(
                    f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, but the model's "
                    f"context is {self.info.max_model_len}: at most {room} completion tokens fit; lower "
                    f"max_tokens to {room} or shorten the prompt by {max_tokens - room} tokens")
        for token in request.stop_token_ids:
            if token >= self.info.vocab_size:
                raise RequestError(f"stop_token_ids: {token} is not below the vocab size {self.info.vocab_size}")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_effective_temperature(request),
            top_p=request.top_p if request.HasField("top_p") else 1.0,
            top_k=request.top_k if request.HasField("top_k") else 0,
            seed=request.seed if request.HasField("seed") else None,
            stop=tuple(request.stop), stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos)

    def _check_token_ids(self, tokens, field: str) -> None:
        vocab = self.info.vocab_size
        bad = next((t for t in tokens if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"{field}: token id {bad} is out of range; the vocab has {vocab} ids")

    def _render_chat(self, messages) -> str:
        if not self.tokenizer.has_chat_template:
            raise RequestError("this model has no chat template: send prompt or prompt_token_ids")
        if len(messages) > MAX_MESSAGES:
            raise RequestError(f"at most {MAX_MESSAGES} messages")
        if any(not m.role for m in messages):
            raise RequestError("every message needs a role (system, user, assistant or tool)")
        try:
            return self.tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in messages], add_generation_prompt=True)
        except Exception as exc:  # templates raise whatever they like
            raise RequestError(f"chat template refused the messages: {exc}") from exc


def _effective_temperature(request: pb.GenerateRequest) -> float:
    temperature = request.temperature if request.HasField("temperature") else 0.0
    return 0.0 if 0.0 < temperature < MIN_SAMPLING_TEMPERATURE else temperature


def _check_salt(salt: str) -> str:
    if len(salt.encode()) > MAX_SALT_BYTES:
        raise RequestError(f"cache_salt is over {MAX_SALT_BYTES} bytes")
    return salt


def _response(request_id: str, chunks: list[GenerationChunk]) -> pb.GenerateResponse:
    last = chunks[-1]
    response = pb.GenerateResponse(request_id=request_id,
                                   token_ids=[t for c in chunks for t in c.token_ids],
                                   text="".join(c.text for c in chunks),
                                   finish_reason=last.finish_reason or "")
    if last.usage is not None:
        u = last.usage
        response.usage.CopyFrom(pb.Usage(
            prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
            completion_tokens=u.completion_tokens, time_to_first_token_seconds=u.time_to_first_token_seconds,
            total_time_seconds=u.total_time_seconds, num_preemptions=u.num_preemptions))
    return response


async def _reject_malformed(request, context) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"request is not a valid {request.message_type}: {request.error} "
                            f"(string fields must be UTF-8)")


def add_generation_service(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Register like the generated helper does, but answer undecodable requests with
    INVALID_ARGUMENT instead of grpc's INTERNAL "Exception deserializing request"."""
    service = pb.DESCRIPTOR.services_by_name["GenerationService"]
    handlers = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        factory = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = factory(getattr(servicer, method.name),
                                        request_deserializer=_lenient(request_cls),
                                        response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def _lenient(message_cls):
    def deserialize(data: bytes):
        try:
            return message_cls.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:
            return Malformed(message_cls.DESCRIPTOR.name, str(exc) or type(exc).__name__)
    return deserialize

