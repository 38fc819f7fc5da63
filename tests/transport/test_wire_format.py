"""Wire format 2 (rlharvest/transport/node_codec.py): every value a node can send comes back equal; the
user's classes come back once allowed, rebuilt without running their code; everything else, and
every size, is refused before it is allocated (docs/security.md, "What a node's messages can do")."""

from __future__ import annotations

import dataclasses
import functools
import json
import pickle
import struct
import sys

import node_values
import numpy as np
import pytest
import torch
from tensordict import TensorDict

from rlharvest.data.flat import FlatLayout
from rlharvest.errors import WorkerError
from rlharvest.protocol import Reply
from rlharvest.transport.channel import RefusedMessage, listen, new_authkey, open_channel
from rlharvest.transport.listener import ChannelListener
from rlharvest.transport.node_codec import HEADER_MAX, MAX_DEPTH
from rlharvest.transport.torchdist_endpoints import is_node_message
from rlharvest.transport.torchdist_receiver import is_receiver_message
from rlharvest.transport.wire import (ClassNotAllowed, NodeMessageError, UnsendableValue, allow_from_nodes,
                                      decode_from_node, encode_from_node, limit_from_nodes, node_limit)

pytestmark = pytest.mark.timeout(60)

allow_from_nodes(*node_values.USER_CLASSES)


def message(header, buffer: bytes = b"") -> bytes:
    """A message of wire format 2 with this header (any JSON) and buffer."""
    text = json.dumps(header).encode()
    return struct.pack(">4sI", b"RLH\x02", len(text)) + text + buffer


@pytest.mark.parametrize("name", list(node_values.examples()))
def test_every_value_a_node_sends_comes_back_equal(name):
    value = node_values.examples()[name]
    assert node_values.same(value, decode_from_node(encode_from_node(value)))


def test_allowed_classes_are_rebuilt_without_their_code():
    """``object.__new__`` and the attributes: neither ``__init__`` nor ``__post_init__`` runs."""
    calls = []

    @dataclasses.dataclass
    class Probe:
        value: torch.Tensor

        def __post_init__(self):
            calls.append("post_init")

    allow_from_nodes(Probe)
    sent = Probe(torch.arange(3))
    calls.clear()
    received = decode_from_node(encode_from_node(sent))
    assert type(received) is Probe and torch.equal(received.value, sent.value) and calls == []


def test_a_class_not_allowed_is_refused_naming_how_to_allow_it():
    @dataclasses.dataclass
    class Unknown:
        x: int

    with pytest.raises(NodeMessageError, match=r"Unknown, which the main process does not rebuild from nodes: allow "
                                               r"the class with rlharvest.transport.wire.allow_from_nodes"):
        decode_from_node(encode_from_node(("hb", Unknown(1))))
    reply = decode_from_node(encode_from_node(Reply(4, 1, value={"x": Unknown(1)})))  # what getattr_env returned
    error = reply.failure.to_exception("'getattr_env'")
    assert reply.value is None and isinstance(error, ClassNotAllowed) and isinstance(error, WorkerError)
    assert str(error).startswith("worker 1: 'getattr_env' failed with ClassNotAllowed: a node sent a ")


class Slotted:
    __slots__ = ("x",)


class WithNew:
    def __new__(cls, *args):
        return super().__new__(cls)


@pytest.mark.parametrize("thing", [len, lambda: 0, Slotted, WithNew, dict, ValueError, 3])
def test_allow_from_nodes_takes_classes_it_can_rebuild_only(thing):
    with pytest.raises(TypeError, match="allow_from_nodes takes classes"):
        allow_from_nodes(thing)


#: what a node cannot send, made when the test runs (torch warns as it makes some)
UNSENDABLE = {
    "function": lambda: (lambda: 0), "builtin": lambda: print, "object": object, "slots": Slotted,
    "module": lambda: sys,
    "sparse": lambda: torch.zeros(2).to_sparse(),
    "nested": lambda: torch.nested.nested_tensor([torch.zeros(1), torch.zeros(2)]),
    "quantized": lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8),
    "meta": lambda: torch.zeros(2, device="meta"), "numpy text": lambda: np.array(["text"]),
    "numpy object": lambda: np.array([object()]), "numpy record": lambda: np.zeros(2, dtype=[("a", "i4")]),
    "complex32": lambda: torch.complex32,
}


