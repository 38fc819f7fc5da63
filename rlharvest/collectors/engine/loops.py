"""What every way of gathering batches does with a worker's batch once its reply is in: take it off the
transport, map its trajectory ids, count its frames, and deliver it (post-processed, or into the replay
buffer). The ways themselves (one rollout of every worker, the first ready, pushed, flat chunks) are
:class:`BatchLoop` subclasses in ``gather.py`` and ``served.py``, chosen by the collector's options
(docs/collection.md).

Every loop meets failed workers the same way: the fleet replaces them as the restart policy allows
(docs/restarts.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
from tensordict import TensorDictBase

from ..._utils import MASK, TRAJ_IDS
from ...errors import WorkerError
from ...protocol import Command, Reply
from .fleet import Fleet
from .output import BatchOutput
from .progress import ProgressMeter
from .state import BatchSizes, Tally
from .traj_ids import TrajectoryIds
from .worker_figures import WorkerFigures

__all__ = ["BatchLoop", "LoopParts", "Pacing", "valid_part", "assemble_sync", "request_batch"]


def valid_part(batch: TensorDictBase) -> TensorDictBase:
    """The steps of a batch that were collected: the batch itself, or (when a rollout was cut short,
    its remaining steps having trajectory id -1) those steps, flattened."""
    ids = batch.get(TRAJ_IDS, None)
    if ids is None or not (ids == -1).any():
        return batch
    return batch[ids != -1]


def _valid_steps(batch: TensorDictBase) -> TensorDictBase:
    """Drop the trailing time steps a preempted worker did not collect."""
    valid = (batch.get(TRAJ_IDS) != -1).reshape(-1, batch.shape[-1]).any(0)
    return batch[..., : int(valid.sum())]


def assemble_sync(batches: list[TensorDictBase], cat_results: str | int = "stack",
                  preemptive: bool = False) -> TensorDictBase:
    """One sync batch from every worker's: stacked (``(W, *B, T)``, last dim ``"time"``; with a
    preemptive threshold, ``("collector", "mask")`` marks the collected steps), or concatenated along
    ``cat_results`` (the steps preempted workers did not collect dropped)."""
    if cat_results == "stack":
        out = torch.stack(batches, 0)
        if preemptive:
            out.set(MASK, out.get(TRAJ_IDS) != -1)
        out.names = [None] * (out.batch_dims - 1) + ["time"]
        return out
    if preemptive:
        batches = [_valid_steps(b) for b in batches]
    out = torch.cat(batches, cat_results)
    if cat_results in (-1, out.batch_dims - 1):
        out.names = [None] * (out.batch_dims - 1) + ["time"]
    return out


def request_batch(fleet: Fleet, worker: int, random: bool) -> int | None:
    """Ask ``worker`` for one rollout (random actions when ``random``), replacing it first when it is
    found failed (restarts on); interrupts issued from now on stop that rollout. Returns the
    request id, or None when the worker left (preempted, not replaced: docs/elastic.md)."""
    while True:
        if worker in fleet.requests.retired:
            return None
        try:
            mark = fleet.requests.handles[worker].interrupt_mark()
            return fleet.requests.send(worker, Command.COLLECT, (bool(random), mark))
        except WorkerError as err:
            fleet.recover(err)


class Pacing(Protocol):
    """When a loop lets weights be pushed without being asked (``WeightUpdates``, docs/weights.md)."""

    def before_batch(self, workers: list[int]) -> None:
        """Sync: before every worker is asked for its rollout."""

    def before_relaunch(self, worker: int, started: bool) -> None:
        """Async: before ``worker`` is asked again (``started``: a batch was collected already)."""

    def after_yield(self, served: list[int], active: list[int], done: bool) -> None:
        """A batch of ``served`` was yielded (``done``: ``total_frames`` reached)."""

    def before_pushed_batch(self) -> None:
        """Workers running free: before each batch (the weights go out every k batches)."""

    def pushed_batch_yielded(self) -> None:
        """Workers running free: a batch was yielded."""


@dataclass(frozen=True)
class LoopParts:
    """The collaborators of a loop, made once by the engine."""

    fleet: Fleet
    """The workers (requests, replacements)."""
    tally: Tally
    """Frames and batches so far, against ``total_frames``."""
    progress: ProgressMeter
    """Where transport, env, policy and waiting seconds are recorded."""
    figures: WorkerFigures
    """Each worker's figures, from the replies taken."""
    ids: TrajectoryIds
    """How the workers' trajectory ids become collector-wide ones."""
    output: BatchOutput
    """Post-processing, the replay buffer, complete trajectories."""
    replay_buffer: Any
    """Where batches are written instead of yielded (None: they are yielded)."""
    sizes: BatchSizes
    """Frames a batch counts with a replay buffer."""
    pacing: Pacing
    """Weights pushed between batches."""
    between_batches: Callable[[], None]
    """Called after each yield: workers may join meanwhile (``launcher="external"``)."""
    hooks: dict
    """The pre/post-collect hooks, for loops that run them here (where batches are assembled)."""
    policy_error: Callable[[], BaseException | None]
    """The policy's own error when it raised where it is served (a policy server), else None."""
    workers_write_buffer: bool = False
    """Whether workers may write an rlharvest replay buffer themselves (given its storage)."""


