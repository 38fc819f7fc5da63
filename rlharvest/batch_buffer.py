"""Where the rollout loop's steps become a batch.

:class:`~rlharvest.rollout.Rollout` turns its steps into columns (``{key: [one value per step]}``)
and hands them here, a chunk at a time; :class:`BatchBuffer` stacks each column into its rows of a
TensorDict of shape ``(*batch_size, T)`` whose time dim is named ``"time"``. It knows the batch's
layout (each key's per-step shape and dtype), the buffer reused from batch to batch (or one living in
shared memory, :meth:`BatchBuffer.set_buffer`) and the two ways a batch is built without one: fresh
tensors (``use_buffers=False``, or values kept whole) and a lazy stack (dynamic specs).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from ._batching import STRUCTURED, stack_into, stack_structured
from ._utils import TRAJ_IDS, NestedKey, is_private_key
from .envs.base import to_tensor
from .envs.checks import raise_if_changed

__all__ = ["BatchBuffer", "Layout"]

#: ``{key: (per-step shape, dtype)}``, the dtype being ``STRUCTURED`` for values kept whole
Layout = dict[NestedKey, tuple[tuple, Any]]


class BatchBuffer:
    """Stacks a rollout's columns into batches of ``time_steps`` steps.

    Args:
        batch_size: the env's batch size (the time dim follows it).
        time_steps: steps per batch.
        device: where batches are stored (None: where the values are).
        reuse: write every batch into one buffer (TorchRL's ``use_buffers``) rather than new tensors.
        lazy: stack steps lazily (envs whose shapes change from step to step).
    """

    def __init__(self, batch_size: torch.Size, time_steps: int, device: torch.device | None, *, reuse: bool,
                 lazy: bool) -> None:
        self.batch_size = torch.Size(batch_size)
        self.time_dim = len(self.batch_size)
        self.time_steps = time_steps
        self.device = device
        self.reuse, self.lazy = reuse, lazy
        self.layout: Layout | None = None
        self.structured = False  # some values are kept whole: no buffer then
        self.public = False
        self.buffer: TensorDictBase | None = None
        self._targets: dict[NestedKey, torch.Tensor] | None = None  # the buffer's leaves, by key
        self._pointers: dict[NestedKey, int] = {}  # each leaf's data pointer when the views were made
        #: ``{(key, offset, steps): rows of the leaf}``: chunks start at the same offsets every batch, and
        #: a view costs more to make than a chunk's rows cost to write. Torch views, not numpy ones:
        #: sharing the buffer's memory later (``share_memory_()``) moves it under them, and only views
        #: of the same storage follow.
        self._rows: dict[tuple, torch.Tensor] = {}
        self._written_keys: Any = ()  # the keys of the last chunk written
        #: each batch in a buffer of its own: the batch is handed out as it is, where a reused buffer must be
        #: copied (:meth:`hand_out_batches`)
        self.fresh = False
        #: the buffers handed out last, kept to be written again once the caller has let go of them
        self._handed = BufferPool()

    def set_layout(self, layout: Layout) -> None:
        self.layout = layout
        self.structured = any(dtype is STRUCTURED for _, dtype in layout.values())
        #: the batches' keys are the layout's, none of them private (values kept whole may hold any key)
        self.public = not (self.structured or self.lazy or any(is_private_key(key) for key in layout))

    @property
    def writes_chunks(self) -> bool:
        """Whether steps can be written into the buffer as they come (else: stacked at the batch's end)."""
        return self.reuse and not self.lazy and not self.structured

    def allocate(self, layout: Layout | None = None, *, empty: bool = False) -> TensorDictBase:
        """A zero batch of ``layout`` (this buffer's by default); ``empty``: its values left unset."""
        steps, dim = self.time_steps, self.time_dim
        make = torch.empty if empty else torch.zeros
        leaves = {}
        for key, (shape, dtype) in (layout or self.layout).items():
            leaves[key] = make((*shape[:dim], steps, *shape[dim:]), dtype=dtype, device=self.device)
        return batch_of(leaves, (*self.batch_size, steps), (*([None] * dim), "time"), self.device)

    def resize(self, time_steps: int) -> None:
        """Batches of ``time_steps`` steps from the next one on, in a buffer allocated at that size."""
        self.time_steps, self.buffer, self._targets, self._rows = int(time_steps), None, None, {}
        self._handed = BufferPool()

    def hand_out_batches(self) -> None:
        """Write each batch into a new buffer, which the caller may keep: no copy of the batch is needed
        (on a batch of 1024 rows x 64 steps, ~5% of the collector's CPU time went to copying it and to the
        cache that copy cleared; docs/performance.md). Until :meth:`set_buffer`."""
        self.fresh = True

    def set_buffer(self, buffer: TensorDictBase) -> None:
        """Write future batches into ``buffer`` (same layout), e.g. one living in shared memory."""
        self.fresh, self._handed = False, BufferPool()
        if self.buffer is not None:
            expected = {k: (v.shape, v.dtype) for k, v in self.buffer.items(True, True)}
            given = {k: (v.shape, v.dtype) for k, v in buffer.items(True, True)}
            if expected != given:
                raise ValueError(f"set_buffer: layout mismatch.\nexpected {expected}\ngot {given}")
        self.buffer, self._targets, self._rows = buffer, None, {}

    def _buffer_targets(self, batch_start: bool) -> dict[NestedKey, torch.Tensor]:
        """The buffer's leaves by key; at a batch's start, checked against the buffer (a batch handed
        out as is, ``return_same_td``, may have had a leaf replaced: the next one goes into the new one)."""
        if self.buffer is None:
            self.buffer, self._targets, self._rows = self.allocate(), None, {}
        elif batch_start and self.fresh:  # the last batch is the caller's now
            self._handed.add(self.buffer, self._targets)
            self._rows = {}  # views of the last batch's leaves: the pool counts them as held
            recycled = self._handed.take((*self.batch_size, self.time_steps), (*([None] * self.time_dim), "time"))
            # a new one from the layout, not like the last batch: the caller may have reshaped or renamed it
            self.buffer, self._targets = recycled if recycled is not None else (self.allocate(empty=True), None)
        elif batch_start and self._targets is not None:
            pointers = self._pointers
            current = dict(self.buffer.items(True, True))  # one walk: a get() per key costs ~3x more
            if any(current.get(key) is not leaf or leaf.data_ptr() != pointers[key]
                   for key, leaf in self._targets.items()):
                self._targets, self._rows = None, {}
        if self._targets is None:
            self._targets = {key: self.buffer.get(key) for key, (_, dtype) in self.layout.items()
                             if dtype is not STRUCTURED}
        if batch_start and not self.fresh:  # a buffer handed out whole is never checked against them
            self._pointers = {key: leaf.data_ptr() for key, leaf in self._targets.items()}
        return self._targets

    def write(self, columns: dict[NestedKey, list], offset: int) -> None:
        """Write a chunk of steps into the buffer's rows from ``offset`` on (:attr:`writes_chunks`)."""
        self._written_keys = self._stack(columns, self._buffer_targets(offset == 0), offset).keys()

    def finish(self, columns: dict[NestedKey, list], written: int, count: int) -> TensorDictBase:
        """The batch: ``written`` steps are in the buffer already, the ``count`` of ``columns`` follow
        (an early stop leaves the rest: their trajectory ids are -1)."""
        if self.lazy:
            return self._lazily(columns, count)
        dim, n = self.time_dim, written + count
        if not self.writes_chunks:
            leaves = self._stack(columns, None, 0)
            for key, (shape, dtype) in self.layout.items():
                # Keys no step wrote: root done flags (False under auto-reset), and in a batch of random
                # actions the policy's other outputs (zero, as TorchRL fills them).
                if key not in leaves and dtype is not STRUCTURED:
                    leaves[key] = torch.zeros((*shape[:dim], n, *shape[dim:]), dtype=dtype)
            td = TensorDict(leaves, batch_size=(*self.batch_size, n), device=self.device)
            td.refine_names(*([None] * dim), "time")
            return td
        targets = self._buffer_targets(written == 0)
        wrote = self._stack(columns, targets, written).keys() if count else self._written_keys
        for key, target in targets.items():
            if key not in wrote:  # the keys no step writes, as above
                (target if self.fresh else target.narrow(dim, 0, n)).zero_()
            elif self.fresh and n < self.time_steps:  # a new buffer's rows no step reached
                target.narrow(dim, n, self.time_steps - n).zero_()
        if n < self.time_steps and TRAJ_IDS in targets:
            targets[TRAJ_IDS].narrow(dim, n, self.time_steps - n).fill_(-1)
        return self.buffer

    def _stack(self, columns: dict[NestedKey, list], targets: dict[NestedKey, torch.Tensor] | None,
               offset: int) -> dict[NestedKey, Any]:
        """Stack each column into its ``targets`` rows from ``offset`` (new tensors when ``targets`` is
        None); returns ``{key: stacked}``."""
        layout, dim = self.layout, self.time_dim
        stacked: dict[NestedKey, Any] = {}
        #: (first value, last value, steps) -> (values, stacked): two keys with the very same values (``done``
        #: is ``terminated`` in an env without truncation) are stacked once
        seen: dict[tuple, tuple[list, Any]] = {}
        for key, values in columns.items():
            shape, dtype = layout[key]
            if dtype is STRUCTURED:
                stacked[key] = stack_structured(values, dim)
                continue
            n = len(values)
            target = self._rows_of(targets, key, offset, n) if targets is not None else None
            twin = seen.get((id(values[0]), id(values[-1]), n))
            if twin is not None and all(a is b for a, b in zip(twin[0], values)) and twin[1].dtype == dtype:
                stacked[key] = twin[1].clone() if target is None else target.copy_(twin[1])
                continue
            try:
                stacked[key] = stack_into(values, target, dim, (*shape[:dim], n, *shape[dim:]), dtype)
            except (RuntimeError, TypeError, ValueError) as err:  # did a value's shape or dtype change?
                raise_if_changed(key, values, shape, dtype, err)
                raise
            if isinstance(values[0], torch.Tensor):
                seen[(id(values[0]), id(values[-1]), n)] = (values, stacked[key])
        return stacked

    def _rows_of(self, targets: dict[NestedKey, torch.Tensor], key: NestedKey, offset: int, n: int) -> torch.Tensor:
        if not offset and n == self.time_steps:  # the whole batch in one chunk: the leaf itself
            return targets[key]
        rows = self._rows.get((key, offset, n))
        if rows is None:
            rows = self._rows[(key, offset, n)] = targets[key].narrow(self.time_dim, offset, n)
        return rows

    def _lazily(self, columns: dict[NestedKey, list], count: int) -> TensorDictBase:
        """Envs whose shapes change from step to step (dynamic specs): one TensorDict per step,
        stacked lazily along time, as TorchRL does."""
        per_step = []
        for t in range(count):
            values = {key: column[t] for key, column in columns.items()}
            for key, (shape, dtype) in self.layout.items():
                if key not in values and dtype is not STRUCTURED:
                    values[key] = torch.zeros(shape, dtype=dtype)
            values = {k: v if isinstance(v, (torch.Tensor, TensorDictBase)) else to_tensor(v) for k, v in values.items()}
            step = TensorDict(values, batch_size=self.batch_size, device=self.device)
            if self.device is None:
                step.clear_device_()  # nested TensorDicts the env made keep its device: stacked, they must agree
            per_step.append(step)
        out = LazyStackedTensorDict.lazy_stack(per_step, self.time_dim)
        out.refine_names(*([None] * self.time_dim), "time")
        return out


def batch_of(leaves: dict[NestedKey, torch.Tensor], batch_size: tuple, names: tuple,
             device: torch.device | None = None) -> TensorDictBase:
    """A TensorDict of ``batch_size`` (dims named ``names``) around ``leaves``, whose shapes start with it.

    Built without the checks the public constructor makes on every leaf (the leaves are this module's
    own, of the right shapes): ~4 us instead of ~20 us for a batch of 7 keys measured alone, and
    several times more in a collector, where this code runs once per batch and cold.
    """
    new = getattr(TensorDict, "_new_unsafe", None)
    if new is None:  # another tensordict: the public way
        td = TensorDict(leaves, batch_size=batch_size, device=device)
        td.refine_names(*names)
        return td
    size = torch.Size(batch_size)
    tree: dict = {}
    for key, leaf in leaves.items():
        node = tree
        if isinstance(key, tuple):
            for part in key[:-1]:
                node = node.setdefault(part, {})
            key = key[-1]
        node[key] = leaf
    return _node(new, tree, size, names, device)


def _node(new, tree: dict, size: torch.Size, names: tuple, device) -> TensorDictBase:
    source = {key: _node(new, value, size, names, device) if isinstance(value, dict) else value
              for key, value in tree.items()}
    return new(source, batch_size=size, names=list(names), device=device)


class BufferPool:
    """The last batches handed out, written again once nothing outside the collector holds them.

    A batch of 1024 rows x 64 steps is ~2 MB: a new one each batch costs the kernel a page fault per
    4 KB on first write (~7 us of a ~120 us step; docs/performance.md, "One env with a batch"), where
    a batch the caller has dropped is warm memory. A buffer is taken back only if its TensorDict is
    gone, and no tensor, view, numpy array or other TensorDict refers to any of its leaves (their
    reference counts and their storages' use counts say so); a leaf moved to shared memory (sent to
    another process) is never taken back. Anything else: a new buffer, as without the pool.
    """

    #: buffers kept: the one the caller's loop variable still holds while the next batch is collected,
    #: and one it has let go of
    SIZE = 2

    def __init__(self) -> None:
        self._kept: list[tuple[weakref.ref, dict]] = []

    def add(self, buffer: TensorDictBase, leaves: dict[NestedKey, torch.Tensor] | None) -> None:
        """``buffer`` is the caller's now; keep ``leaves`` (its leaves by key, as the batch was written) to
        write them again once it lets them go."""
        if leaves is None or any(leaf.device.type != "cpu" for leaf in leaves.values()):
            return
        self._kept.append((weakref.ref(buffer), leaves))
        del self._kept[:-self.SIZE]

    def take(self, batch_size: tuple, names: tuple) -> tuple[TensorDictBase, dict[NestedKey, torch.Tensor]] | None:
        """A buffer nothing outside this pool refers to (a new TensorDict of ``batch_size`` and dim ``names``
        around its leaves: the caller may have renamed or reshaped the last one) and its leaves by key,
        or None."""
        for index in range(len(self._kept) - 1, -1, -1):  # the last handed out first: its memory is the warmest
            owner, leaves = self._kept[index]
            if owner() is None and _unreferenced(leaves):
                del self._kept[index]
                return batch_of(leaves, batch_size, names), leaves
        return None


#: a storage's uses when only its tensor holds it: the tensor and the storage object asked
_ALONE = 2


def _unreferenced(leaves: dict[NestedKey, torch.Tensor]) -> bool:
    """Whether only ``leaves`` refers to its tensors and their memory (counted here, where nothing else of
    this module holds one: ``leaves[key]`` is referred to by the dict and by getrefcount's argument)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)  # without it (another torch): never taken back
    if use_count is None or any(sys.getrefcount(leaves[key]) > 2 for key in leaves):
        return False
    for leaf in leaves.values():
        storage = leaf.untyped_storage()
        if storage.is_shared() or use_count(storage._cdata) > _ALONE:
            return False
    return True