@pytest.mark.filterwarnings("ignore:.*(quantize|nested tensors):UserWarning")
@pytest.mark.parametrize("kind", list(UNSENDABLE))
def test_what_the_format_cannot_hold_is_unsendable_on_the_node(kind):
    with pytest.raises(UnsendableValue):
        encode_from_node(UNSENDABLE[kind]())


def test_a_cycle_is_unsendable():
    loop: list = []
    loop.append(loop)
    with pytest.raises(UnsendableValue, match="nested deeper"):
        encode_from_node(loop)


@pytest.mark.parametrize("header, buffer, problem", [
    (["T", "float32", [4], [1], 0, 16], b"\0" * 8, "bytes at 0"),  # more bytes than the buffer holds
    (["l", ["b", 0, 4], ["b", 0, 4]], b"\0" * 4, "bytes at 0"),  # two values on the same bytes
    (["l", ["b", 4, 4], ["b", 0, 4]], b"\0" * 8, "bytes at 0"),  # a stretch before one already read
    (["T", "float32", [1 << 20], [0], 0, 4], b"\0" * 4, "in 4 bytes"),  # stride 0: 4 bytes into 4 MiB
    (["T", "float32", [2, 2], [2, 1], 0, 12], b"\0" * 12, "in 12 bytes"),  # fewer bytes than elements
    (["T", "float32", [2, 2], [4, 1], 0, 16], b"\0" * 16, "reach past"),  # strides past the bytes
    (["T", "float32", [1] * 65, [1] * 65, 0, 4], b"\0" * 4, "at most 64"),
    (["T", "float32", [-1], [1], 0, 4], b"\0" * 4, "non-negative"),
    (["T", "object", [1], [1], 0, 8], b"\0" * 8, "dtypes"),
    (["T", "qint8", [1], [1], 0, 1], b"\0", "dtypes"),
    (["A", "object", [1], [1], 0, 8], b"\0" * 8, "dtypes"),
    (["T", "float32", [1], [1], 0, 4, {"device": "xla"}], b"\0" * 4, "devices"),
    (["u", "os", "system", {}], b"", "does not rebuild"),
    (["w", "WorkerSpec", 0], b"", "not a wire type"),
    (["w", "Reply", "1", 0, None, None, 0, False, None, None], b"", "Reply.request_id"),
    (["w", "RemoteFailure", 0, "os", "system", "m", 5], b"", "RemoteFailure.traceback"),
    (["x", "os", "system"], b"", None),  # not a warning class: UserWarning
    (["dt", "qint8"], b"", "dtype"),
    (["pickle", "os.system"], b"", "not a value"),
    ([], b"", "not a value"),
    (["d", "unpaired"], b"", "without a value"),
    (["d", ["l"], 1], b"", "unhashable"),
], ids=lambda value: str(value)[:30])
def test_a_malformed_message_is_refused_before_anything_is_allocated(header, buffer, problem):
    data = message(header, buffer)
    if problem is None:
        assert decode_from_node(data) is UserWarning
        return
    with pytest.raises(NodeMessageError, match=problem):
        decode_from_node(data)


