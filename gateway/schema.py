"""OpenAI request bodies -> what the daemons are asked (pure validation, no I/O).

`parse_chat` and `parse_completion` take the decoded JSON body and answer a
`GenerationRequest`, or raise `ApiError` (400) naming the offending parameter. Every
parameter of OpenAI's API and of vLLM's server is either served, accepted at its no-op
value (`use_beam_search: false`, `skip_special_tokens: true`, ...), or refused with a
400 that names it: nothing is silently ignored. docs/openai.md lists them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from clients.requests import WHOLE_COMPLETION, Prompt, SamplingParams
from clients.types import ChatMessage
from gateway.errors import invalid, unsupported

MAX_N = 16
MAX_STOP = 4
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 256
_UINT64 = 1 << 64
CHAT_ROLES = ("system", "developer", "user", "assistant")
# OpenAI's "developer" messages are the system prompt of newer models; chat templates
# know only "system".
_TEMPLATE_ROLE = {"developer": "system"}

# Parameters accepted only at the value that means "off" (the daemons cannot serve more);
# None is always accepted. OpenAI's first, then vLLM's extensions.
_NOOP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "parallel_tool_calls": (True, False),  # without tools there is nothing to call
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # without tools both mean "answer in text"
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
    "prompt_cache_key": (),
    "safety_identifier": (),
    "prediction": (),
    "audio": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    # vLLM's
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "include_stop_str_in_output": (False,),
    "truncate_prompt_tokens": (),
    "truncation_side": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "priority": (0,),
    "prompt_logprobs": (),
    "logprob_token_ids": (),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "structured_outputs": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "mm_processor_kwargs": (),
    "watermarking": (False,),
    "thinking_token_budget": (),
    "include_reasoning": (True,),
    "cache_salt": (),  # the tenant's key sets the cache scope (gateway.tenants)
}
# Chat only (vLLM's), at the values a completion from the template means.
_CHAT_NOOP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
}
_COMPLETION_NOOP_DEFAULTS: dict[str, tuple[Any, ...]] = {"add_special_tokens": (True,)}
_WHY = {
    "best_of": "only best_of 1 (or n) is served",
    "cache_salt": "the API key's tenant sets the cache scope",
    "prompt_logprobs": "use echo with logprobs on /v1/completions",
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream"}
_COMMON |= {"stream_options", "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"}
# vLLM's extensions of the API, which computed serves.
_COMMON |= {"ignore_eos", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens", "request_id"}
CHAT_PARAMS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETION_PARAMS = _COMMON | {"prompt", "echo"}


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
    # Alternatives per generated token (None: no logprobs); echo: the prompt (and its
    # logprobs, with logprobs) leads each completion choice.
    logprobs: int | None = None
    echo: bool = False
    request_id: str | None = None

    def sampling_for(self, choice: int) -> SamplingParams:
        """Choice j of a prompt samples with seed + j, so n seeded samples differ and repeat."""
        j = choice % self.n
        if self.sampling.seed is None or j == 0:
            return self.sampling
        return _replace_seed(self.sampling, (self.sampling.seed + j) % _UINT64)


def parse_chat(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_params(body, CHAT_PARAMS, _CHAT_NOOP_DEFAULTS)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise invalid("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    messages = parse_messages(body.get("messages"))
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, MAX_LOGPROBS, default=0)
    elif body.get("top_logprobs") not in (None, 0):
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return _request(body, "chat", (Prompt(messages=messages),), max_name, logprobs, echo=False)


def parse_completion(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_params(body, COMPLETION_PARAMS, _COMPLETION_NOOP_DEFAULTS)
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    echo = _bool(body, "echo")
    prompts = parse_prompts(body.get("prompt"))
    return _request(body, "completion", prompts, "max_tokens", logprobs, echo)


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list) or not value:
        raise invalid("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"'{where}' must be an object with 'role' and 'content'", where)
        for key, given in message.items():
            if key not in ("role", "content", "name") and not (key in _MESSAGE_NOOPS and not given):
                raise unsupported(f"{where}.{key}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}", where)
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid(f"'{where}.name' must be a string", f"{where}.name")
        content = _content(message.get("content"), f"{where}.content")
        out.append(ChatMessage(_TEMPLATE_ROLE.get(role, role), content, name or ""))
    return tuple(out)


# Message keys an assistant message echoed back by a client carries empty (openai SDK,
# LangChain): accepted when null or empty.
_MESSAGE_NOOPS = ("refusal", "tool_calls", "function_call", "audio", "annotations", "reasoning_content")


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


def _check_params(body: Mapping[str, Any], served: set[str], noops: Mapping[str, tuple[Any, ...]]) -> None:
    for name, value in body.items():
        if name in served:
            continue
        neutral = noops.get(name, _NOOP_DEFAULTS.get(name))
        if neutral is not None and (value is None or _is_one_of(value, neutral)):
            continue
        if neutral is None:
            raise unsupported(name, _WHY.get(name, ""))
        shown = ", ".join(json.dumps(v) for v in neutral) or "null"
        raise unsupported(name, _WHY.get(name, f"it is accepted only as {shown}"))


def _is_one_of(value: Any, values: tuple[Any, ...]) -> bool:
    """`value in values` where True is not 1 and 1 is 1.0 (JSON's types, not Python's)."""
    return any(type(value) is type(v) or {type(value), type(v)} == {int, float} for v in values if value == v)


def _request(
    body: dict[str, Any],
    kind: str,
    prompts: tuple[Prompt, ...],
    max_name: str,
    logprobs: int | None,
    echo: bool,
) -> GenerationRequest:
    model = body.get("model")
    if model is None:
        raise invalid("'model' is required: one of the ids GET /v1/models lists", "model")
    if not isinstance(model, str) or not model:
        raise invalid(
            f"'model' must be a non-empty string, one of the ids GET /v1/models lists; got {shown(model)}",
            "model",
        )
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("'stream_options' is only allowed with stream: true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise invalid("'stream_options' may hold only 'include_usage'", "stream_options")
        include_usage = _bool(options, "include_usage", "stream_options.include_usage")
        if options.get("continuous_usage_stats"):
            raise unsupported("stream_options.continuous_usage_stats", "usage comes in the last chunk")
    n = _int(body, "n", 1, MAX_N, default=1)
    best_of = body.get("best_of")
    if best_of not in (None, 1, n):
        raise unsupported("best_of", _WHY["best_of"])
    user = _string(body, "user")
    request_id = _string(body, "request_id")
    # The prompt's logprobs when echoed with logprobs; an echoed token-id prompt needs its
    # tokens' text, which the prompt logprobs carry.
    prompt_logprobs = None
    if echo and (logprobs is not None or any(p.token_ids is not None for p in prompts)):
        prompt_logprobs = logprobs or 0
    top_k = _int(body, "top_k", -1, None)
    max_tokens = _int(body, max_name, 1, None)
    min_tokens = _int(body, "min_tokens", 0, None, default=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' ({min_tokens}) must not exceed '{max_name}' ({max_tokens})", "min_tokens"
        )
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", lambda v: 0 <= v <= 2, "a number in [0, 2]"),
        top_p=_number(body, "top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=top_k if top_k not in (-1, 0) else None,  # vLLM's -1 and OpenAI-style 0: off
        seed=_seed(body),
        stop=_stop(body.get("stop")),
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        ignore_eos=_bool(body, "ignore_eos"),
        # A non-streaming answer is read whole: the worker sends the first token (so a
        # failure shows before the reply starts), then the rest in one message.
        stream_interval=0 if stream else WHOLE_COMPLETION,
        min_p=_number(body, "min_p", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        presence_penalty=_number(body, "presence_penalty", lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        frequency_penalty=_number(body, "frequency_penalty", lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
        repetition_penalty=_number(
            body, "repetition_penalty", lambda v: 0 < v <= 2, "a number in (0, 2] (1: off)"
        ),
        logit_bias=_logit_bias(body.get("logit_bias")),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    return GenerationRequest(
        kind, model, prompts, sampling, n, stream, include_usage, user, logprobs, echo, request_id
    )


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
                raise unsupported(f"{where}[{i}]", f"only text parts are served, got {shown(kind)}")
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
        raise invalid(f"'{name}' must be an integer {bound}, got {shown(value)}", name)
    return value


def _number(body: Mapping[str, Any], name: str, ok: Callable[[float], bool], what: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise invalid(f"'{name}' must be {what}, got {shown(value)}", name)
    return float(value)


def _string(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(f"'{name}' must be a string", name)
    return value


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{"token id": bias in [-100, 100]} (keys are strings in JSON)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < 1 << 32:
            raise invalid(
                f"'logit_bias' keys must be token ids (integers >= 0), got {shown(key)}", "logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid(
                f"'logit_bias' values must be numbers in [-100, 100], got {shown(bias)}", "logit_bias"
            )
        out.append((token, float(bias)))
    return tuple(sorted(dict(out).items()))


def _stop_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
        raise invalid(
            f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} token ids", "stop_token_ids"
        )
    for token in value:
        if not (isinstance(token, int) and not isinstance(token, bool) and 0 <= token < 1 << 32):
            # The worker refuses ids at or above the model's vocabulary size (it knows it).
            raise invalid(
                f"'stop_token_ids' must hold token ids, integers >= 0 and below the model's "
                f"vocabulary size; got {shown(token)}",
                "stop_token_ids",
            )
    return tuple(value)


def _seed(body: Mapping[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not -(1 << 63) <= value < _UINT64:
        raise invalid(f"'seed' must be a 64-bit integer, got {shown(value)}", "seed")
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


def shown(value: Any) -> str:
    """`value` as the client wrote it: JSON (true, null, "text"), not Python's repr; cut
    after 80 characters."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:79] + "…"


def _replace_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    return replace(sampling, seed=seed)
