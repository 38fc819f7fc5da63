"""Fuzzing what the main process decodes from nodes (wire format 2, rlharvest/transport/node_codec.py):
valid messages of every type a node can send (tests/node_values.py), mutated (bytes flipped, cut
short, header fields replaced by huge numbers, wrong types and other tags, headers and buffers
swapped), each decoded in a forked child (tests/forked.py) with its address space capped: every
case must end as a value or one ``NodeMessageError``, never a signal, another exception or a
``MemoryError``, and a child's peak memory must stay near where it started.

``RLH_FUZZ_CASES`` (default 3000) and ``RLH_FUZZ_SEED`` (default 51) choose how many cases and which.
"""

from __future__ import annotations

import json
import os
import random
import resource
import struct

import forked
import node_values
import pytest

from rlharvest.transport.node_codec import NodeMessageError
from rlharvest.transport.wire import allow_from_nodes, decode_from_node, encode_from_node

pytestmark = pytest.mark.timeout(300)

CASES = int(os.environ.get("RLH_FUZZ_CASES", "3000"))
SEED = int(os.environ.get("RLH_FUZZ_SEED", "51"))
PER_CHILD = 250
#: what a mutation puts in place of a field of the header
ODD = [0, -1, 1, 7, 63, 64, 65, 2**31, 2**32 + 8, 2**62, 2**63, 2**64 + 1, 10**30, -(2**63), 1.5, float("inf"), "",
       "float32", "bool", "T", "w", "u", "Reply", "FlatLayout", "builtins", "os", "x" * 300, None, True, [], {},
       [0] * 70, [2**40, 2**40], {"grad": 1}, {"device": "cuda:99"}, ["T", "float32", [2**31], [0], 0, 4],
       ["b", 0, 2**40], ["l"] * 3, ["w", "Reply"], ["u", "os", "system", {}], ["x", "builtins", "SystemExit"]]


def corpus() -> list[bytes]:
    allow_from_nodes(*node_values.USER_CLASSES)
    messages = []
    for value in node_values.examples().values():
        messages.append(encode_from_node(value))
        if isinstance(value, (list, tuple)):
            messages.extend(encode_from_node(item) for item in value)
        if isinstance(value, dict):
            messages.extend(encode_from_node(item) for item in value.values())
    return messages


def _split(data: bytes) -> tuple[object, bytes]:
    length = struct.unpack_from(">I", data, 4)[0]
    return json.loads(data[8:8 + length]), data[8 + length:]


def _join(header: object, buffer: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack(">4sI", b"RLH\x02", len(text)) + text + buffer


def _nodes(tree: object, path: tuple = ()) -> list[tuple]:
    """The paths to every node of a JSON tree."""
    found = [path]
    if isinstance(tree, list):
        for index, item in enumerate(tree):
            found += _nodes(item, path + (index,))
    elif isinstance(tree, dict):
        for key, item in tree.items():
            found += _nodes(item, path + (key,))
    return found


def _replace(tree: object, path: tuple, value: object) -> object:
    if not path:
        return value
    copy = list(tree) if isinstance(tree, list) else dict(tree)
    copy[path[0]] = _replace(copy[path[0]], path[1:], value)
    return copy


def mutate(rng: random.Random, messages: list[bytes]) -> bytes:
    data = rng.choice(messages)
    kind = rng.randrange(6)
    if kind == 0:  # bytes flipped anywhere
        raw = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    if kind == 1:  # cut short
        return data[:rng.randrange(len(data))]
    if kind == 2:  # the header's length
        return data[:4] + struct.pack(">I", rng.choice([0, 1, len(data), 2**31, 2**32 - 1])) + data[8:]
    header, buffer = _split(data)
    if kind == 3:  # another message's buffer, or more or fewer bytes
        other = _split(rng.choice(messages))[1]
        return _join(header, rng.choice([other, buffer[: len(buffer) // 2], buffer * 2, b""]))
    paths = _nodes(header)
    for _ in range(rng.randint(1, 3)):  # fields replaced: odd values, or another field of the message
        path = rng.choice(paths)
        header = _replace(header, path, rng.choice(ODD) if kind == 4 else _pick(header, rng.choice(paths)))
        paths = _nodes(header)
    return _join(header, buffer)


def _pick(tree: object, path: tuple) -> object:
    for step in path:
        tree = tree[step]
    return tree


_first_peak: list[int] = []  # in a child: its peak memory before its first case


def decode_one(data: bytes) -> dict:
    """In the child: what one case came to, and how far the child's peak memory grew so far."""
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    if not _first_peak:
        _first_peak.append(peak())
    try:
        outcome = f"value {type(decode_from_node(data)).__name__}"
    except NodeMessageError as err:
        outcome = f"refused {err}"[:200]
    return {"outcome": outcome, "growth": peak() - _first_peak[0]}


def test_the_decoder_survives_mutated_messages_of_every_type():
    messages = corpus()
    rng = random.Random(SEED)
    cases = [mutate(rng, messages) for _ in range(CASES)]
    failures, outcomes = [], []
    for first in range(0, len(cases), PER_CHILD):
        chunk = cases[first:first + PER_CHILD]
        while chunk:
            ended = forked.run_each(decode_one, chunk, headroom=1 << 30, timeout=120.0)
            for line in ended.lines:
                if "value" not in line or "MemoryError" in line["value"]["outcome"]:
                    failures.append(f"{line}")
                else:
                    outcomes.append(line["value"])
            if len(ended.lines) == len(chunk):
                assert ended.status == 0, ended.why()
                break
            culprit = chunk[len(ended.lines)]  # the case the child did not finish: it crashed or hung on it
            failures.append(f"{ended.why()} on {culprit[:200]!r}")
            chunk = chunk[len(ended.lines) + 1:]
    assert not failures, f"seed {SEED}: {len(failures)} of {len(cases)} cases failed, first ones: {failures[:5]}"
    growth = max(outcome["growth"] for outcome in outcomes)
    assert growth < 256 << 20, f"a case took {growth >> 20} MiB"
    refused = sum(outcome["outcome"].startswith("refused") for outcome in outcomes)
    assert 0 < refused < len(cases), refused  # mutations that still decode, and ones that do not
