"""Tensors, numpy arrays and TensorDicts in the messages of nodes (:mod:`.node_codec`, docs/security.md).

A tensor travels as its raw bytes in the message's buffer and a description in its header:
``["T", dtype, shape, strides, offset, nbytes]`` (plus ``{"grad": 1, "param": 1, "device": "cuda:0"}``
when they apply). Only plain numeric and bool dtypes travel (:data:`TORCH_DTYPES`); sparse, nested,
quantized and meta tensors do not: a node that tries gets a :class:`TypeError` naming the tensor.

Decoding checks everything against the bytes before it allocates: the dtype is one of the list, the
shape and strides are lists of at most :data:`MAX_DIMS` non-negative ints, every element the strides
reach lies in the tensor's own bytes, and the tensor takes no more bytes than the node sent for it
(a stride of 0 cannot make 8 bytes into 800 MB). The result owns its memory (a copy of those bytes).
numpy arrays are tensors rebuilt with ``.numpy()``; a numpy object, structured or string dtype never
travels, so numpy is never asked to trust a pickled dtype.

Errors: encoding raises ``TypeError``, decoding ``ValueError`` (or whatever torch raises); the codec
turns them into its own two errors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase

__all__ = ["MAX_DIMS", "NUMPY_DTYPES", "TORCH_DTYPES", "encode_array", "encode_tensor", "encode_tensordict",
           "decode_array", "decode_tensor", "DECODERS"]

#: the most dimensions a tensor from a node may have
MAX_DIMS = 64
#: the tensor dtypes that travel, by name: plain numbers and bools, nothing whose bytes mean more
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                  torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                  torch.complex64, torch.complex128)
}
_TORCH_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
#: the numpy dtypes that travel (the same numbers, native byte order), by name
NUMPY_DTYPES: dict[str, np.dtype] = {name: np.dtype(name) for name in TORCH_DTYPES if name != "bfloat16"}
_DEVICE_TYPES = ("cpu", "cuda")
_PLAIN = (str, int, float, bool, type(None))


# ---------------------------------------------------------------------------------------------- encoding
def encode_tensor(encoder, tensor: torch.Tensor) -> list:
    """The header of ``tensor``; its bytes go to ``encoder.put``."""
    if tensor.layout is not torch.strided or tensor.is_nested or tensor.is_quantized or tensor.is_meta:
        raise TypeError(f"a node sends dense tensors with data only, not a {tensor.layout} "
                        f"{'nested ' if tensor.is_nested else ''}tensor on {tensor.device}")
    name = _TORCH_NAMES.get(tensor.dtype)
    if name is None:
        raise TypeError(f"a node sends tensors of the dtypes {', '.join(TORCH_DTYPES)}, not {tensor.dtype}")
    options = {}
    if tensor.requires_grad:
        options["grad"] = 1
    if isinstance(tensor, torch.nn.Parameter):
        options["param"] = 1
    if tensor.device.type != "cpu":
        options["device"] = str(tensor.device)
    data = tensor.detach().as_subclass(torch.Tensor).cpu().resolve_conj().resolve_neg().contiguous()
    offset, nbytes = encoder.put(data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b"")
    header = ["T", name, list(data.shape), list(data.stride()), offset, nbytes]
    return header + [options] if options else header


def encode_array(encoder, array: np.ndarray | np.generic) -> list:
    """The header of a numpy array (``"A"``) or scalar (``"a"``); its bytes go to ``encoder.put``."""
    name = array.dtype.name
    if name not in NUMPY_DTYPES or array.dtype.newbyteorder("=") != NUMPY_DTYPES[name]:
        raise TypeError(f"a node sends numpy arrays of the dtypes {', '.join(NUMPY_DTYPES)}, not {array.dtype}")
    data = np.ascontiguousarray(array, dtype=NUMPY_DTYPES[name])  # native byte order
    offset, nbytes = encoder.put(data.reshape(-1).view(np.uint8) if data.size else b"")
    if isinstance(array, np.generic):
        return ["a", name, offset, nbytes]
    return ["A", name, list(data.shape), _contiguous(list(data.shape)), offset, nbytes]


def encode_tensordict(encoder, td: TensorDictBase, depth: int) -> list:
    """The header of a TensorDict, a lazy stack, non-tensor data or a stack of them."""
    device = None if td.device is None else str(td.device)
    if isinstance(td, NonTensorStack):
        if _plain_stack(td):  # e.g. a text env's strings: one value each, ten times faster to rebuild
            return ["NSv", [item.data for item in td.tensordicts]]
        return ["NS", td.stack_dim, [encode_tensordict(encoder, item, depth + 1) for item in td.tensordicts]]
    if isinstance(td, LazyStackedTensorDict):
        members = [encode_tensordict(encoder, item, depth + 1) for item in td.tensordicts]
        return ["LT", td.stack_dim, _stack_dim_name(td), members]
    if isinstance(td, NonTensorData):
        return ["NT", encoder.value(td.data, depth + 1), list(td.batch_size), device]
    if type(td) is not TensorDict:
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"a node sends TensorDicts, lazy stacks and non-tensor data, not a {type(td).__name__}")
        td = td.to_tensordict()
    names = list(td.names) if any(name is not None for name in td.names) else None
    entries = {key: _entry(encoder, value, depth + 1) for key, value in td.items()}
    return ["TD", entries, list(td.batch_size), device, names]


def _plain_stack(stack: NonTensorStack) -> bool:
    """A stack of plain values along its first dim (what ``NonTensorStack(*values)`` builds)."""
    return stack.stack_dim == 0 and stack.device is None and all(
        type(item) is NonTensorData and item.device is None and not item.batch_size and type(item.data) in _PLAIN
        for item in stack.tensordicts)


def _entry(encoder, value: Any, depth: int) -> Any:
    if isinstance(value, torch.Tensor):
        return encode_tensor(encoder, value)
    if isinstance(value, (TensorDictBase, NonTensorData)):
        return encode_tensordict(encoder, value, depth)
    raise TypeError(f"a TensorDict entry of type {type(value).__name__} cannot be sent by a node")


def _stack_dim_name(td: LazyStackedTensorDict) -> str | None:
    try:
        return td.names[td.stack_dim]
    except (RuntimeError, ValueError, IndexError):  # members that disagree on names have none
        return None


# ---------------------------------------------------------------------------------------------- decoding
def _dims(value: Any, what: str) -> list[int]:
    if type(value) is not list or len(value) > MAX_DIMS or not all(type(n) is int and 0 <= n < 1 << 62 for n in value):
        raise ValueError(f"{what} must be a list of at most {MAX_DIMS} non-negative ints, got {value!r:.80}")
    return value


def decode_tensor(decoder, node: list) -> torch.Tensor:
    """A tensor described by ``node`` (``["T", dtype, shape, strides, offset, nbytes, options?]``)."""
    if len(node) not in (6, 7):
        raise ValueError("a tensor is described by [dtype, shape, strides, offset, nbytes, options?]")
    options = node[6] if len(node) == 7 else {}
    if type(options) is not dict or not set(options) <= {"grad", "param", "device"}:
        raise ValueError(f"tensor options are grad, param and device, got {options!r:.80}")
    tensor = _tensor(decoder, TORCH_DTYPES.get(node[1]) if type(node[1]) is str else None, *node[2:6])
    if "device" in options:
        device = torch.device(options["device"]) if type(options["device"]) is str else None
        if device is None or device.type not in _DEVICE_TYPES:
            raise ValueError(f"tensors from nodes go to the devices {_DEVICE_TYPES}, not {options['device']!r:.40}")
        tensor = tensor.to(device)
    if options.get("param"):
        return torch.nn.Parameter(tensor, requires_grad=bool(options.get("grad")))
    return tensor.requires_grad_() if options.get("grad") else tensor


def decode_array(decoder, node: list) -> np.ndarray | np.generic:
    """A numpy array (``["A", dtype, shape, strides, offset, nbytes]``) or scalar (``["a", dtype,
    offset, nbytes]``)."""
    scalar = node[0] == "a"
    if len(node) != (4 if scalar else 6) or type(node[1]) is not str or node[1] not in NUMPY_DTYPES:
        raise ValueError(f"a numpy value of the dtypes {', '.join(NUMPY_DTYPES)}, got {node[:2]!r:.80}")
    dims = ([], []) if scalar else node[2:4]
    array = _tensor(decoder, TORCH_DTYPES[node[1]], *dims, *node[-2:]).numpy()
    return array[()] if scalar else array


def _tensor(decoder, dtype: torch.dtype | None, shape: Any, strides: Any, offset: Any, nbytes: Any) -> torch.Tensor:
    """The checks of the module docstring, then a tensor that owns a copy of its bytes."""
    if dtype is None:
        raise ValueError(f"tensors from nodes have the dtypes {', '.join(TORCH_DTYPES)}")
    shape, strides = _dims(shape, "a shape"), _dims(strides, "strides")
    if len(strides) != len(shape):
        raise ValueError(f"shape {shape} and strides {strides} differ in length")
    region = decoder.take(offset, nbytes)
    itemsize, numel = dtype.itemsize, math.prod(shape)
    if numel * itemsize > len(region):
        raise ValueError(f"a tensor of shape {shape} and dtype {dtype} in {len(region)} bytes")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    reach = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    if reach * itemsize > len(region) or len(region) % itemsize:
        raise ValueError(f"strides {strides} of shape {shape} reach past the tensor's {len(region)} bytes")
    flat = torch.frombuffer(bytearray(region), dtype=torch.uint8 if dtype is torch.bool else dtype)
    tensor = flat.as_strided(shape, strides)  # torch checks the bounds again
    if strides != _contiguous(shape):
        tensor = tensor.clone()  # no two elements share memory; at most the bytes sent (numel checked)
    return tensor != 0 if dtype is torch.bool else tensor  # a bool is 0 or 1, whatever byte was sent


def _contiguous(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _batch_size(value: Any) -> list[int]:
    return _dims(value, "a batch size")


def _device(value: Any) -> str | None:
    if value is None:
        return None
    if type(value) is not str or torch.device(value).type not in _DEVICE_TYPES:
        raise ValueError(f"TensorDicts from nodes are on the devices {_DEVICE_TYPES} or none, not {value!r:.40}")
    return value


def _decode_td(decoder, node: list, depth: int) -> TensorDict:
    if len(node) != 5 or type(node[1]) is not dict:
        raise ValueError("a TensorDict is described by [entries, batch size, device, names]")
    _, entries, batch_size, device, names = node
    batch_size = _batch_size(batch_size)
    if names is not None and (type(names) is not list or len(names) != len(batch_size)
                              or not all(n is None or type(n) is str for n in names)):
        raise ValueError(f"names must be a list of str or None per batch dim, got {names!r:.80}")
    values = {}
    for key, entry in entries.items():
        value = decoder.value(entry, depth + 1)
        if not isinstance(value, (torch.Tensor, TensorDictBase, NonTensorData)):
            raise ValueError(f"a TensorDict entry of type {type(value).__name__}")
        values[key] = value
    return TensorDict(values, batch_size=batch_size, device=_device(device), names=names)


def _stack_dim(value: Any, members: Any) -> int:
    if type(value) is not int or not 0 <= value <= MAX_DIMS or type(members) is not list or not members:
        raise ValueError("a stack is described by [stack dim, ..., members] with at least one member")
    return value


def _decode_lazy(decoder, node: list, depth: int) -> LazyStackedTensorDict:
    if len(node) != 4 or (node[2] is not None and type(node[2]) is not str):
        raise ValueError("a lazy stack is described by [stack dim, stack dim name, members]")
    stack_dim = _stack_dim(node[1], node[3])
    members = [decoder.value(member, depth + 1) for member in node[3]]
    if not all(type(member) in (TensorDict, LazyStackedTensorDict) for member in members):
        raise ValueError("the members of a lazy stack are TensorDicts or lazy stacks")
    return LazyStackedTensorDict(*members, stack_dim=stack_dim, stack_dim_name=node[2])


def _decode_non_tensor(decoder, node: list, depth: int) -> NonTensorData:
    if len(node) != 4:
        raise ValueError("non-tensor data is described by [value, batch size, device]")
    return NonTensorData(decoder.value(node[1], depth + 1), batch_size=_batch_size(node[2]), device=_device(node[3]))


def _decode_non_tensor_stack(decoder, node: list, depth: int) -> NonTensorStack:
    if len(node) != 3:
        raise ValueError("a stack of non-tensor data is described by [stack dim, members]")
    stack_dim = _stack_dim(node[1], node[2])
    members = [decoder.value(member, depth + 1) for member in node[2]]
    if not all(type(member) in (NonTensorData, NonTensorStack) for member in members):
        raise ValueError("the members of a stack of non-tensor data are non-tensor data or stacks of them")
    return NonTensorStack(*members, stack_dim=stack_dim)


def _decode_plain_stack(decoder, node: list, depth: int) -> NonTensorStack:
    if len(node) != 2 or type(node[1]) is not list or not node[1] or not all(type(v) in _PLAIN for v in node[1]):
        raise ValueError("a stack of plain values is described by [values] with at least one value")
    return NonTensorStack(*node[1])


#: ``tag -> decode(decoder, node, depth)`` for the tags of this module
DECODERS = {
    "T": lambda decoder, node, depth: decode_tensor(decoder, node),
    "A": lambda decoder, node, depth: decode_array(decoder, node),
    "a": lambda decoder, node, depth: decode_array(decoder, node),
    "TD": _decode_td,
    "LT": _decode_lazy,
    "NT": _decode_non_tensor,
    "NS": _decode_non_tensor_stack,
    "NSv": _decode_plain_stack,
}