class BatchLoop:
    """The collector's batches: one subclass per way of gathering them, and what every way shares.

    Subclasses write :meth:`_loop` (the batches, counted and delivered through :meth:`emit`) and, where
    requests stay in flight between batches, :meth:`drain`, :meth:`drop` and :meth:`forget`.

    Args:
        parts: the loop's collaborators.
    """

    def __init__(self, parts: LoopParts) -> None:
        self.parts = parts
        self.fleet = parts.fleet
        self.tally = parts.tally
        #: with restarts and ``trajs_per_batch``: the episodes each worker had running at its last batch
        self.running_trajs: dict[int, list[int]] = {}
        #: async, after a load: ``(worker, frames, batch)`` collected before the checkpoint, yielded first
        self.restored: list[tuple[int, int, TensorDictBase]] = []
        #: async: ``{(worker, request id): batch}`` a checkpoint fetched before the iterator took it
        self.fetched_early: dict[tuple[int, int], TensorDictBase] = {}
        #: whether the workers were told to run free for iteration (``Pushed``)
        self.pushing = False
        #: whether the workers were given the replay buffer's storage to write into
        self.buffer_attached = False
        #: while a batch is being collected (not suspended at a yield): workers cannot join or leave then
        self.collecting = False
        #: between a batch's yield and the iteration resuming (when workers may join or leave)
        self.suspended = False

    # ------------------------------------------------------------------ the loop
    def batches(self) -> Iterator[TensorDictBase | None]:
        """The batches, with :attr:`collecting` and :attr:`suspended` telling where the loop is."""
        loop = self._loop()
        self.collecting = True
        try:
            for batch in loop:
                self.collecting, self.suspended = False, True
                yield batch
                self.collecting, self.suspended = True, False
        finally:
            self.collecting = self.suspended = False
            loop.close()

    def _loop(self) -> Iterator[TensorDictBase | None]:  # pragma: no cover - every way writes its own
        raise NotImplementedError

    def stop_pushing(self) -> None:
        """Stop workers that run free for iteration (only ``Pushed`` tells them to)."""

    def drain(self) -> None:
        """Wait until in-flight rollouts have answered, so workers are idle (their batches are kept)."""

    def drop(self) -> None:
        """Wait for the in-flight rollouts and drop their batches: they predate a change that must hold
        from the next batch on (``set_seed``). Iteration re-launches the workers."""
        self.fetched_early.clear()

    def forget(self, worker: int) -> None:
        """Drop what ``worker`` had in flight (it is replaced or leaves): its early fetches, its
        episodes held back for complete-trajectory batches (they will never end)."""
        self.fetched_early = {key: batch for key, batch in self.fetched_early.items() if key[0] != worker}
        running = self.running_trajs.pop(worker, None)
        output, requests = self.parts.output, self.fleet.current_requests
        if requests is not None and worker < len(requests.handles):  # what it wrote is in the buffer
            output.count_advertised([(worker, requests.handles[worker])])
        output.forget_worker(worker)
        trajectories = self.parts.output.trajectories
        if running and trajectories is not None:
            trajectories.drop_in_flight(running)

    def in_flight(self) -> dict[int, int]:
        """``{worker: request id}`` of the rollouts asked for and not taken yet (a checkpoint keeps them)."""
        return {}

    def state(self) -> dict:
        """What a checkpoint keeps of frames assembled here and not delivered yet (none by default)."""
        return {}

    def restore(self, section: dict) -> None:
        """Continue from a checkpoint's :meth:`state`."""

    # ------------------------------------------------------------------ what every loop does with a batch
    def after_yield(self, worker: int | None) -> None:
        """Between two batches: workers that joined are taken in, and weights pushed where due."""
        self.parts.between_batches()
        active = self.fleet.active
        self.parts.pacing.after_yield(active if worker is None else [worker], active, self.tally.reached_total())

    def take(self, worker: int, reply: Reply) -> TensorDictBase | None:
        """The worker's batch as a private copy with collector-wide ids, or None if it went to the buffer."""
        self.parts.figures.taken(worker, reply)
        if reply.written:  # its value says what the worker wrote
            self.record_times(reply)
            self.parts.output.count_worker(worker, reply.value)
            return None
        batch = self.parts.ids.remap(self.fetch(worker, reply), worker)
        if self.parts.output.trajectories is not None:
            ids = batch.get(TRAJ_IDS, None)  # the episodes running at its end, dropped if the worker fails or leaves
            self.running_trajs[worker] = ids[..., -1].flatten().tolist() if ids is not None else []
        return batch

    def fetch(self, worker: int, reply: Reply) -> TensorDictBase:
        """The batch ``reply`` announces (the time it takes counts as transport)."""
        start = time.perf_counter()
        batch = self.fetched_early.pop((worker, reply.request_id), None)  # by a checkpoint
        if batch is None:
            batch = self.fleet.requests.handles[worker].fetch_batch(reply)
        self.parts.progress.add_seconds("transport", time.perf_counter() - start)
        self.record_times(reply)
        return batch

    def record_times(self, reply: Reply) -> None:
        if reply.times is not None:
            env, policy = reply.times
            self.parts.progress.add_seconds("env", env)
            self.parts.progress.add_seconds("policy", policy)

    def count_frames(self, replies: list[Reply]) -> int:
        """Frames ``replies`` add: with a replay buffer, what each worker was asked for (its batch may have
        gone to the buffer); else what each collected."""
        if self.parts.replay_buffer is not None:
            sizes = self.parts.sizes
            if sizes.sync:  # every batch holds one rollout of every worker: its size
                return sizes.frames_per_batch()
            return sum(sizes.share(reply.worker_idx) for reply in replies)
        return sum(reply.frames for reply in replies)

    def emit(self, batches: list[TensorDictBase], replies: list[Reply], *, counted: bool = False,
             assemble: Callable[[list[TensorDictBase]], TensorDictBase] | None = None
             ) -> Iterator[TensorDictBase | None]:
        """Count frames, write or post-process, and yield one batch (or None with a buffer); ``assemble``
        makes one batch of several workers' (sync)."""
        if not counted:
            self.tally.frames += self.count_frames(replies)
        output = self.parts.output
        if self.parts.replay_buffer is not None:
            # Each worker's batch is written as that worker's own collector would write it, so a
            # buffer that counts items along the first dim (TorchRL's) gets the frames, not W rows.
            for batch in batches:
                self.write(batch)
            yield None
            return
        if assemble is not None and batches:
            stacking = time.perf_counter()
            batch = assemble(batches)
            self.parts.progress.add_seconds("transport", time.perf_counter() - stacking)
        else:
            batch = batches[0] if batches else None
        yield from output.deliver(batch)

    def write(self, batch: TensorDictBase) -> None:
        """One worker's batch into the replay buffer (its collected steps); the first time workers can
        write the buffer themselves, they are given its storage."""
        output = self.parts.output
        batch = valid_part(batch)
        buffer = self.parts.replay_buffer
        writers = self.parts.workers_write_buffer
        if writers and output.rules.assembles_trajectories:
            # The worker that sent this batch keeps its trajectories and writes them once the storage
            # is attached: here the batch only gives the storage its layout.
            if batch.numel():
                buffer.init_storage(output.postprocess(batch))
        else:
            output.write(buffer, batch)
        if writers and buffer.storage is not None and not self.buffer_attached:
            self._attach_storage()

    def _attach_storage(self) -> None:
        """Give the workers the replay buffer's storage to write into (each answers with its totals)."""
        self.buffer_attached = True
        self.drain()
        requests = self.fleet.requests
        storage = self.parts.replay_buffer.storage
        for worker, totals in zip(requests.active(), requests.broadcast(Command.ATTACH_BUFFER, storage)):
            self.parts.output.count_worker(worker, totals)

    def write_pushed(self, worker: int, reply: Reply) -> None:
        """A batch a worker pushed while running free (``start()``): into the replay buffer, its frames
        counted. While the workers run free for iteration instead, nobody takes it: it is dropped."""
        if self.pushing:
            self.fleet.requests.handles[worker].fetch_batch(reply)
            return
        self.write(self.parts.ids.remap(self.fetch(worker, reply), worker))
        self.tally.frames += reply.frames

    def prepare_workers_writing(self) -> None:
        """Before workers run free writing the buffer: its storage exists (allocated from a first batch, or
        loaded from a checkpoint) and the workers have it."""
        if self.parts.replay_buffer.storage is None:
            reply = self.fleet.requests.wait_for(0, request_batch(self.fleet, 0, self.tally.random_phase()))
            self.tally.frames += reply.frames  # collected and written: stepped, as the workers' next frames
            self.write(self.take(0, reply))
        elif not self.buffer_attached:
            self._attach_storage()
