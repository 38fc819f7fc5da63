"""Wire format 2: how a node's messages to the main process are written, and read without trusting
them (docs/security.md, "What a node's messages can do").

A message is ``b"RLH\\x02"``, the length of its header (4 bytes, big-endian), the header (JSON) and
one buffer of raw bytes. The header describes the value as a tree:

* ``null``, ``true``/``false``, numbers and strings are themselves; a JSON object is a ``dict`` with
  ``str`` keys;
* every other value is a JSON array whose first item is a tag: ``["l", ...]`` a list, ``["t", ...]``
  a tuple, ``["d", key, value, ...]`` a dict with other keys, ``["b", offset, length]`` bytes in the
  buffer, ``["T", ...]`` a tensor (:mod:`.node_tensors`), ``["w", "Reply", ...]`` one of the wire
  dataclasses (fields by position, each checked for its type), ``["u", module, qualname, state]``
  an object of a class the user allowed (:func:`~rlharvest.transport.wire.allow_from_nodes`),
  ``["x", module, qualname]`` a warning class (``UserWarning`` if it is not loaded here), ...
  (:data:`_TAGS`).

Reading is bounded before anything is allocated: the whole message by the channel (the limit of
:func:`~rlharvest.transport.wire.limit_from_nodes`), the header to :data:`HEADER_MAX` bytes and
:data:`MAX_DEPTH` levels, every stretch of the buffer to the bytes that follow the ones read before
it (no two values share bytes, so the values take at most the bytes sent), a batch layout to the
limit, the keys of a mapping or set that share one hash to a few (building their dict would take
quadratic time). Nothing is imported and nothing of the node's choosing is called: classes come from the
lists here, from the user's allowed classes (rebuilt from their ``__dict__``, never through their
constructor), or are warning classes already loaded. Every failure is one :class:`NodeMessageError`.

Writing (on nodes) raises :class:`UnsendableValue` (a ``TypeError``) for what the format cannot hold.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import json
import struct
from typing import Any, Callable, Mapping

import numpy as np
import torch
from tensordict import NonTensorData, TensorDictBase

from ..data.flat import FlatLayout
from ..errors import RemoteFailure, loaded_exception_class
from ..protocol import Reply
from .node_tensors import DECODERS, NUMPY_DTYPES, TORCH_DTYPES, encode_array, encode_tensor, encode_tensordict

__all__ = ["FORMAT", "HEADER_MAX", "MAX_DEPTH", "ClassNotAllowed", "NodeMessageError", "UnsendableValue", "decode",
           "encode", "rebuildable"]

#: the version of this format (1: pickles, before it)
FORMAT = 2
_MAGIC = b"RLH" + bytes([FORMAT])
_PREFIX = struct.Struct(">4sI")
#: the largest header, in bytes: a header's parse takes up to ~25 times its size
HEADER_MAX = 8 << 20
#: the deepest nesting of values in a message
MAX_DEPTH = 100


class NodeMessageError(ValueError):
    """A message from a node that the main process does not decode (malformed, of another format, or
    holding a type it does not rebuild); the channel that carried it is closed."""


class ClassNotAllowed(NodeMessageError):
    """A node sent an object of a class the main process was not told to rebuild
    (:func:`~rlharvest.transport.wire.allow_from_nodes`). As the value of a reply, it is that reply's
    failure (the node asked for it is not to blame); anywhere else, the message's refusal."""


class UnsendableValue(TypeError):
    """A value a node cannot send to the main process (wire format 2 cannot hold it)."""


def rebuildable(cls: type) -> bool:
    """Whether instances of ``cls`` can travel as a class of the user's: an ``Enum``, a named tuple, or
    a class whose instances keep their state in their ``__dict__`` and that has no ``__new__`` of its
    own (rebuilt with ``object.__new__`` and their attributes, running none of the class's code)."""
    if issubclass(cls, enum.Enum):
        return True
    if issubclass(cls, tuple):
        return isinstance(getattr(cls, "_fields", None), tuple)
    return cls.__new__ is object.__new__ and cls.__dictoffset__ != 0


