"""A circular replay buffer of frames backed by one TensorDict storage.

Thread-safe out of the box. A multi-process collector makes it *process-safe* before starting its
workers (:meth:`ReplayBuffer.make_process_safe`): the cursor and counters move to shared memory,
the lock becomes a process lock, and once the storage layout is known (first batch) the storage is
allocated in shared memory and attached in every worker, which then write into it directly.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

__all__ = ["ReplayBuffer"]

_CURSOR, _LENGTH, _WRITES = 0, 1, 2


class ReplayBuffer:
    """Frames in a circular storage of fixed ``capacity``.

    ``extend(batch)`` writes every frame of ``batch`` (all batch dims flattened, in order);
    ``sample()`` draws frames uniformly.

    Args:
        capacity: frames kept; older frames are overwritten.
        batch_size: default number of frames per ``sample()``.

    Example:
        >>> from tensordict import TensorDict
        >>> rb = ReplayBuffer(capacity=100, batch_size=4)
        >>> _ = rb.extend(TensorDict({"x": torch.arange(10)}, batch_size=[10]))
        >>> len(rb), rb.write_count, rb.sample().shape
        (10, 10, torch.Size([4]))
    """

    def __init__(self, capacity: int = 1_000_000, *, batch_size: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self.batch_size = batch_size
        self._storage: TensorDictBase | None = None
        self._counters = torch.zeros(3, dtype=torch.int64)
        self._lock: Any = threading.RLock()
        self._process_safe = False

    # ------------------------------------------------------------------ process safety
    def make_process_safe(self, mp_context) -> None:
        """Move counters (and storage, if any) to shared memory and use a process lock."""
        if self._process_safe:
            return
        self._counters.share_memory_()
        self._lock = mp_context.RLock()
        if self._storage is not None:
            self._storage.share_memory_()
        self._process_safe = True

    @property
    def is_process_safe(self) -> bool:
        return self._process_safe

    @property
    def storage(self) -> TensorDictBase | None:
        """The storage TensorDict of shape ``(capacity,)`` (None until the first write)."""
        return self._storage

    def init_storage(self, example: TensorDictBase) -> TensorDictBase:
        """Allocate the storage from the layout of one frame batch (in shared memory if process-safe)."""
        with self._lock:
            if self._storage is None:
                frame = example.reshape(-1)[0]
                storage = frame.expand(self.capacity).clone().zero_()
                if self._process_safe:
                    storage.share_memory_()
                self._storage = storage
            return self._storage

    def attach_storage(self, storage: TensorDictBase) -> None:
        """Use a storage allocated elsewhere (a worker attaching the parent's shared storage)."""
        self._storage = storage

    # ------------------------------------------------------------------ writing
    def extend(self, data: TensorDictBase) -> torch.Tensor:
        """Append every frame of ``data``; returns the indices written."""
        frames = data.reshape(-1) if data.batch_dims != 1 else data
        count = frames.shape[0]
        if count == 0:
            return torch.empty(0, dtype=torch.int64)
        if self._storage is None:
            self.init_storage(frames)
        with self._lock:
            cursor = int(self._counters[_CURSOR])
            if count >= self.capacity:
                frames = frames[-self.capacity :]
                written = count
                count = self.capacity
                cursor = 0
            else:
                written = count
            index = (torch.arange(count) + cursor) % self.capacity
            self._write(index, frames)
            self._counters[_CURSOR] = (cursor + count) % self.capacity
            self._counters[_LENGTH] = min(self.capacity, int(self._counters[_LENGTH]) + count)
            self._counters[_WRITES] += written
        return index

    def _write(self, index: torch.Tensor, frames: TensorDictBase) -> None:
        start, stop = int(index[0]), int(index[-1]) + 1
        if stop - start == len(index):  # contiguous: one slice copy per leaf
            self._storage[start:stop].update_(frames.select(*self._storage.keys(True, True)))
        else:
            self._storage[index] = frames.select(*self._storage.keys(True, True))

    def add(self, data: TensorDictBase) -> int:
        """Append one frame."""
        return int(self.extend(data.unsqueeze(0))[0])

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return int(self._counters[_LENGTH])

    @property
    def write_count(self) -> int:
        """Frames written since creation (keeps growing after the buffer is full)."""
        return int(self._counters[_WRITES])

    def sample(self, batch_size: int | None = None) -> TensorDictBase:
        """``batch_size`` frames drawn uniformly (with replacement)."""
        batch_size = batch_size or self.batch_size
        if batch_size is None:
            raise ValueError("sample() needs a batch_size (argument or constructor).")
        with self._lock:
            length = len(self)
            if length == 0:
                raise RuntimeError("Cannot sample from an empty ReplayBuffer.")
            index = torch.randint(0, length, (batch_size,))
            return self._storage[index].clone()

    def __getitem__(self, index) -> TensorDictBase:
        with self._lock:
            return self._storage[: len(self)][index].clone()

    def latest(self, count: int) -> TensorDictBase:
        """The ``count`` most recently written frames, oldest first."""
        with self._lock:
            count = min(count, len(self))
            cursor = int(self._counters[_CURSOR])
            index = (torch.arange(cursor - count, cursor)) % self.capacity
            return self._storage[index].clone()

    def empty(self) -> None:
        with self._lock:
            self._counters[_CURSOR] = 0
            self._counters[_LENGTH] = 0

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A snapshot of the buffer (docs/checkpoints.md): its frames, write cursor and counters, as
        plain tensors (copies: later writes do not change it). Sampling draws from torch's global
        generator; this buffer has no sampler state of its own.

        Example:
            >>> from tensordict import TensorDict
            >>> rb = ReplayBuffer(capacity=8)
            >>> _ = rb.extend(TensorDict({"x": torch.arange(3)}, batch_size=[3]))
            >>> copy = ReplayBuffer(capacity=8)
            >>> copy.load_state_dict(rb.state_dict())
            >>> copy[:]["x"].tolist(), copy.write_count
            ([0, 1, 2], 3)
        """
        with self._lock:
            length = len(self)
            frames = None if self._storage is None else self._storage[:length].clone().to_dict()
            return {"capacity": self.capacity, "counters": self._counters.clone(), "frames": frames}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned, in place (a process-safe buffer's shared storage
        stays the one its workers write into).

        Raises:
            ValueError: for the state of a buffer of another capacity.
        """
        if int(state_dict["capacity"]) != self.capacity:
            raise ValueError(f"ReplayBuffer.load_state_dict: the state is of a buffer of capacity "
                             f"{state_dict['capacity']}, this one has capacity {self.capacity}")
        frames = state_dict["frames"]
        with self._lock:
            if frames is not None:
                rows = TensorDict.from_dict(frames, batch_size=[int(state_dict["counters"][_LENGTH])])
                if rows.shape[0]:
                    self.init_storage(rows)
                    self._storage[: rows.shape[0]].update_(rows.select(*self._storage.keys(True, True)))
            self._counters.copy_(state_dict["counters"])

    def __repr__(self) -> str:
        return f"ReplayBuffer(capacity={self.capacity}, len={len(self)}, write_count={self.write_count})"

    def __getstate__(self):
        state = self.__dict__.copy()
        if not self._process_safe:
            state["_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self._lock is None:
            self._lock = threading.RLock()
