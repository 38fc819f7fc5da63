"""What the main process decodes from its nodes, without trusting them (docs/security.md, "What a key
holder can do").

* **Hellos**, the first message on every port (command, weight, relay): a JSON array of plain
  values (``str``, ``int``, ``bool``, ``None``), at most :data:`HELLO_MAX` bytes, decoded as a tuple.
  A hello is never unpickled, so a peer that merely holds a key cannot make a listener run code.
* **Messages from nodes to the main process** (replies, heartbeats, acknowledgements) are pickles,
  unpickled by :class:`NodeUnpickler`: it resolves only the globals of an allow-list (the wire types
  of the worker loop, tensors, tensordicts, numpy arrays and the plain containers of the standard
  library); any other global, however harmless, fails the message. A node can still send wrong
  values, as it can send a wrong batch; it cannot make the main process call what it likes.
  :func:`allow_from_nodes` adds types of your own (e.g. what ``getattr_env`` returns).

Nodes unpickle what the main process sends them as they are: they run the spec it sends anyway.
"""

from __future__ import annotations

import builtins
import importlib
import io
import json
import pickle
import sys
import threading
from typing import Any

import torch

__all__ = ["HELLO_MAX", "allow_from_nodes", "decode_hello", "encode_hello", "loads_from_node", "NodeUnpickler"]

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
#: ``module -> names`` a node's message may refer to (classes built, functions called by the unpickler)
_ALLOWED: dict[str, frozenset[str]] = {
    "builtins": frozenset({"bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                           "object", "range", "set", "slice", "str", "tuple", "NoneType", "Ellipsis",
                           "NotImplemented"}),
    "collections": frozenset({"OrderedDict", "defaultdict", "deque", "Counter"}),
    "datetime": frozenset({"date", "datetime", "time", "timedelta", "timezone"}),
    "copyreg": frozenset({"_reconstructor"}),
    "torch": frozenset({"Size", "device", "Tensor", "dtype"}),
    "torch._utils": frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                               "_rebuild_parameter_with_state", "_rebuild_sparse_tensor", "_rebuild_nested_tensor",
                               "_rebuild_meta_tensor_no_storage", "_rebuild_qtensor",
                               "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor"}),
    "torch._tensor": frozenset({"_rebuild_from_type_v2"}),
    "torch.nn.parameter": frozenset({"Parameter", "Buffer"}),
    "numpy": frozenset({"ndarray", "dtype"}),
    "numpy.core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy._core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy.random._pickle": frozenset({"__bit_generator_ctor", "__randomstate_ctor", "__generator_ctor"}),
    "numpy.random.mtrand": frozenset({"RandomState"}),
    "numpy.random._generator": frozenset({"Generator"}),
    "numpy.random._pcg64": frozenset({"PCG64"}),
    "numpy.random._mt19937": frozenset({"MT19937"}),
    "tensordict._td": frozenset({"TensorDict"}),
    "tensordict._lazy": frozenset({"LazyStackedTensorDict"}),
    "tensordict.tensorclass": frozenset({"NonTensorData", "NonTensorStack"}),
    "rlharvest.protocol": frozenset({"Reply", "Message", "Command"}),
    "rlharvest.errors": frozenset({"RemoteFailure"}),
    "rlharvest.data.flat": frozenset({"FlatLayout", "_Entry"}),
}
_EXTRA: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def allow_from_nodes(*objects: Any) -> None:
    """Let messages from nodes hold instances of ``objects`` (classes, or functions their pickles call).

    Only add types whose construction has no effect outside the object: the unpickler calls them
    with arguments a node chooses.

    Raises:
        TypeError: for an object without a module and a qualified name.

    Example:
        >>> from rlharvest.transport.wire import allow_from_nodes
        >>> class Spec: ...
        >>> allow_from_nodes(Spec)
    """
    for obj in objects:
        module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        if not isinstance(module, str) or not isinstance(name, str):
            raise TypeError(f"allow_from_nodes takes classes or functions, got {obj!r:.80}")
        with _LOCK:
            _EXTRA[(module, name)] = obj


def _load_storage(data: bytes):
    """What ``torch.storage._load_from_bytes`` returns, loaded with torch's own allow-list."""
    return torch.load(io.BytesIO(data), weights_only=True)


def _resolve(module: str, name: str) -> Any:
    extra = _EXTRA.get((module, name))
    if extra is not None:
        return extra
    if module == "torch.storage" and name == "_load_from_bytes":
        return _load_storage  # torch's own would unpickle the storage's bytes without restriction
    if "." in name:
        return None  # a nested attribute path: never needed by an allowed type
    if module == "builtins":
        obj = getattr(builtins, name, None)
        if name in _ALLOWED["builtins"] or (isinstance(obj, type) and issubclass(obj, BaseException)):
            return obj
        return None
    if module == "torch":
        obj = getattr(torch, name, None)
        if name in _ALLOWED["torch"] or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return obj
        return None
    if name in _ALLOWED.get(module, ()):
        loaded = sys.modules.get(module) or importlib.import_module(module)
        return getattr(loaded, name, None)
    loaded = sys.modules.get(module)  # a warning category of a module already imported (load_state_dict)
    obj = getattr(loaded, name, None) if loaded is not None else None
    return obj if isinstance(obj, type) and issubclass(obj, Warning) else None


class NodeUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals of the allow-list (module docstring)."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _resolve(module, name)
        if obj is None:
            raise pickle.UnpicklingError(
                f"a node sent {module}.{name}, which the main process does not unpickle from nodes: add the type "
                "with rlharvest.transport.wire.allow_from_nodes if it is yours (docs/security.md).")
        return obj


def loads_from_node(data: bytes) -> Any:
    """Unpickle a node's message with :class:`NodeUnpickler`.

    Raises:
        pickle.UnpicklingError: for a global outside the allow-list.
    """
    return NodeUnpickler(io.BytesIO(data)).load()