# ---------------------------------------------------------------------------------------------- the wire types
def _is(kind) -> Callable[[Any], bool]:
    return lambda value: type(value) is kind


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _any(value: Any) -> bool:
    return True


def _times(value: Any) -> bool:
    return value is None or (type(value) is tuple and len(value) == 2 and all(type(v) in (int, float) for v in value))


#: the dataclasses of the protocol a node sends, by name: the class and a check of each field's value
_WIRE: dict[str, tuple[type, tuple[Callable[[Any], bool], ...]]] = {
    "Reply": (Reply, (_is(int), _is(int), _any, _optional(_is(RemoteFailure)), _is(int), _is(bool), _times,
                      _optional(_is(str)))),
    "RemoteFailure": (RemoteFailure, (_optional(_is(int)), _is(str), _is(str), _is(str), _is(str))),
    "FlatLayout": (FlatLayout, (_is(tuple), _is(tuple), _optional(_is(tuple)), _is(int))),  # it checks the rest
}
_WIRE_NAMES = {cls: (name, tuple(field.name for field in dataclasses.fields(cls))) for name, (cls, _) in _WIRE.items()}
#: the types JSON holds as they are
_SCALARS = frozenset({type(None), bool, int, float, str})
_JSON_OUT = json.JSONEncoder(separators=(",", ":"))
_JSON_IN = json.JSONDecoder()
_FACTORIES = {None: None, "list": list, "dict": dict, "set": set, "int": int, "float": float, "str": str}


# ---------------------------------------------------------------------------------------------- encoding
class _Encoder:
    def __init__(self) -> None:
        self.chunks: list = []
        self.size = 0

    def put(self, data) -> list[int]:
        """Append ``data`` (bytes-like) to the buffer; its ``[offset, length]``."""
        length = memoryview(data).nbytes
        self.chunks.append(data)
        self.size += length
        return [self.size - length, length]

    def value(self, obj: Any, depth: int = 0) -> Any:
        kind = type(obj)
        if kind in _SCALARS:
            return obj
        if depth > MAX_DEPTH:
            raise TypeError(f"values nested deeper than {MAX_DEPTH} levels (or a cycle) cannot be sent")
        if kind is dict and all(type(key) is str for key in obj):
            return {key: self.value(item, depth + 1) for key, item in obj.items()}
        encode = _ENCODERS.get(kind)
        if encode is not None:
            return encode(self, obj, depth + 1)
        return self.other(obj, depth + 1)

    def items(self, tag: str, values, depth: int) -> list:
        return [tag, *[self.value(value, depth) for value in values]]

    def wire(self, obj: Any, depth: int) -> list:
        name, fields = _WIRE_NAMES[type(obj)]
        return ["w", name, *[self.value(getattr(obj, field), depth) for field in fields]]

    def pairs(self, tag: str, mapping, depth: int) -> list:
        return [tag, *(self.value(part, depth) for pair in mapping.items() for part in pair)]

    def other(self, obj: Any, depth: int) -> Any:
        """Tensors, arrays, TensorDicts, wire dataclasses, warning classes and the user's classes."""
        if isinstance(obj, torch.Tensor):
            return encode_tensor(self, obj)
        if isinstance(obj, (np.ndarray, np.generic)):
            return encode_array(self, obj)
        if isinstance(obj, np.dtype):  # numpy's dtypes are subclasses of np.dtype
            return ["ndt", obj.name if obj in NUMPY_DTYPES.values() else _no_dtype(obj)]
        if isinstance(obj, (TensorDictBase, NonTensorData)):
            return encode_tensordict(self, obj, depth)
        cls = type(obj)
        if isinstance(obj, type) and issubclass(obj, Warning):
            return ["x", obj.__module__, obj.__qualname__]
        if rebuildable(cls):  # the main process rebuilds it if the user allowed its class there
            if isinstance(obj, enum.Enum):
                return ["u", cls.__module__, cls.__qualname__, obj.name]
            if isinstance(obj, tuple):
                return ["u", cls.__module__, cls.__qualname__, self.items("t", obj, depth)]
            state = vars(obj)
            if all(type(key) is str for key in state):
                return ["u", cls.__module__, cls.__qualname__, {key: self.value(v, depth) for key, v in state.items()}]
        raise TypeError(f"a node cannot send a {cls.__module__}.{cls.__qualname__} to the main process "
                        "(docs/security.md, \"What a node's messages can do\", lists what it can)")


