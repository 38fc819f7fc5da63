"""What the batched envs and their sub-envs share (``batched.py``, ``parallel.py`` and the sub-env side,
``_subenv_worker.py``): the commands, the statuses on the reply board, the buffers a sub-env's row lives
in, what a sub-env says of itself, and how values become tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._utils import NestedKey

__all__ = ['FLAGS', 'Layout', 'SubEnvCommand', 'PAYLOAD_COMMANDS', 'Status', 'ReplyBoard', 'Unavailable', 'Buffers', 'SubEnvDescription', 'FirstStep', 'value_meta', 'as_tensor', 'bool_array', 'Slot', 'slots_of']


#: root-level done flags: they travel in their own buffers, never as observations
FLAGS = ("done", "terminated", "truncated")
Layout = dict  # {nested key: (shape, dtype)}

_PY_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float32}
_NUMPY_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.float32, torch.float64}


class SubEnvCommand(enum.IntEnum):
    """What a batched env asks a sub-env to do; one byte on the command pipe."""

    STEP = 1        # read the action buffers, write the next buffers (+ reset what ended)
    RESET = 2       # full reset
    RESET_ROWS = 3  # reset the rows set in the reset-mask buffer (batched sub-envs)
    SEED = 4        # payload (seed, static_seed) -> the next seed
    ATTACH = 5      # payload Buffers
    CLOSE = 6
    CAPTURE = 7     # -> the sub-env's state, pickled (or why it cannot be captured)
    RESTORE = 8     # payload: what CAPTURE returned -> None, or why it cannot be restored
    RECONFIGURE = 9  # payload: an EnvOp (envs/reconfigure.py) -> what it returned


#: commands followed by a pickled payload on the command connection
PAYLOAD_COMMANDS = frozenset({SubEnvCommand.SEED, SubEnvCommand.ATTACH, SubEnvCommand.RESTORE,
                              SubEnvCommand.RECONFIGURE})


class Status(enum.IntEnum):
    """What a sub-env's answer carries, written to its status slot before it replies."""

    OK = 0       # nothing
    PAYLOAD = 1  # a pickled result follows on its connection
    FAILED = 2   # a pickled RemoteFailure follows on its connection
    WAITING = 3  # set by the parent when it sends a command: no answer yet


class ReplyBoard:
    """How sub-envs answer a round of commands: a status per sub-env, and one wake-up for the parent.

    The parent sets ``remaining`` to the number of sub-envs it commanded; each decrements it under
    ``lock`` when done, and the last one writes a byte to the reply pipe. The parent thus wakes up
    once per round instead of once per sub-env (each wake-up is a context switch, ~10-40 us here).
    """

    def __init__(self, ctx, num_workers: int) -> None:
        self.status = torch.full((num_workers,), Status.OK, dtype=torch.int8).share_memory_()
        self.remaining = torch.zeros(1, dtype=torch.int64).share_memory_()
        self.lock = ctx.Lock()
        self.reply_r, self.reply_w = ctx.Pipe(duplex=False)


@dataclass(frozen=True)
class Unavailable:
    """A sub-env's answer to CAPTURE or RESTORE when its state cannot be captured or restored."""

    reason: str


@dataclass
class Buffers:
    """The batched env's buffers; the leading dim is the sub-env index."""

    actions: dict
    root: dict
    #: (W, *sub_batch) bool: the row was reset after its last step (set by sub-envs, cleared by the env)
    pending: torch.Tensor
    #: (W, *sub_batch) bool: the rows RESET_ROWS resets
    reset_mask: torch.Tensor
    next: dict | None = None
    reward: torch.Tensor | None = None
    terminated: torch.Tensor | None = None
    truncated: torch.Tensor | None = None


@dataclass
class SubEnvDescription:
    """What a sub-env tells the batched env once, at start."""

    batch_size: torch.Size
    root_layout: Layout
    action_layout: Layout
    observation_specs: dict
    action_specs: dict
    has_truncated: bool
    reward_key: NestedKey
    name: str = ""

    def signature(self) -> tuple:
        """What must agree between sub-envs for their data to stack."""
        return (tuple(self.batch_size), self.root_layout, self.action_layout, self.has_truncated, self.reward_key)


@dataclass
class FirstStep:
    """A sub-env's first outcome: its values define the layout of the next buffers."""

    next: dict = field(default_factory=dict)
    reward: torch.Tensor | None = None
    terminated: torch.Tensor | None = None
    truncated: torch.Tensor | None = None

    def layout(self) -> tuple:
        return ({k: (tuple(v.shape), v.dtype) for k, v in self.next.items()},
                (tuple(self.reward.shape), self.reward.dtype))


def value_meta(value: Any, key: NestedKey = None) -> tuple[tuple, torch.dtype]:
    """``(shape, dtype)`` of an array-protocol value (Python scalars stand for shape ``(1,)``)."""
    tensor = as_tensor(value, key)
    return tuple(tensor.shape), tensor.dtype


def as_tensor(value: Any, key: NestedKey = None) -> torch.Tensor:
    """A value of a step as a tensor.

    Raises:
        TypeError: for entries that do not fit a fixed buffer (non-tensor data, sub-TensorDicts).
    """
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, np.generic):
        return torch.from_numpy(np.asarray(value).reshape(1))
    if type(value) in _PY_DTYPES:
        return torch.tensor([value], dtype=_PY_DTYPES[type(value)])
    raise TypeError(f"batched envs carry tensor entries only: {key!r} is a {type(value).__name__} (non-tensor "
                    "data and sub-TensorDicts of their own shape cannot live in the shared buffers).")


def bool_array(value: Any, shape: tuple) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.numpy(force=True)
    return np.asarray(value, dtype=bool).reshape(shape)


class Slot:
    """One key of one sub-env's row of a buffer: writes a tensor, an array or a Python scalar in place."""

    __slots__ = ("tensor", "array")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        # numpy assignment costs ~0.3 us against ~2 us for Tensor.copy_ of a tiny tensor
        self.array = tensor.numpy() if tensor.dtype in _NUMPY_DTYPES else None

    def write(self, value: Any) -> None:
        array = self.array
        if array is None:
            self.tensor.copy_(as_tensor(value).reshape(self.tensor.shape))
            return
        if isinstance(value, (bool, int, float)):
            array[...] = value
            return
        if isinstance(value, torch.Tensor):
            value = value.numpy(force=True) if value.dtype in _NUMPY_DTYPES else value.float().numpy(force=True)
        if np.shape(value) != array.shape:  # (B,) flags for a (B, 1) slot, say
            value = np.reshape(value, array.shape)
        array[...] = value


def slots_of(buffers: dict, index: int) -> dict:
    return {key: Slot(tensor[index]) for key, tensor in buffers.items()}
