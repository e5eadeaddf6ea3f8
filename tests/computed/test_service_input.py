"""The servicer's wire -> plain values step for Generate (computed.service._generate_input)."""

from __future__ import annotations

import random

import pytest

from computed.service import _generate_input
from kvcache.v1 import generation_pb2 as pb


@pytest.mark.parametrize("length", [1, 64, 65, 4160])
def test_prompt_token_ids_arrive_as_a_list_of_ints_equal_to_the_field(length: int) -> None:
    rng = random.Random(length)
    ids = [rng.randrange(2**32) for _ in range(length)]
    ids[-1] = 2**32 - 1  # the largest uint32 survives the conversion
    wire = pb.GenerateRequest.FromString(pb.GenerateRequest(prompt_token_ids=ids).SerializeToString())
    given = _generate_input(wire).prompt_token_ids
    assert type(given) is list and given == ids
    assert all(type(t) is int for t in given)


def test_an_empty_field_is_an_empty_list() -> None:
    assert _generate_input(pb.GenerateRequest(prompt="hi")).prompt_token_ids == []
