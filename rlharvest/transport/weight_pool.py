"""Generation buffers: weight updates with one copy, applied atomically by a pointer swap.

The sender keeps a small pool of flat weight buffers ("generations") in memory that its receivers can
map. An update is copied once, into a generation *no receiver currently uses*; receivers then swap
their model's tensors for views of that generation (no copy) between two env steps and acknowledge.
A generation in use is never written, so a receiver never sees a half-applied update, and the
trainer's own tensors are never shared. The pool holds at most (distinct generations in use) + 1
buffers; with whole-fleet updates that is two, alternating.

Two allocators: torch shared memory (worker processes, handles passed through pipes) and named POSIX
shared memory (nodes on the same host, reached over TCP: they attach by name).
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Callable, Hashable, Iterable

import torch
from tensordict import TensorDictBase

from .._utils import cpu_count
from ..data.flat import FlatLayout, check_same_leaves, flat_leaves, freeze

__all__ = ["Generation", "GenerationBook", "GenerationPool", "TorchShmAllocator", "NamedShmAllocator", "attach_named", "copy_into",
           "create_named", "map_named", "unlink_named"]


@dataclass
class Generation:
    gen_id: int
    flat: torch.Tensor
    view: TensorDictBase
    leaves: list[torch.Tensor]
    handle: Any  # what a receiver needs to map this buffer


class TorchShmAllocator:
    """Flat buffers in torch shared memory; the handle is the (picklable-through-pipes) view itself."""

    def allocate(self, layout: FlatLayout):
        flat, view = layout.allocate(shared=True)
        freeze(view)
        return flat, view, view

    def release(self, generation: Generation) -> None:
        return None


class NamedShmAllocator:
    """Flat buffers in named POSIX shared memory; the handle is ``(name, layout)``."""

    def __init__(self) -> None:
        self._segments: dict[int, shared_memory.SharedMemory] = {}

    def allocate(self, layout: FlatLayout):
        segment = shared_memory.SharedMemory(create=True, size=layout.total_bytes)
        flat = torch.frombuffer(segment.buf, dtype=torch.uint8, count=layout.total_bytes)
        view = freeze(layout.view(flat))
        self._segments[id(flat)] = segment
        return flat, view, (segment.name, layout)

    def release(self, generation: Generation) -> None:
        segment = self._segments.pop(id(generation.flat), None)
        if segment is not None:
            generation.flat = generation.view = None
            generation.leaves = []
            try:
                segment.close()
                segment.unlink()
            except (FileNotFoundError, BufferError):
                pass


class _Mapping:
    """A mapping of a named segment; closing it never unlinks (the creator owns it)."""

    def __init__(self, name: str, size: int, writable: bool = True) -> None:
        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR if writable else os.O_RDONLY)
        try:
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self.map = mmap.mmap(fd, size, prot=prot)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.map.close()


def map_named(name: str, size: int, writable: bool = True) -> tuple[_Mapping, mmap.mmap]:
    """Map ``size`` bytes of the named segment ``name`` (created by another process); returns the
    mapping (close it when done) and the mapped buffer."""
    mapping = _Mapping(name, size, writable)
    return mapping, mapping.map


def attach_named(handle) -> tuple[Any, TensorDictBase]:
    """Map a named segment created by :class:`NamedShmAllocator` (receiver side).

    Mapped directly rather than through ``multiprocessing.shared_memory``, which would register the
    segment with this process's resource tracker (shared with the creator when forked) and unlink or
    double-unregister it behind the creator's back.
    """
    name, layout = handle
    mapping = _Mapping(name, layout.total_bytes)
    flat = torch.frombuffer(mapping.map, dtype=torch.uint8, count=layout.total_bytes)
    return mapping, freeze(layout.view(flat))


def create_named(name: str, layout: FlatLayout) -> tuple[_Mapping, torch.Tensor, TensorDictBase, tuple]:
    """A new segment ``/dev/shm/<name>`` of ``layout``'s size that other processes of this host attach
    by name (``attach_named`` of the returned handle); returns the mapping, the flat tensor, its view
    and the handle ``(name, layout)``.

    Created without ``multiprocessing``'s resource tracker: the segment must outlive its creator
    when the creator dies, for the processes that still have to map it (docs/weights.md, "One copy per
    host"); whoever owns it afterwards removes it with :func:`unlink_named`.
    """
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(1, layout.total_bytes))
    finally:
        os.close(fd)
    mapping = _Mapping(name, max(1, layout.total_bytes))
    flat = torch.frombuffer(mapping.map, dtype=torch.uint8, count=layout.total_bytes)
    return mapping, flat, freeze(layout.view(flat)), (name, layout)


def unlink_named(name: str) -> None:
    """Remove the name of a segment made by :func:`create_named` (mappings of it stay valid)."""
    try:
        os.unlink(f"/dev/shm/{name.lstrip('/')}")
    except FileNotFoundError:
        pass


def copy_into(generation: Generation, keys: list, weights: TensorDictBase) -> None:
    """One fused copy of ``weights`` into a generation.

    Raises:
        WeightNamesError, WeightShapeError: when the weights' names or shapes differ from the generation's.
    """
    given, sources = flat_leaves(weights)
    check_same_leaves(keys, generation.leaves, given, sources, "the shared weights")
    if not sources:  # a parameter-free model (e.g. a random policy): nothing to move
        return
    with torch.no_grad():
        parallel_copy(generation.leaves, sources)


#: below this many bytes one thread copies: a helper thread's wake-up would cost more than it saves
PARALLEL_COPY_BYTES = 16 * 1024**2
_copy_threads: ThreadPoolExecutor | None = None
_copy_threads_lock = threading.Lock()


def _copy_lanes() -> int:
    """Threads a big copy is split over: one per core this process may run on, at most 4."""
    return max(1, min(4, cpu_count()))


def parallel_copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``destination.copy_(source)`` for each pair, a big copy split over the cores.

    An update of tens of MB is one pass at the speed one core can move memory (and walk the page
    tables of 4 KB shared-memory pages), whatever ``torch.get_num_threads()`` says: users set one
    intra-op thread to leave the cores to their workers, which are the very processes waiting for
    this update. Split in contiguous byte ranges over a few threads (torch releases the GIL while
    it copies), it takes about half the time on 2 cores (docs/weights.md).
    """
    if sum(d.numel() * d.element_size() for d in destinations) < PARALLEL_COPY_BYTES:
        torch._foreach_copy_(destinations, sources)  # the usual update: nothing more to check
        return
    lanes = _copy_lanes()
    splittable = all(d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype and d.shape == s.shape
                     and d.device.type == "cpu" and s.device.type == "cpu" for d, s in zip(destinations, sources))
    if lanes == 1 or not splittable:
        torch._foreach_copy_(destinations, sources)
        return
    chunks = _byte_ranges(destinations, sources, lanes)
    pool = _copy_pool(lanes - 1)
    pending = [pool.submit(_copy_chunk, chunk) for chunk in chunks[1:]]
    _copy_chunk(chunks[0])
    for future in pending:
        future.result()


def _byte_ranges(destinations, sources, lanes: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pairs cut into ``lanes`` lists of about the same number of bytes (flat slices of them)."""
    flat = [(d.reshape(-1), s.reshape(-1)) for d, s in zip(destinations, sources)]
    share = -(-sum(d.numel() * d.element_size() for d, _ in flat) // lanes)
    chunks: list[list] = [[]]
    room = share
    for d, s in flat:
        start, size = 0, d.element_size()
        while start < d.numel():
            take = min(d.numel() - start, max(1, room // size))
            chunks[-1].append((d[start:start + take], s[start:start + take]))
            start, room = start + take, room - take * size
            if room <= 0 and len(chunks) < lanes:
                chunks.append([])
                room = share
    return [chunk for chunk in chunks if chunk]


def _copy_chunk(pairs) -> None:
    with torch.no_grad():
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def _copy_pool(workers: int) -> ThreadPoolExecutor:
    global _copy_threads
    with _copy_threads_lock:
        if _copy_threads is None or _copy_threads._max_workers < workers:
            _copy_threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rlharvest-copy")
        return _copy_threads


class GenerationPool:
    """Generations of one weight layout; hands out a buffer no receiver uses."""

    def __init__(self, layout: FlatLayout, allocator) -> None:
        self.layout = layout
        self.keys = [entry[0] for entry in layout.entries]
        self.allocator = allocator
        self._generations: dict[int, Generation] = {}
        self._ids = itertools.count()

    def acquire(self, busy: set[int]) -> tuple[Generation, bool]:
        """A generation outside ``busy`` (in use by, or pending for, some receiver); new if needed."""
        for gen_id, generation in self._generations.items():
            if gen_id not in busy:
                return generation, False
        flat, view, handle = self.allocator.allocate(self.layout)
        gen_id = next(self._ids)
        leaves = [view.get(key) for key in self.keys]
        generation = Generation(gen_id, flat, view, leaves, handle)
        self._generations[gen_id] = generation
        return generation, True

    def get(self, gen_id: int) -> Generation:
        return self._generations[gen_id]

    def trim(self, keep: set[int]) -> None:
        """Free generations nobody uses beyond one spare."""
        spare = [g for g in self._generations if g not in keep]
        for gen_id in spare[1:]:
            self.allocator.release(self._generations.pop(gen_id))

    def close(self) -> None:
        for generation in self._generations.values():
            self.allocator.release(generation)
        self._generations.clear()


class GenerationBook:
    """What one sender knows of its receivers' generations: the one each runs on (acknowledged), the one
    it was handed and has not acknowledged yet, and those it has mapped (a mapping handle travels once
    per receiver and generation). Every sender of generations keeps one (shared memory, torchdist,
    Ray, RPC), so choosing a buffer no receiver may be reading is written once.

    Receivers are any hashable (worker indices); generation ids are those of :class:`GenerationPool`,
    or any other id of a buffer the sender tracks the same way (a host's slot, ``torchdist_hosts``).

    Args:
        allocator: makes the pool's allocator, when the first weights give the layout.
        device: the device the pool's buffers live on (the layout is read from the weights moved there).
    """

    def __init__(self, allocator: Callable[[], Any], device=None) -> None:
        self._allocator = allocator
        self.device = device
        self.pool: GenerationPool | None = None
        #: receiver -> generation it runs on (acknowledged, or handed as initial weights)
        self.current: dict[Hashable, Hashable] = {}
        #: receiver -> generation handed to it and not acknowledged yet
        self.pending: dict[Hashable, Hashable] = {}
        #: receiver -> generations it has mapped
        self.seen: dict[Hashable, set] = {}

    def busy(self, receivers: Iterable[Hashable] | None = None) -> set:
        """The generations ``receivers`` (default: all) run on or were handed: never to be written."""
        if receivers is None:
            return set(self.current.values()) | set(self.pending.values())
        receivers = list(receivers)
        return ({self.current[r] for r in receivers if r in self.current}
                | {self.pending[r] for r in receivers if r in self.pending})

    def stage(self, weights: TensorDictBase, keep: Iterable = ()) -> Generation:
        """Copy ``weights`` (once) into a generation outside :meth:`busy` and ``keep``; the pool is
        created for the layout of the first weights."""
        if self.pool is None:
            moved = weights.to(self.device) if self.device is not None else weights
            self.pool = GenerationPool(FlatLayout.of(moved), self._allocator())
        generation, _ = self.pool.acquire(self.busy() | set(keep))
        copy_into(generation, self.pool.keys, weights)
        return generation

    def hand(self, receiver: Hashable, gen_id: Hashable, handle: Any = None, initial: bool = False) -> Any:
        """Note that ``gen_id`` goes to ``receiver`` (it runs on it at once when ``initial``: initial
        weights are not acknowledged); returns ``handle`` the first time, then None (it is mapped)."""
        seen = self.seen.setdefault(receiver, set())
        first = gen_id not in seen
        seen.add(gen_id)
        if initial:
            self.current[receiver] = gen_id
            self.pending.pop(receiver, None)
        else:
            self.pending[receiver] = gen_id
        return handle if first else None

    def premap(self, receiver: Hashable, gen_ids: Iterable[Hashable]) -> None:
        """``receiver`` maps ``gen_ids`` by other means (before any is handed to it)."""
        self.seen.setdefault(receiver, set()).update(gen_ids)

    def acknowledged(self, receiver: Hashable, gen_id: Hashable | None = None) -> None:
        """``receiver`` runs on what it was handed (or on ``gen_id``, when it says which)."""
        handed = self.pending.pop(receiver, None)
        gen_id = handed if gen_id is None else gen_id
        if gen_id is not None:
            self.current[receiver] = gen_id

    def dropped(self, receiver: Hashable) -> None:
        """What was handed to ``receiver`` will not be acknowledged (it failed to apply it)."""
        self.pending.pop(receiver, None)

    def forget(self, receiver: Hashable) -> None:
        """``receiver`` was replaced or left: it maps nothing and reads nothing any more."""
        for state in (self.current, self.pending, self.seen):
            state.pop(receiver, None)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
