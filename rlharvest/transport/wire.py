"""What the main process decodes from its nodes, without trusting them (docs/security.md, "What a key
holder can do").

* **Hellos**, the first message on every port (command, weight, relay): a JSON array of plain
  values (``str``, ``int``, ``bool``, ``None``), at most :data:`HELLO_MAX` bytes, decoded as a tuple.
  A hello is never unpickled, so a peer that merely holds a key cannot make a listener run code.
* **Messages from nodes to the main process** (replies, heartbeats, acknowledgements) are never
  pickles: they are in wire format 2 (:mod:`.node_codec`), a JSON description of the value and raw
  bytes for its tensors, decoded without importing anything or calling anything of the node's
  choosing, every size bounded before it is allocated (:func:`limit_from_nodes`). A node can still
  send wrong values, as it can send a wrong batch; it cannot make the main process run code, crash
  or allocate what it likes. :func:`allow_from_nodes` adds classes of your own (e.g. what
  ``getattr_env`` returns), rebuilt from their attributes.

Nodes unpickle what the main process sends them as they are: they run the spec it sends anyway.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from .._utils import positive_int
from .node_codec import FORMAT, ClassNotAllowed, NodeMessageError, UnsendableValue, decode, encode, rebuildable

__all__ = ["HELLO_MAX", "WIRE_FORMAT", "ClassNotAllowed", "NodeMessageError", "UnsendableValue", "allow_from_nodes",
           "decode_from_node", "decode_hello", "encode_from_node", "encode_hello", "limit_from_nodes", "node_limit"]

#: the format of the messages nodes send the main process (1: pickles, rlharvest before it)
WIRE_FORMAT = FORMAT

#: the largest hello, in bytes (every hello of the protocol takes less than 300)
HELLO_MAX = 1024
_PLAIN = (str, int, bool, type(None))


def encode_hello(hello: tuple) -> bytes:
    """``hello`` (a tuple of plain values) as the bytes :func:`decode_hello` reads.

    Raises:
        TypeError: for a value that is not a str, int, bool or None.
        ValueError: when it takes more than :data:`HELLO_MAX` bytes.
    """
    for value in hello:
        if not isinstance(value, _PLAIN):
            raise TypeError(f"a hello holds only str, int, bool or None, got {type(value).__name__}")
    data = json.dumps(list(hello), separators=(",", ":")).encode()
    if len(data) > HELLO_MAX:
        raise ValueError(f"a hello takes at most {HELLO_MAX} bytes, this one {len(data)}")
    return data


def decode_hello(data: bytes) -> tuple:
    """The tuple of plain values in ``data``.

    Raises:
        ValueError: for anything else (too long, not JSON, not an array of plain values).
    """
    if len(data) > HELLO_MAX:
        raise ValueError(f"a hello of {len(data)} bytes (at most {HELLO_MAX})")
    try:
        value = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ValueError("a hello that is not a JSON array") from err
    if not isinstance(value, list) or not all(isinstance(item, _PLAIN) for item in value):
        raise ValueError("a hello that is not an array of plain values")
    return tuple(value)


# ---------------------------------------------------------------------------------------------- node messages
#: ``(module, qualified name) -> class``: the user's classes that messages from nodes may hold
_ALLOWED: dict[tuple[str, str], type] = {}
_LOCK = threading.Lock()
#: the most bytes one message from a node may take, and one batch layout of a node announce
_LIMIT = [1 << 32]


def allow_from_nodes(*classes: type) -> None:
    """Let messages from nodes hold instances of ``classes`` (e.g. what ``getattr_env`` returns).

    Such an instance travels as its class's module and qualified name and its attributes (its
    ``__dict__``, each value sent as any other), or for an ``Enum`` its member's name, for a named
    tuple its fields. The main process rebuilds it without calling the class: ``object.__new__``
    and the attributes set, as ``copy.copy`` does; ``__init__``, ``__post_init__`` and
    ``__setstate__`` do not run. Its attributes may hold anything a node can send
    (docs/security.md, "What a node's messages can do"), including other allowed classes.

    Raises:
        TypeError: for what is not such a class (a function, a class with a ``__new__`` of its own,
            or whose instances keep their state in slots).

    Example:
        >>> import dataclasses
        >>> from rlharvest.transport.wire import allow_from_nodes, decode_from_node, encode_from_node
        >>> @dataclasses.dataclass
        ... class Spec:
        ...     name: str
        >>> allow_from_nodes(Spec)
        >>> decode_from_node(encode_from_node(Spec("pong")))
        Spec(name='pong')
    """
    for cls in classes:
        if not isinstance(cls, type):
            raise TypeError(f"allow_from_nodes takes classes, got {cls!r:.80}: messages from nodes are not pickles, "
                            "no function is called to rebuild them (docs/security.md)")
        if not rebuildable(cls):
            raise TypeError(f"allow_from_nodes takes classes whose instances keep their state in their __dict__, "
                            f"enums and named tuples; {cls.__qualname__} has a __new__ of its own or slots")
        with _LOCK:
            _ALLOWED[(cls.__module__, cls.__qualname__)] = cls


def limit_from_nodes(max_bytes: int) -> None:
    """The most bytes one message from a node may take (4 GiB by default), and the most a batch
    layout a node announces may make the main process allocate for its batches. A node that sends
    more is refused (its channel closes, logged at WARNING). Raise it for larger batches, state
    dicts or values than that.

    Raises:
        ValueError: for anything but a positive int.

    Example:
        >>> from rlharvest.transport.wire import limit_from_nodes, node_limit
        >>> limit_from_nodes(8 << 30)
        >>> node_limit()
        8589934592
        >>> limit_from_nodes(4 << 30)
    """
    _LIMIT[0] = positive_int("max_bytes", max_bytes)


def node_limit() -> int:
    """The limit of :func:`limit_from_nodes`."""
    return _LIMIT[0]


def encode_from_node(value: Any) -> bytes:
    """What a node sends for ``value`` (wire format 2, :mod:`.node_codec`).

    Raises:
        UnsendableValue: (a ``TypeError``) for a value the format cannot hold, naming it.
    """
    return encode(value)


def decode_from_node(data: bytes) -> Any:
    """The value of a node's message, with the classes :func:`allow_from_nodes` allowed.

    Raises:
        NodeMessageError: (a ``ValueError``) for anything else; nothing else comes out of it.
    """
    return decode(data, _ALLOWED, _LIMIT[0])