def _encode_complex(encoder: _Encoder, obj: Any, depth: int) -> list:
    return ["c", obj.real, obj.imag]


def _encode_datetime(encoder: _Encoder, obj: Any, depth: int) -> list:
    if isinstance(obj, (datetime.datetime, datetime.time)) and obj.tzinfo is not None and \
            type(obj.tzinfo) is not datetime.timezone:
        raise TypeError(f"a node sends times without a time zone or with a fixed offset, not {obj.tzinfo!r}")
    return ["dtm", type(obj).__name__, obj.isoformat()]


def _encode_defaultdict(encoder: _Encoder, obj: collections.defaultdict, depth: int) -> list:
    factory = obj.default_factory
    name = None if factory is None else getattr(factory, "__name__", None)
    if name not in _FACTORIES or _FACTORIES[name] is not factory:
        raise TypeError(f"a node sends defaultdicts of {', '.join(str(n) for n in _FACTORIES)}, not of {factory!r}")
    return ["dd", name, *encoder.pairs("dd", obj, depth)[1:]]


_ENCODERS: dict[type, Callable[[_Encoder, Any, int], Any]] = {
    list: lambda encoder, obj, depth: encoder.items("l", obj, depth),
    tuple: lambda encoder, obj, depth: encoder.items("t", obj, depth),
    dict: lambda encoder, obj, depth: encoder.pairs("d", obj, depth),
    set: lambda encoder, obj, depth: encoder.items("s", obj, depth),
    frozenset: lambda encoder, obj, depth: encoder.items("fs", obj, depth),
    collections.OrderedDict: lambda encoder, obj, depth: encoder.pairs("od", obj, depth),
    collections.Counter: lambda encoder, obj, depth: encoder.pairs("ct", obj, depth),
    collections.deque: lambda encoder, obj, depth: ["dq", obj.maxlen, *encoder.items("l", obj, depth)[1:]],
    collections.defaultdict: _encode_defaultdict,
    bytes: lambda encoder, obj, depth: ["b", *encoder.put(obj)],
    bytearray: lambda encoder, obj, depth: ["ba", *encoder.put(obj)],
    complex: _encode_complex,
    range: lambda encoder, obj, depth: ["rg", obj.start, obj.stop, obj.step],
    slice: lambda encoder, obj, depth: ["sl", *(encoder.value(v, depth) for v in (obj.start, obj.stop, obj.step))],
    type(Ellipsis): lambda encoder, obj, depth: ["..."],
    datetime.date: _encode_datetime,
    datetime.datetime: _encode_datetime,
    datetime.time: _encode_datetime,
    datetime.timedelta: lambda encoder, obj, depth: ["td", obj.days, obj.seconds, obj.microseconds],
    torch.dtype: lambda encoder, obj, depth: ["dt", _dtype_name(obj)],
    torch.device: lambda encoder, obj, depth: ["dev", str(obj)],
    torch.Size: lambda encoder, obj, depth: ["sz", *obj],
    **{cls: _Encoder.wire for cls in _WIRE_NAMES},
}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise TypeError(f"a node sends the dtypes {', '.join(TORCH_DTYPES)}, not {dtype}")
    return name


def _no_dtype(dtype: Any) -> str:
    raise TypeError(f"a node sends the numpy dtypes {', '.join(NUMPY_DTYPES)}, not {dtype}")


def encode(value: Any) -> bytes:
    """``value`` in wire format 2.

    Raises:
        UnsendableValue: for a value the format cannot hold (the message names it).
    """
    encoder = _Encoder()
    try:
        header = _JSON_OUT.encode(encoder.value(value)).encode("ascii")
    except Exception as err:  # on the node: whatever it is, the node says what it could not send
        raise UnsendableValue(f"{type(err).__name__}: {err}" if not isinstance(err, TypeError) else str(err)) from None
    if len(header) > HEADER_MAX:
        raise UnsendableValue(f"a message whose description takes {len(header)} bytes (at most {HEADER_MAX}): "
                              "send large data as tensors or arrays")
    return b"".join([_PREFIX.pack(_MAGIC, len(header)), header, *encoder.chunks])


