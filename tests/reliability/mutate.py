"""Seeded mutators for fuzzing: hostile field values (the message still parses) and raw
byte damage (it may not). Both are deterministic for a given `random.Random`."""

from __future__ import annotations

import math
import random

from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import Message

_INTS = {
    FD.TYPE_UINT32: [0, 1, 2, 3, 4, 5, 15, 16, 17, 255, 4096, 131_072, 16_777_216, 2**31 - 1, 2**32 - 1],
    FD.TYPE_INT32: [-(2**31), -1, 0, 1, 2, 16, 64, 127, 128, 129, 2048, 2**31 - 1],
    FD.TYPE_UINT64: [0, 1, 2, 2**31, 2**32, 2**53 + 1, 2**63, 2**64 - 1],
    FD.TYPE_INT64: [-(2**63), -1, 0, 1, 2**63 - 1],
}
_FLOATS = [
    math.nan,
    math.inf,
    -math.inf,
    -0.0,
    0.0,
    1e-45,
    1e-30,
    1e-6,
    0.5,
    1.0,
    1.0000001,
    99.99,
    100.0,
    100.00001,
    3.4e38,
    -1.0,
    2.0,
]
_DOUBLES = [*_FLOATS, 5e-324, 1e308, 2_592_000.0, 2_592_000.1]
_STRINGS = [
    "",
    "a",
    "x" * 1025,
    "x" * 70_000,
    "\x00",
    "\x00\x01\x02",
    "😀" * 300,
    "../../etc/passwd",
    "pool-0000",
    "fuzz-pool",
    "Bearer x",
    "\ud7ff\ue000\uffff",
    "é",
    "a" * 128,
    "a" * 129,
    "user",
    "system",
    "assistant",
    "tool",
    "{{ raise_exception('x') }}",
    "%s%n%x",
    "ÿ" * 300,
    "\n" * 50,
]


def mutate_message(message: Message, rng: random.Random, num_mutations: int | None = None) -> Message:
    """A copy of `message` with 1..4 fields set to hostile values (recursing into
    sub-messages and repeated fields). Always serializable."""
    out = type(message)()
    out.CopyFrom(message)
    for _ in range(num_mutations or rng.randint(1, 4)):
        _mutate_some_field(out, rng, depth=0)
    return out


def _mutate_some_field(message: Message, rng: random.Random, depth: int) -> None:
    fields = message.DESCRIPTOR.fields
    if not fields:
        return
    field = rng.choice(fields)
    name = field.name
    is_repeated = field.is_repeated
    if field.type == FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
        _mutate_map(getattr(message, name), field.message_type, rng, depth)
        return
    if field.type == FD.TYPE_MESSAGE:
        if is_repeated:
            items = getattr(message, name)
            roll = rng.random()
            if roll < 0.15 and items:
                del items[rng.randrange(len(items))]
            elif roll < 0.25 and items:
                for _ in range(rng.choice([2, 10, 200])):
                    items.add().CopyFrom(items[rng.randrange(len(items))])
            elif depth < 3:
                item = items[rng.randrange(len(items))] if items and rng.random() < 0.6 else items.add()
                _mutate_some_field(item, rng, depth + 1)
        elif depth < 3:
            if rng.random() < 0.1:
                message.ClearField(name)
            else:
                _mutate_some_field(getattr(message, name), rng, depth + 1)
        return
    if is_repeated:
        values = getattr(message, name)
        roll = rng.random()
        if roll < 0.2:
            del values[:]
        elif roll < 0.35 and values:
            values[rng.randrange(len(values))] = _scalar(field, rng)
        elif roll < 0.5:
            values.extend(_scalar(field, rng) for _ in range(rng.choice([1000, 5000, 50_000])))
        elif roll < 0.6 and values:
            del values[rng.randrange(len(values)) :]
        else:
            values.extend(_scalar(field, rng) for _ in range(rng.randint(1, 8)))
        return
    if field.has_presence and rng.random() < 0.1:
        message.ClearField(name)
    else:
        setattr(message, name, _scalar(field, rng))


def _scalar(field, rng: random.Random):
    kind = field.type
    if kind in _INTS:
        edges = _INTS[kind]
        if rng.random() < 0.7:
            return rng.choice(edges)
        lo, hi = min(edges), max(edges)
        return rng.randint(max(lo, -1000), min(hi, 100_000)) if rng.random() < 0.7 else rng.randint(lo, hi)
    if kind == FD.TYPE_FLOAT:
        return rng.choice(_FLOATS) if rng.random() < 0.8 else rng.uniform(-10, 200)
    if kind == FD.TYPE_DOUBLE:
        return rng.choice(_DOUBLES) if rng.random() < 0.8 else rng.uniform(-10, 1e6)
    if kind == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if kind == FD.TYPE_STRING:
        if rng.random() < 0.75:
            return rng.choice(_STRINGS)
        return "".join(
            chr(rng.choice([rng.randint(32, 126), rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]))
            for _ in range(rng.randint(1, 40))
        )
    if kind == FD.TYPE_BYTES:
        return rng.randbytes(rng.randint(0, 64))
    if kind == FD.TYPE_ENUM:
        return rng.choice([v.number for v in field.enum_type.values])
    raise AssertionError(f"unhandled field type {kind} of {field.full_name}")


def mutate_bytes(data: bytes, rng: random.Random, others: list[bytes]) -> bytes:
    """`data` with 1..4 byte-level injuries: flips, inserts, deletes, duplicated spans,
    truncation, splices of other messages, random or invalid-UTF-8 fields."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(10)
        pos = rng.randint(0, len(out))
        if op == 0 and out:
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
        elif op == 1 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 2:
            out[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and out:
            del out[pos : pos + rng.randint(1, 16)]
        elif op == 4 and out:
            end = min(len(out), pos + rng.randint(1, 32))
            out[pos:pos] = out[pos:end] * rng.randint(1, 8)
        elif op == 5:
            del out[pos:]
        elif op == 6 and others:
            other = rng.choice(others)
            cut = rng.randint(0, len(other))
            out = out[:pos] + bytearray(other[cut:])
        elif op == 7:
            out += (
                _varint(rng.randint(1, 40) << 3 | 2)
                + b"\x02"
                + rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0", b"\x80\x80"])
            )
        elif op == 8:
            wire = rng.choice([0, 1, 2, 3, 4, 5, 6, 7])
            out += _varint(rng.randint(1, 2**29 - 1) << 3 | wire) + rng.randbytes(rng.randint(0, 12))
        else:
            out = bytearray(rng.randbytes(rng.randint(0, 48)))
    return bytes(out)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _mutate_map(entries, entry_type, rng: random.Random, depth: int) -> None:
    """A map field (e.g. logit_bias): cleared, flooded, or one entry set to hostile values."""
    key_field, value_field = entry_type.fields_by_name["key"], entry_type.fields_by_name["value"]
    roll = rng.random()
    if roll < 0.2:
        entries.clear()
        return
    for _ in range(rng.choice([1, 1, 1, 1000, 50_000]) if roll < 0.5 else 1):
        key = _scalar(key_field, rng)
        if value_field.type == FD.TYPE_MESSAGE:
            if depth < 3:
                _mutate_some_field(entries[key], rng, depth + 1)
        else:
            entries[key] = _scalar(value_field, rng)
