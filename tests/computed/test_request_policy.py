"""computed's request policy, pure: plain inputs, a validated request or a domain error."""

from __future__ import annotations

import pytest

from computed.errors import CapacityError, RequestError
from computed.request_policy import GenerateInput, RequestPolicy, WorkerInfo


class ByteTokenizer:
    """One token per UTF-8 byte; a chat renders as 'role: content' lines."""

    has_chat_template = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def policy(max_model_len: int = 32, num_blocks: int = 64, block_size: int = 4) -> RequestPolicy:
    info = WorkerInfo(
        model_id="m",
        model_revision="r",
        architecture="llama",
        dtype="float32",
        device="cpu",
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        vocab_size=256,
        eos_token_ids=(0,),
        blockd_address="",
    )
    return RequestPolicy(info, ByteTokenizer())


def test_defaults_and_the_default_max_tokens_is_clamped_to_the_context() -> None:
    admitted = policy().admit(GenerateInput(prompt="x" * 30, cache_salt="s", request_id="r1"))
    assert admitted.prompt_token_ids == [ord("x")] * 30
    assert admitted.params.max_tokens == 2 and admitted.params.is_greedy and admitted.params.top_p == 1.0
    assert (admitted.cache_salt, admitted.request_id) == ("s", "r1")


def test_an_explicit_max_tokens_that_cannot_fit_is_refused() -> None:
    with pytest.raises(RequestError, match="at most 2 completion tokens fit; lower max_tokens to 2"):
        policy().admit(GenerateInput(prompt="x" * 30, max_tokens=3))


@pytest.mark.parametrize(
    "request_, message",
    [
        (GenerateInput(), "empty prompt"),
        (GenerateInput(prompt="a", prompt_token_ids=[1]), "exactly one"),
        (GenerateInput(prompt_token_ids=[300]), "out of range"),
        (GenerateInput(prompt="x" * 32), "context is 32"),
        (GenerateInput(messages=[("", "hi")]), "needs a role"),
        (GenerateInput(prompt="a", stop_token_ids=[256]), "vocab size"),
        (GenerateInput(prompt="a", cache_salt="s" * 1025), "cache_salt"),
        (GenerateInput(prompt="a", request_id="r" * 257), "request_id"),
        (GenerateInput(prompt="a", top_p=0.0), "top_p"),
    ],
)
def test_bad_requests_say_what_to_fix(request_: GenerateInput, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        policy().admit(request_)


def test_a_prompt_larger_than_the_pool_is_a_capacity_error() -> None:
    with pytest.raises(CapacityError, match="needs 3 KV blocks but the pool holds 2"):
        policy(num_blocks=2).admit(GenerateInput(prompt_token_ids=[1] * 8))


def test_a_denormal_temperature_samples_greedily() -> None:
    assert policy().admit(GenerateInput(prompt="a", temperature=1e-45)).params.is_greedy


def test_tokenize_renders_a_chat_or_encodes_text() -> None:
    assert policy().tokenize("", [("user", "hi")], add_special_tokens=True) == (
        list(b"user: hi\n"),
        "user: hi\n",
    )
    assert policy().tokenize("hi", [], add_special_tokens=True) == (list(b"hi"), "")
    with pytest.raises(RequestError, match="not both"):
        policy().tokenize("hi", [("user", "hi")], add_special_tokens=True)


def test_the_first_out_of_range_id_is_named_among_valid_ones() -> None:
    tokens = [1] * 10 + [300, 1, 999, 2]
    with pytest.raises(
        RequestError, match=r"prompt_token_ids: token id 300 is out of range; the vocab has 256"
    ):
        policy().admit(GenerateInput(prompt_token_ids=tokens))
    assert policy().admit(GenerateInput(prompt_token_ids=[255] * 20)).prompt_token_ids == [255] * 20