# ---------------------------------------------------------------------------------------------- decoding
class _Decoder:
    def __init__(self, data: bytes, types: Mapping[tuple[str, str], type], max_bytes: int) -> None:
        self.types, self.max_bytes = types, max_bytes
        if len(data) < _PREFIX.size or data[:4] != _MAGIC:
            raise NodeMessageError(_format_problem(bytes(data[:4])) if len(data) >= _PREFIX.size else
                                   f"a message of {len(data)} bytes, cut short")
        _, length = _PREFIX.unpack_from(data)
        if length > min(HEADER_MAX, len(data) - _PREFIX.size):
            raise NodeMessageError(f"a header of {length} bytes (at most {HEADER_MAX}, and within the message)")
        text = bytes(data[_PREFIX.size:_PREFIX.size + length]).decode("ascii")
        self.header, end = _JSON_IN.scan_once(text, 0)  # the C scanner: what JSONDecoder.decode runs, less its checks
        if end != len(text):
            raise ValueError(f"a header with {len(text) - end} bytes after its value")
        self.buffer = memoryview(data)[_PREFIX.size + length:]
        self.cursor = 0

    def take(self, offset: Any, length: Any) -> memoryview:
        """The stretch of the buffer at ``offset``: after every stretch read before, within the buffer."""
        if type(offset) is not int or type(length) is not int or not self.cursor <= offset <= len(self.buffer) \
                or not 0 <= length <= len(self.buffer) - offset:
            raise ValueError(f"bytes at {offset!r:.20} ({length!r:.20} long) outside the unread "
                             f"{self.cursor}..{len(self.buffer)} of the buffer")
        self.cursor = offset + length
        return self.buffer[offset:offset + length]

    def value(self, node: Any, depth: int = 0) -> Any:
        kind = type(node)
        if kind in _SCALARS:
            return node
        if depth > MAX_DEPTH:
            raise ValueError(f"values nested deeper than {MAX_DEPTH} levels")
        if kind is dict:
            return {key: self.value(item, depth + 1) for key, item in node.items()}
        if kind is not list or not node or type(node[0]) is not str or node[0] not in _TAGS:
            raise ValueError(f"{str(node)[:60]!r} is not a value of wire format {FORMAT}")
        return _TAGS[node[0]](self, node, depth + 1)

    def values(self, nodes: list, depth: int) -> list:
        return [node if type(node) in _SCALARS else self.value(node, depth) for node in nodes]

    def pairs(self, node: list, depth: int) -> list[tuple]:
        if len(node) % 2 == 0:
            raise ValueError(f"a mapping of {node[0]!r} with a key without a value")
        items = self.values(node[1:], depth)
        return list(zip(_few_collisions(items[::2]), items[1::2]))

    def keys(self, node: list, depth: int) -> list:
        """The items of a set: as the keys of a mapping."""
        return _few_collisions(self.values(node[1:], depth))

    def wire(self, node: list, depth: int) -> Any:
        cls, checks = _WIRE.get(node[1], (None, ())) if len(node) > 1 and type(node[1]) is str else (None, ())
        if cls is None or len(node) != 2 + len(checks):
            raise ValueError(f"{str(node[:2])[:60]} is not a wire type ({', '.join(_WIRE)}) with its fields")
        fields, refused = self._fields_of(cls, node[2:], depth)
        for name, check, value in zip(_WIRE_NAMES[cls][1], checks, fields):
            if not check(value):
                raise ValueError(f"{node[1]}.{name} cannot be a {type(value).__name__} ({value!r:.60})")
        if refused is not None:
            fields[3] = RemoteFailure(fields[1], __name__, ClassNotAllowed.__qualname__, str(refused), "")
        obj = cls(*fields)
        if cls is FlatLayout and obj.total_bytes > self.max_bytes:
            raise ValueError(f"a batch layout of {obj.total_bytes} bytes (at most {self.max_bytes}: "
                             "rlharvest.transport.wire.limit_from_nodes)")
        return obj

    def _fields_of(self, cls: type, nodes: list, depth: int) -> tuple[list, ClassNotAllowed | None]:
        """The fields of a wire dataclass; a reply's value of a class not allowed is None, and the refusal."""
        fields, refused = [], None
        for index, item in enumerate(nodes):
            try:
                fields.append(item if type(item) in _SCALARS else self.value(item, depth))
            except ClassNotAllowed as err:
                if cls is not Reply or index != 2:
                    raise
                fields.append(None)
                refused = err
        return fields, refused

    def user(self, node: list, depth: int) -> Any:
        if len(node) != 4 or type(node[1]) is not str or type(node[2]) is not str:
            raise ValueError("an object is described by [module, qualified name, state]")
        cls = self.types.get((node[1], node[2]))
        if cls is None:
            raise ClassNotAllowed(
                f"a node sent a {node[1]}.{node[2]}, which the main process does not rebuild from nodes: allow "
                "the class with rlharvest.transport.wire.allow_from_nodes if it is yours (docs/security.md)")
        state = node[3]
        if issubclass(cls, enum.Enum):
            if type(state) is not str or state not in cls.__members__:
                raise ValueError(f"{state!r:.40} is not a member of {cls.__qualname__}")
            return cls.__members__[state]
        if issubclass(cls, tuple):
            return tuple.__new__(cls, self._fields(cls, self.value(state, depth)))
        if type(state) is not dict:
            raise ValueError(f"the state of a {cls.__qualname__} is a dict of its attributes")
        obj = object.__new__(cls)  # no constructor of the class runs (allow_from_nodes checked it has none)
        obj.__dict__.update({key: self.value(item, depth + 1) for key, item in state.items()})
        return obj

    @staticmethod
    def _fields(cls: type, values: Any) -> tuple:
        if type(values) is not tuple or len(values) != len(cls._fields):
            raise ValueError(f"a {cls.__qualname__} has the fields {cls._fields}")
        return values

    def warning_class(self, node: list, depth: int) -> type[Warning]:
        """A warning class this process has loaded already; else ``UserWarning`` (never an import)."""
        found = loaded_exception_class(*node[1:]) if len(node) == 3 else None
        return found if found is not None and issubclass(found, Warning) else UserWarning


