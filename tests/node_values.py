"""One value of every type a node can send the main process (wire format 2, docs/security.md "What a
node's messages can do"), and a deep comparison of two values: what tests/transport/test_wire_format.py
round-trips and tests/transport/test_node_fuzz.py mutates."""

from __future__ import annotations

import collections
import dataclasses
import datetime
import enum
import math
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict

from rlharvest.data.flat import FlatLayout
from rlharvest.errors import EpisodeRestartWarning, RemoteFailure
from rlharvest.protocol import Reply
from rlharvest.transport.node_tensors import NUMPY_DTYPES, TORCH_DTYPES


@dataclasses.dataclass
class EnvInfo:
    """A class of the user's, allowed from nodes: rebuilt from its attributes."""

    name: str
    sizes: torch.Tensor
    extra: Any = None


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = 2


class Point(NamedTuple):
    x: float
    y: np.ndarray


USER_CLASSES = (EnvInfo, Mode, Point)


def _failure() -> RemoteFailure:
    try:
        raise ValueError("the env exploded")
    except ValueError as err:
        return RemoteFailure.capture(err, 1)


def _tensors() -> dict[str, torch.Tensor]:
    tensors = {}
    for name, dtype in TORCH_DTYPES.items():
        base = torch.arange(12, dtype=torch.float64) - 3
        tensors[name] = (base > 2) if dtype is torch.bool else base.to(dtype).reshape(3, 4)
    tensors["transposed"] = torch.arange(6.0).reshape(2, 3).t()
    tensors["expanded"] = torch.ones(1, 3).expand(4, 3)
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 5, dtype=torch.int16)
    tensors["grad"] = torch.ones(2, requires_grad=True)
    tensors["conj"] = torch.tensor([1 + 2j]).conj()
    return tensors


def _tensordicts() -> dict[str, Any]:
    td = TensorDict({"obs": torch.arange(8.0).reshape(4, 2), ("next", "reward"): torch.ones(4, 1),
                     "note": NonTensorData("hello", batch_size=[4])}, batch_size=[4], names=["time"])
    stack = LazyStackedTensorDict(*[TensorDict({"x": torch.full((i + 1,), float(i))}, []) for i in range(3)],
                                  stack_dim=0, stack_dim_name="agents")
    notes = NonTensorStack(*[NonTensorData(f"step {i}") for i in range(3)])
    mixed = NonTensorStack(NonTensorData({"a": 1}), NonTensorData([2]), stack_dim=0)  # not plain values
    return {"tensordict": td, "lazy_stack": stack, "non_tensor_stack": notes, "mixed_stack": mixed,
            "nested": TensorDict({"a": TensorDict({"b": torch.zeros(2, 3)}, [2, 3])}, [2], device="cpu")}


def examples() -> dict[str, Any]:
    """``name -> value``: one of every kind a node can send."""
    layout = FlatLayout.of(TensorDict({"a": torch.zeros(2, 3), ("b", "c"): torch.ones(2, dtype=torch.int8)}, [2]))
    values: dict[str, Any] = {
        "plain": [None, True, False, 0, -7, 2**70, 1.5, -0.0, math.inf, "text", "ünï", ""],
        "containers": ([1, (2, 3)], {"k": {"n": [None]}}, {1: "a", (2, "b"): None, None: 1.0}, {1, 2}, frozenset("ab")),
        "std": (collections.OrderedDict(b=1, a=2), collections.Counter("abca"), collections.deque([1, 2], maxlen=3),
                collections.defaultdict(list, {"x": [1]}), range(2, 10, 3), slice(1, None, -1), ..., 3 - 4j),
        "bytes": (b"\x00\xff" * 5, bytearray(b"abc"), b""),
        "times": (datetime.date(2024, 2, 29), datetime.datetime(2024, 1, 2, 3, 4, 5, 6),
                  datetime.datetime(2024, 1, 2, tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
                  datetime.time(1, 2, 3), datetime.timedelta(days=-1, seconds=5)),
        "torch": (torch.float32, torch.bfloat16, torch.device("cpu"), torch.Size([2, 3]),
                  torch.nn.Parameter(torch.ones(3))),
        "numpy": ([np.arange(6, dtype=name).reshape(2, 3) for name in NUMPY_DTYPES if name != "bool"]
                  + [np.array([True, False]), np.float32(1.5), np.int64(-3), np.bool_(True), np.dtype("int16"),
                     np.arange(6.0).reshape(2, 3).T, np.array([1.0, 2.0], dtype=">f8")]),
        "tensors": _tensors(),
        "tensordicts": _tensordicts(),
        "reply": Reply(7, 1, value=layout, frames=6, times=(0.5, 0.25), host="node-host"),
        "heartbeat": ("hb", 12),
        "failure": Reply(-1, 1, failure=_failure()),
        "weight_messages": [("ack", 3, None), ("ack", 4, (0, 1)), ("staged", 4, (0, 1)), ("error", _failure())],
        "warnings": [(EpisodeRestartWarning, "restarted"), (UserWarning, "careful")],
        "user": (EnvInfo("cartpole", torch.arange(3), extra={"nested": EnvInfo("x", torch.zeros(1))}), Mode.SLOW,
                 Point(1.0, np.ones(2))),
        "state_dict": {"policy_state_dict": collections.OrderedDict(weight=torch.randn(4, 3), bias=torch.zeros(4)),
                       "rlharvest_resume": {"format_version": 1, "rng": {"torch": torch.get_rng_state()}},
                       "frames": 128},
    }
    return values


def same(a: Any, b: Any) -> bool:
    """Whether ``b`` is ``a`` sent and rebuilt: same types, same values (tensors: dtype, shape, values,
    requires_grad; TensorDicts: keys, batch size, names, leaves)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
                and a.device == b.device and bool(torch.equal(a.detach().resolve_conj(), b.detach())))
    if isinstance(a, (np.ndarray, np.generic)):
        return a.dtype.newbyteorder("=") == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, NonTensorStack):
        return a.stack_dim == b.stack_dim and all(same(x, y) for x, y in zip(a.tensordicts, b.tensordicts, strict=True))
    if isinstance(a, LazyStackedTensorDict):
        return (a.stack_dim == b.stack_dim and a.names == b.names
                and all(same(x, y) for x, y in zip(a.tensordicts, b.tensordicts, strict=True)))
    if isinstance(a, NonTensorData):
        return same(a.data, b.data) and a.batch_size == b.batch_size and a.device == b.device
    if isinstance(a, TensorDict):
        return (a.batch_size == b.batch_size and a.names == b.names and a.device == b.device
                and list(a.keys()) == list(b.keys()) and all(same(a.get(k), b.get(k)) for k in a.keys()))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a) and \
            getattr(a, "default_factory", None) is getattr(b, "default_factory", None)
    if isinstance(a, collections.deque):
        return a.maxlen == b.maxlen and same(list(a), list(b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b

