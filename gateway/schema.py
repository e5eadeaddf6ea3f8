"""OpenAI request bodies -> what the daemons are asked (pure validation, no I/O).

`parse_chat` and `parse_completion` take the decoded JSON body and answer a
`GenerationRequest`, or raise `ApiError` (400) naming the offending parameter. Every
parameter is either served, accepted at its no-op default (`logprobs: false`,
`presence_penalty: 0`, ...), or refused: nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from clients.requests import WHOLE_COMPLETION, Prompt, SamplingParams
from clients.types import ChatMessage
from gateway.errors import invalid, unsupported

MAX_N = 16
MAX_STOP = 4
_UINT64 = 1 << 64
CHAT_ROLES = ("system", "user", "assistant")

# Parameters accepted only at the value that means "off" (the daemons cannot serve more).
_NOOP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "parallel_tool_calls": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
    "metadata": (None, {}),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
}
_WHY = {
    "logprobs": "the workers do not return log probabilities",
    "top_logprobs": "the workers do not return log probabilities",
    "best_of": "only best_of 1 (or n) is served",
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream"}
# top_k and ignore_eos: vLLM's extensions of the API, which computed serves.
_COMMON |= {"stream_options", "user", "top_k", "ignore_eos"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens"}
COMPLETION_PARAMS = _COMMON | {"prompt"}


@dataclass(frozen=True)
class GenerationRequest:
    """One OpenAI request as daemon calls: each prompt generated `n` times.

    kind: "chat" (messages) or "completion" (prompt). Choice i*n+j is prompt i's j-th sample.
    """

    kind: str
    model: str
    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    user: str | None = None

    def sampling_for(self, choice: int) -> SamplingParams:
        """Choice j of a prompt samples with seed + j, so n seeded samples differ and repeat."""
        j = choice % self.n
        if self.sampling.seed is None or j == 0:
            return self.sampling
        return _replace_seed(self.sampling, (self.sampling.seed + j) % _UINT64)


def parse_chat(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_params(body, CHAT_PARAMS)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise invalid("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    messages = parse_messages(body.get("messages"))
    return _request(body, "chat", (Prompt(messages=messages),), max_name)


def parse_completion(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_params(body, COMPLETION_PARAMS)
    return _request(body, "completion", parse_prompts(body.get("prompt")), "max_tokens")


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"'{where}' must be an object with 'role' and 'content'", where)
        for key in message:
            if key not in ("role", "content"):
                raise unsupported(f"{where}.{key}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}", where)
        out.append(ChatMessage(role, _content(message.get("content"), f"{where}.content")))
    return tuple(out)


def parse_prompts(value: Any) -> tuple[Prompt, ...]:
    """A string, a list of strings, a list of token ids or a list of token-id lists."""
    if isinstance(value, str):
        return (_text_prompt(value, "prompt"),)
    if isinstance(value, list) and value:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return (_token_prompt(value, "prompt"),)
        if all(isinstance(p, str) for p in value):
            return tuple(_text_prompt(p, f"prompt[{i}]") for i, p in enumerate(value))
        if all(isinstance(p, list) for p in value):
            return tuple(_token_prompt(p, f"prompt[{i}]") for i, p in enumerate(value))
    raise invalid(
        "'prompt' must be a non-empty string, list of strings, list of token ids or list of such lists",
        "prompt",
    )


# ---------------------------------------------------------------- pieces


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _check_params(body: Mapping[str, Any], served: set[str]) -> None:
    for name, value in body.items():
        if name in served:
            continue
        if name in _NOOP_DEFAULTS and value in _NOOP_DEFAULTS[name]:
            continue
        raise unsupported(name, _WHY.get(name, ""))


def _request(
    body: dict[str, Any], kind: str, prompts: tuple[Prompt, ...], max_name: str
) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required: one of the ids GET /v1/models lists", "model")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("'stream_options' may hold only 'include_usage'", "stream_options")
        include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    n = _int(body, "n", 1, MAX_N, default=1)
    best_of = body.get("best_of")
    if best_of not in (None, 1, n):
        raise unsupported("best_of", _WHY["best_of"])
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("'user' must be a string", "user")
    sampling = SamplingParams(
        max_tokens=_int(body, max_name, 1, None),
        temperature=_number(body, "temperature", lambda v: 0 <= v <= 2, "a number in [0, 2]"),
        top_p=_number(body, "top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=_int(body, "top_k", 0, None),
        seed=_seed(body),
        stop=_stop(body.get("stop")),
        ignore_eos=_bool(body, "ignore_eos"),
        # A non-streaming answer is read whole: the worker sends the first token (so a
        # failure shows before the reply starts), then the rest in one message.
        stream_interval=0 if stream else WHOLE_COMPLETION,
    )
    return GenerationRequest(kind, model, prompts, sampling, n, stream, include_usage, user)


def _content(value: Any, where: str) -> str:
    """A message's content: a string or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(f"{where}[{i}]", f"only text parts are served, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"'{where}' must be a string or a list of text parts", where)


def _text_prompt(text: str, where: str) -> Prompt:
    if not text:
        raise invalid(f"'{where}' must not be empty", "prompt")
    return Prompt(text=text)


def _token_prompt(ids: list[Any], where: str) -> Prompt:
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in ids):
        raise invalid(f"'{where}' must be a non-empty list of token ids (integers >= 0)", "prompt")
    return Prompt(token_ids=tuple(ids))


def _bool(body: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{param or name}' must be true or false", param or name)
    return value


def _int(body: Mapping[str, Any], name: str, low: int, high: int | None, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise invalid(f"'{name}' must be an integer {bound}, got {value!r}", name)
    return value


def _number(body: Mapping[str, Any], name: str, ok: Callable[[float], bool], what: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise invalid(f"'{name}' must be {what}, got {value!r}", name)
    return float(value)


def _seed(body: Mapping[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < _UINT64:
        raise invalid(f"'seed' must be a 64-bit integer, got {value!r}", "seed")
    return value % _UINT64


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise invalid("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise invalid(f"'stop' holds at most {MAX_STOP} strings", "stop")
    return tuple(stops)


def _replace_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    return replace(sampling, seed=seed)