#: the most keys of one mapping or set that may share a hash
_COLLISIONS = 64


def _few_collisions(keys: list) -> list:
    """``keys``, if at most :data:`_COLLISIONS` of them share a hash. Ints, floats and tuples of them
    hash the same in every process: a node could send 400,000 keys of one hash (``k * (2**61 - 1)``),
    and building their dict would take hours."""
    if len(keys) > _COLLISIONS and max(collections.Counter(map(hash, keys)).values()) > _COLLISIONS:
        raise ValueError(f"more than {_COLLISIONS} keys of a mapping or set with the same hash")
    return keys


def _format_problem(magic: bytes) -> str:
    if magic[:1] == b"\x80":
        return ("a pickle: the node runs an older rlharvest (its messages are pickles, wire format 1); this "
                f"process reads wire format {FORMAT}: install the same rlharvest version on every node")
    if magic[:3] == b"RLH" and len(magic) == 4:
        return (f"a message in wire format {magic[3]}; this process reads wire format {FORMAT}: install the same "
                "rlharvest version on every node")
    return f"a message that is not in wire format {FORMAT} (it starts with {magic!r})"


def _ints(node: list, count: int, what: str) -> list[int]:
    if len(node) != count + 1 or not all(type(value) is int for value in node[1:]):
        raise ValueError(f"{what} is {count} ints")
    return node[1:]


def _decode_complex(decoder: _Decoder, node: list, depth: int) -> complex:
    if len(node) != 3 or not all(type(v) in (int, float) for v in node[1:]):
        raise ValueError("a complex number is [real, imaginary]")
    return complex(node[1], node[2])


def _decode_datetime(decoder: _Decoder, node: list, depth: int) -> Any:
    kinds = {"date": datetime.date, "datetime": datetime.datetime, "time": datetime.time}
    if len(node) != 3 or node[1] not in kinds or type(node[2]) is not str or len(node[2]) > 64:
        raise ValueError("a date or time is [kind, ISO format]")
    return kinds[node[1]].fromisoformat(node[2])