def test_sizes_and_depths_are_bounded_before_parsing():
    with pytest.raises(NodeMessageError, match="header of"):
        decode_from_node(struct.pack(">4sI", b"RLH\x02", HEADER_MAX + 1) + b"[" * 64)
    with pytest.raises(NodeMessageError, match="within the message"):
        decode_from_node(struct.pack(">4sI", b"RLH\x02", 100) + b"[]")
    nested = "[\"l\"," * (MAX_DEPTH + 2) + "1" + "]" * (MAX_DEPTH + 2)
    with pytest.raises(NodeMessageError, match="nested deeper"):
        decode_from_node(struct.pack(">4sI", b"RLH\x02", len(nested)) + nested.encode())
    deep = "[" * 100000 + "]" * 100000  # deeper than the JSON parser recurses: still one refusal
    with pytest.raises(NodeMessageError):
        decode_from_node(struct.pack(">4sI", b"RLH\x02", len(deep)) + deep.encode())
    with pytest.raises(UnsendableValue, match="description takes"):
        encode_from_node(["x" * 1000] * (HEADER_MAX // 1000))


def test_a_batch_layout_past_the_limit_is_refused_and_the_limit_can_be_raised():
    layout = FlatLayout.of(TensorDict({"pixels": torch.zeros(4, 1000, dtype=torch.uint8)}, [4]))
    previous = node_limit()
    try:
        limit_from_nodes(2048)
        with pytest.raises(NodeMessageError, match=r"a batch layout of 4032 bytes \(at most 2048"):
            decode_from_node(encode_from_node(layout))
        limit_from_nodes(8192)
        assert decode_from_node(encode_from_node(layout)) == layout
        with pytest.raises(ValueError, match="positive int"):
            limit_from_nodes(0)
    finally:
        limit_from_nodes(previous)


def test_a_message_past_the_limit_is_refused_before_it_is_read(caplog):
    key = new_authkey()
    server = ChannelListener(listen("127.0.0.1", 0), key, "test", handshake_timeout=2.0, user_timeout=5.0)
    previous = node_limit()
    try:
        node = open_channel("127.0.0.1", server.port, key, 5.0, 5.0, 2.0)
        node.send_hello(("hello", 1))
        main, _, _ = server.next(5.0)
        limit_from_nodes(1 << 16)
        node.send(torch.zeros(1 << 15, dtype=torch.uint8))  # within
        assert main.recv().shape == (1 << 15,)
        node.send(torch.zeros(1 << 17, dtype=torch.uint8))  # past it
        with pytest.raises(RefusedMessage, match="a message longer than 65536 bytes"):
            main.recv()
        assert main.closed and "a message longer than 65536 bytes" in caplog.text
        node.close()
    finally:
        limit_from_nodes(previous)
        server.close()


def test_messages_of_other_formats_say_which():
    for data, said in ((pickle.dumps(("hb", 1)), "a pickle: the node runs an older rlharvest"),
                       (b"RLH\x03\0\0\0\0", "wire format 3; this process reads wire format 2"),
                       (b"GET / HTTP/1.1", "not in wire format 2"), (b"RLH\x02\0", "5 bytes, cut short")):
        with pytest.raises(NodeMessageError, match=said):
            decode_from_node(data)


@pytest.mark.parametrize("tag", ["d", "s", "fs", "od"])
def test_keys_whose_hashes_collide_are_refused_before_their_dict_is_built(tag):
    """Ints of one hash (``k * (2**61 - 1)``): 50,000 of them would take hours to put in a dict."""
    keys = [k * (2**61 - 1) for k in range(50_000)]
    items = [part for key in keys for part in (key, None)] if tag in ("d", "od") else keys
    with pytest.raises(NodeMessageError, match="same hash"):
        decode_from_node(message([tag, *items]))
    fine = [k for k in range(50_000)]  # as many keys of distinct hashes pass
    items = [part for key in fine for part in (key, None)] if tag in ("d", "od") else fine
    assert len(decode_from_node(message([tag, *items]))) == 50_000


def test_each_channel_takes_its_own_messages_only(caplog):
    """A node's command channel takes its own replies and heartbeats; its weight channel what a weight
    receiver sends. Anything else closes the channel, as a malformed message does."""
    key = new_authkey()
    server = ChannelListener(listen("127.0.0.1", 0), key, "test", handshake_timeout=2.0, user_timeout=5.0)
    try:
        for check, good, bad in (
                (functools.partial(is_node_message, worker_idx=1), [Reply(3, 1, frames=2), ("hb", 7)],
                 [Reply(3, 2), ("hb", "7"), ("hb", 7, 8), ["hb", 7], None]),
                (is_receiver_message, [("ack", 3, None), ("ack", 3, 5), ("ack", 3, (0, 1)), ("staged", 3, (0, 1)),
                                       ("unrelayed", 3, (1, 2)), ("error", node_values.examples()["failure"].failure)],
                 [("ack", 3, [0, 1]), ("staged", 3, None), ("ack", "3", None), ("error", "boom"), ("ok",), ()])):
            for message in bad:
                node = open_channel("127.0.0.1", server.port, key, 5.0, 5.0, 2.0)
                node.send_hello(("hello", 1))
                main, _, _ = server.next(5.0)
                main.expect(check, "this channel's messages")
                for fine in good:
                    node.send(fine)
                    assert node_values.same(fine, main.recv())
                node.send(message)
                with pytest.raises(RefusedMessage, match="a message that is not this channel's messages"):
                    main.recv()
                assert main.closed
                node.close()
    finally:
        server.close()
