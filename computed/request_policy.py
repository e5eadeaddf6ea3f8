"""What computed accepts from a client: validation and defaults of Generate, Tokenize, Detokenize.

Pure: plain values in, a validated request (or a domain error) out; no gRPC and no
generated code. The servicer turns messages into `GenerateInput` and maps the errors
raised here (`RequestError`, `CapacityError`) to status codes.

Invariants of an `AdmittedRequest`:
- 1 <= len(prompt_token_ids) < max_model_len, every id below the vocab size;
- len(prompt_token_ids) + params.max_tokens <= max_model_len (an explicit max_tokens
  that cannot fit is refused, the default is clamped);
- the prompt plus one generated token fits in the whole pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from computed.errors import CapacityError, RequestError
from computed.sequence import SamplingParams

DEFAULT_MAX_TOKENS = 64
MAX_SALT_BYTES = 1024
CACHE_POLICIES = ("store", "read_only", "none")  # Generate's CachePolicy, as the service names it
MAX_RETENTION_PRIORITY = 100
MAX_MESSAGES = 1024
# The request id is echoed in every response message: unbounded, a 16 MiB id would turn
# each generated token into a 16 MiB message.
MAX_REQUEST_ID_CHARS = 256
# A positive temperature below this samples greedily (its limit): dividing logits by a
# denormal such as 1e-45 overflows float32 to inf, the softmax turns NaN and every step
# of the batch would fail. vLLM's _SAMPLING_EPS is the same.
MIN_SAMPLING_TEMPERATURE = 1e-5

ChatMessage = tuple[str, str] | tuple[str, str, str]  # (role, content) or (role, content, name)


class PromptTokenizer(Protocol):
    """The part of `computed.model.tokenizer.Tokenizer` the policy uses."""

    @property
    def has_chat_template(self) -> bool: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = ...) -> list[list[int]]: ...
    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = ...
    ) -> str: ...


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
class GenerateInput:
    """A GenerateRequest as plain values; None marks an optional field left unset."""

    prompt: str = ""
    prompt_token_ids: Sequence[int] = ()
    messages: Sequence[ChatMessage] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    cache_salt: str = ""
    public_prefix_tokens: int = 0
    request_id: str = ""
    cache_policy: str = "store"  # the service maps the proto enum; anything else is refused
    retention_priority: int = 0
    stream_interval: int = 1  # tokens per message after the first; 0 means 1
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Sequence[tuple[int, float]] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0


@dataclass(frozen=True)
class AdmittedRequest:
    """A Generate the engine can run as is (see the module's invariants)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str
    public_prefix_tokens: int
    request_id: str  # "" when the client sent none
    cache_policy: str = "store"  # one of CACHE_POLICIES
    retention_priority: int = 0  # 0 .. MAX_RETENTION_PRIORITY
    stream_interval: int = 1  # >= 1


class RequestPolicy:
    """Checks requests against the served model and pool; raises RequestError or CapacityError."""

    def __init__(self, info: WorkerInfo, tokenizer: PromptTokenizer) -> None:
        self.info = info
        self.tokenizer = tokenizer

    def admit(self, request: GenerateInput) -> AdmittedRequest:
        """Validate a Generate (tokenizing its prompt: slow for a long one) in the documented order."""
        return self._admit(request, self.prompt_tokens(request))

    def admit_many(self, requests: Sequence[GenerateInput]) -> list[AdmittedRequest | Exception]:
        """`admit` of each request, in order: the request or the error `admit` would raise.

        The texts are tokenized together (`encode_many`: one call that leaves the GIL and
        spreads over the cores), so a burst of text prompts costs one hop off the event
        loop, not one each. Why: a burst of 32 streamed 1,040-token prompts reached the
        engine 2.3 ms apart, one tokenizer thread hop each (`bench.serving_http`)."""
        texts: list[tuple[str, bool] | None | Exception] = []
        for request in requests:
            try:
                texts.append(self.prompt_text(request))
            except Exception as error:  # noqa: BLE001 - each request's own error
                texts.append(error)
        encoded: dict[int, list[int]] = {}
        for special in (True, False):
            picked = {i: t[0] for i, t in enumerate(texts) if isinstance(t, tuple) and t[1] is special}
            if picked:
                ids = self.tokenizer.encode_many(list(picked.values()), add_special_tokens=special)
                encoded.update(zip(picked, ids, strict=True))
        out: list[AdmittedRequest | Exception] = []
        for i, (request, text) in enumerate(zip(requests, texts, strict=True)):
            try:
                if isinstance(text, Exception):
                    raise text
                tokens = self._given_ids(request) if text is None else encoded[i]
                out.append(self._admit(request, self.check_prompt(tokens)))
            except Exception as error:  # noqa: BLE001 - each request's own error
                out.append(error)
        return out

    def _admit(self, request: GenerateInput, prompt: list[int]) -> AdmittedRequest:
        params = self.sampling_params(request, len(prompt))
        salt = _check_salt(request.cache_salt)
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise RequestError(
                f"request_id is over {MAX_REQUEST_ID_CHARS} characters (it is echoed in every response)"
            )
        if request.cache_policy not in CACHE_POLICIES:
            raise RequestError(
                f"cache_policy {request.cache_policy} is not one of CACHE_POLICY_STORE, "
                f"CACHE_POLICY_READ_ONLY, CACHE_POLICY_NONE"
            )
        if not 0 <= request.retention_priority <= MAX_RETENTION_PRIORITY:
            raise RequestError(
                f"retention_priority must be 1 .. {MAX_RETENTION_PRIORITY} (0: the default), "
                f"got {request.retention_priority}"
            )
        return AdmittedRequest(
            prompt,
            params,
            salt,
            request.public_prefix_tokens,
            request.request_id,
            request.cache_policy,
            request.retention_priority,
            max(1, request.stream_interval),
        )

    def tokenize(
        self, text: str, messages: Sequence[ChatMessage], add_special_tokens: bool
    ) -> tuple[list[int], str]:
        """Token ids of `text` or of the rendered chat, and the rendered text ("" for text)."""
        if messages and text:
            raise RequestError("give either text or messages, not both")
        if messages:
            rendered = self.render_chat(messages)
            return self.tokenizer.encode(rendered, add_special_tokens=False), rendered
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens), ""

    def prompt_tokens(self, request: GenerateInput) -> list[int]:
        text = self.prompt_text(request)
        if text is None:
            return self.check_prompt(self._given_ids(request))
        return self.check_prompt(self.tokenizer.encode(text[0], add_special_tokens=text[1]))

    def _given_ids(self, request: GenerateInput) -> list[int]:
        tokens = list(request.prompt_token_ids)
        self.check_token_ids(tokens, "prompt_token_ids")
        return tokens

    def prompt_text(self, request: GenerateInput) -> tuple[str, bool] | None:
        """The text to tokenize and whether the tokenizer adds its special tokens (not for a
        chat: its template writes them); None for prompt_token_ids."""
        given = [bool(request.prompt), bool(request.prompt_token_ids), bool(request.messages)]
        if sum(given) == 0:
            raise RequestError("empty prompt: set one of prompt, prompt_token_ids or messages")
        if sum(given) > 1:
            raise RequestError("set exactly one of prompt, prompt_token_ids or messages")
        if request.prompt_token_ids:
            return None
        if request.messages:
            return self.render_chat(request.messages), False
        return request.prompt, True

    def check_prompt(self, tokens: list[int]) -> list[int]:
        """`tokens` if the context and the pool can hold them; raises otherwise."""
        if not tokens:
            raise RequestError("the prompt tokenized to nothing; send some text")
        limit = self.info.max_model_len
        if len(tokens) >= limit:
            raise RequestError(
                f"prompt has {len(tokens)} tokens but the model's context is {limit}: "
                f"send at most {limit - 1} prompt tokens"
            )
        blocks = -(-(len(tokens) + 1) // self.info.block_size)
        if blocks > self.info.num_blocks:
            raise CapacityError(
                f"prompt needs {blocks} KV blocks but the pool holds {self.info.num_blocks}; "
                f"shorten it or start computed with more --num-blocks"
            )
        return tokens

    def sampling_params(self, request: GenerateInput, num_prompt_tokens: int) -> SamplingParams:
        # Refused, not silently clamped, when an explicit max_tokens cannot fit beside the
        # prompt (as vLLM and OpenAI do); the default alone never refuses a prompt that fits.
        room = self.info.max_model_len - num_prompt_tokens  # >= 1: prompt_tokens refused the rest
        if request.max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        else:
            max_tokens = request.max_tokens
            if max_tokens > room:
                raise RequestError(
                    f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}, but the model's "
                    f"context is {self.info.max_model_len}: at most {room} completion tokens fit; lower "
                    f"max_tokens to {room} or shorten the prompt by {max_tokens - room} tokens"
                )
        for name, tokens in (
            ("stop_token_ids", request.stop_token_ids),
            ("logit_bias", [t for t, _ in request.logit_bias]),
        ):
            for token in tokens:
                if token >= self.info.vocab_size:
                    raise RequestError(f"{name}: {token} is not below the vocab size {self.info.vocab_size}")
        eos = () if request.ignore_eos else self.info.eos_token_ids
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_effective_temperature(request.temperature),
            top_p=request.top_p if request.top_p is not None else 1.0,
            top_k=request.top_k if request.top_k is not None else 0,
            seed=request.seed,
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=tuple(sorted(request.logit_bias)),
            min_tokens=request.min_tokens,
            banned_until_min_tokens=tuple(sorted({*eos, *request.stop_token_ids})),
            logprobs=request.logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )

    def check_token_ids(self, tokens: Sequence[int], field: str) -> None:
        vocab = self.info.vocab_size
        bad = next((t for t in tokens if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"{field}: token id {bad} is out of range; the vocab has {vocab} ids")

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        if not self.tokenizer.has_chat_template:
            raise RequestError("this model has no chat template: send prompt or prompt_token_ids")
        if len(messages) > MAX_MESSAGES:
            raise RequestError(f"at most {MAX_MESSAGES} messages")
        if any(not m[0] for m in messages):
            raise RequestError("every message needs a role (system, user, assistant or tool)")
        try:
            return self.tokenizer.apply_chat_template(
                [_template_message(m) for m in messages], add_generation_prompt=True
            )
        except Exception as exc:  # templates raise whatever they like
            raise RequestError(f"chat template refused the messages: {exc}") from exc


def _template_message(message: ChatMessage) -> dict[str, str]:
    """A message as chat templates read it; "name" only when given (templates test for it)."""
    out = {"role": message[0], "content": message[1]}
    if len(message) > 2 and message[2]:
        out["name"] = message[2]
    return out


def _effective_temperature(temperature: float | None) -> float:
    temperature = 0.0 if temperature is None else temperature
    return 0.0 if 0.0 < temperature < MIN_SAMPLING_TEMPERATURE else temperature


def _check_salt(salt: str) -> str:
    if len(salt.encode()) > MAX_SALT_BYTES:
        raise RequestError(f"cache_salt is over {MAX_SALT_BYTES} bytes")
    return salt