def _decode_defaultdict(decoder: _Decoder, node: list, depth: int) -> collections.defaultdict:
    if len(node) < 2 or node[1] not in _FACTORIES:
        raise ValueError(f"a defaultdict's factory is one of {list(_FACTORIES)}")
    return collections.defaultdict(_FACTORIES[node[1]], decoder.pairs(["dd", *node[2:]], depth))


def _decode_deque(decoder: _Decoder, node: list, depth: int) -> collections.deque:
    if len(node) < 2 or (node[1] is not None and (type(node[1]) is not int or node[1] < 0)):
        raise ValueError("a deque is [maxlen, items...]")
    return collections.deque(decoder.values(node[2:], depth), node[1])


def _decode_bytes(decoder: _Decoder, node: list, depth: int) -> bytes | bytearray:
    if len(node) != 3:
        raise ValueError("bytes are [offset, length]")
    data = decoder.take(node[1], node[2])
    return bytes(data) if node[0] == "b" else bytearray(data)


def _decode_dtype(decoder: _Decoder, node: list, depth: int) -> Any:
    table = TORCH_DTYPES if node[0] == "dt" else NUMPY_DTYPES
    if len(node) != 2 or type(node[1]) is not str or node[1] not in table:
        raise ValueError(f"a dtype of {', '.join(table)}")
    return table[node[1]]


def _decode_device(decoder: _Decoder, node: list, depth: int) -> torch.device:
    if len(node) != 2 or type(node[1]) is not str or len(node[1]) > 32:
        raise ValueError("a device is [name]")
    return torch.device(node[1])


#: ``tag -> decode(decoder, node, depth)``
_TAGS: dict[str, Callable[[_Decoder, list, int], Any]] = {
    "l": lambda decoder, node, depth: decoder.values(node[1:], depth),
    "t": lambda decoder, node, depth: tuple(decoder.values(node[1:], depth)),
    "d": lambda decoder, node, depth: dict(decoder.pairs(node, depth)),
    "s": lambda decoder, node, depth: set(decoder.keys(node, depth)),
    "fs": lambda decoder, node, depth: frozenset(decoder.keys(node, depth)),
    "od": lambda decoder, node, depth: collections.OrderedDict(decoder.pairs(node, depth)),
    "ct": lambda decoder, node, depth: collections.Counter(dict(decoder.pairs(node, depth))),
    "dq": _decode_deque,
    "dd": _decode_defaultdict,
    "b": _decode_bytes,
    "ba": _decode_bytes,
    "c": _decode_complex,
    "rg": lambda decoder, node, depth: range(*_ints(node, 3, "a range")),
    "sl": lambda decoder, node, depth: slice(*decoder.values(node[1:], depth)),  # 1 to 3 values
    "...": lambda decoder, node, depth: ...,
    "dtm": _decode_datetime,
    "td": lambda decoder, node, depth: datetime.timedelta(*_ints(node, 3, "a time difference")),
    "dt": _decode_dtype,
    "ndt": _decode_dtype,
    "dev": _decode_device,
    "sz": lambda decoder, node, depth: torch.Size(_ints(node, len(node) - 1, "a torch.Size")),
    "w": _Decoder.wire,
    "u": _Decoder.user,
    "x": _Decoder.warning_class,
    **DECODERS,
}


def decode(data: bytes, types: Mapping[tuple[str, str], type], max_bytes: int) -> Any:
    """The value of a message from a node (wire format 2).

    Args:
        data: the message (authenticated bytes, at most ``max_bytes`` long).
        types: the user's allowed classes, by ``(module, qualified name)``.
        max_bytes: the largest batch layout a node may announce.

    Raises:
        NodeMessageError: for anything but a well-formed message of allowed values (never another
            exception, and never a ``BaseException`` that is not an ``Exception``).
    """
    try:
        decoder = _Decoder(data, types, max_bytes)
        return decoder.value(decoder.header)
    except NodeMessageError:
        raise
    except Exception as err:
        raise NodeMessageError(f"a malformed message ({type(err).__name__}: {str(err)[:200]})") from None
