"""How an engine turns its workers' rollouts into the caller's batches, one loop per way of gathering
(docs/collection.md):

* **stack** (sync): every batch holds one rollout of every worker, in worker order;
* **first ready** (async): each worker keeps one request in flight; whichever answers first is served
  and asked again (before the yield, or after it where weights pushed after a batch must reach it);
* **pushed**: the workers run free during iteration and push every batch (``DistributedSyncCollector``);
* **chunks**: flat frames of whichever env workers are ready (``AsyncBatchedCollector``, ``chunks.py``).

Every loop counts frames, writes the replay buffer or post-processes, and meets failed workers the same
way: the fleet replaces them as the restart policy allows (docs/restarts.md).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import torch
from tensordict import TensorDictBase

from ..._utils import MASK, TRAJ_IDS
from ...errors import WorkerError
from ...protocol import Command
from .gather import FirstReady, Pushed, SyncStack, request_batch
from .pushed import PushedBatchReceiver


__all__ = ["Iteration", "valid_part", "assemble_sync"]


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


class Iteration:
    """The engine's batches: the loop its traits choose, and what every loop shares."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.gather: SyncStack | FirstReady | Pushed | None = None
        #: with restarts and ``trajs_per_batch``: the episodes each worker had running at its last batch
        self.running_trajs: dict[int, list[int]] = {}
        #: async, after a load: ``(worker, frames, batch)`` collected before the checkpoint, yielded first
        self.restored: list[tuple[int, int, TensorDictBase]] = []
        #: async: ``{(worker, request id): batch}`` a checkpoint fetched before the iterator took it
        self.fetched_early: dict[tuple[int, int], TensorDictBase] = {}
        #: whether the workers were told to run free for iteration (``gather="pushed"``)
        self.pushing = False
        #: whether the workers were given the replay buffer's storage to write into
        self.buffer_attached = False

    def choose_gather(self, fleet: Any) -> None:
        engine = self.engine
        kind = engine.traits.gather
        if kind == "stack":
            self.gather = SyncStack(fleet, engine.progress, engine.options.preemptive_threshold)
        elif kind == "pushed":
            self.gather = Pushed(fleet, engine.progress, engine.options.worker_timeout, engine.traits.noun)
        else:  # "first_ready", "chunks"
            self.gather = FirstReady(fleet, engine.progress)

    # ------------------------------------------------------------------ the loops
    def batches(self) -> Iterator[TensorDictBase | None]:
        engine = self.engine
        kind = engine.traits.gather
        if kind == "chunks":
            yield from engine.server.batches(engine)
            return
        loop = {"stack": self._sync, "first_ready": self._async, "pushed": self._pushed}[kind]()
        membership = engine.membership
        membership.collecting = True
        try:
            for batch in loop:
                membership.collecting, membership.suspended = False, True
                yield batch
                membership.collecting, membership.suspended = True, False
        finally:
            membership.collecting = membership.suspended = False
            loop.close()

    def _sync(self) -> Iterator[TensorDictBase | None]:
        engine = self.engine
        while not engine.reached_total():
            engine.updating_weights(lambda: engine.schedule.before_batch(engine.active_workers))
            engine.iter += 1
            random = engine.random_phase()
            gathered = self.gather.gather(random)  # {worker: reply}, workers that left have none
            batches, replies = [], []
            for worker, reply in gathered.items():
                batch, reply = self._fetched(worker, reply, random)
                if reply is not None:  # None: it left (preempted) while sending, its rollout handed back
                    batches.append(batch)
                    replies.append(reply)
            yield from self.emit([b for b in batches if b is not None], replies, sync=True)
            self._after_yield(None)

    def _fetched(self, worker: int, reply, random: bool) -> tuple[TensorDictBase | None, Any]:
        """The batch of ``reply`` and the reply; when the worker fails while sending it (nodes send
        batches after replying), its replacement collects the batch again."""
        fleet = self.engine.fleet
        while True:
            try:
                if reply is None:
                    request_id = request_batch(fleet, worker, random)
                    if request_id is None:
                        return None, None
                    reply = fleet.requests.wait_for(worker, request_id)
                return self.take(worker, reply), reply
            except WorkerError as err:
                fleet.recover(err)
                reply = None

    def _async(self) -> Iterator[TensorDictBase | None]:
        engine, gather = self.engine, self.gather
        while self.restored and not engine.reached_total():  # collected before the checkpoint
            worker, frames, batch = self.restored.pop(0)
            engine.iter += 1
            engine.frames += frames
            yield from self.emit([batch], [None], sync=False, counted=True)
            self._after_yield(worker)
        while not engine.reached_total():
            for worker in gather.idle():
                self.relaunch(worker)
            got = gather.next()
            if got is None:  # a worker failed: its batch is dropped, the loop asks its replacement again
                continue
            worker, reply = got
            try:
                batch = self.take(worker, reply)
            except WorkerError as err:  # it failed while sending the batch: asked again of its replacement
                engine.fleet.recover(err)
                continue
            engine.iter += 1
            copying = time.perf_counter()
            batch = batch.clone() if batch is not None else None  # private: the worker reuses its buffer
            engine.progress.add_seconds("transport", time.perf_counter() - copying)
            engine.frames += self.count_frames([reply])
            if not engine.traits.relaunch_after_yield and not engine.reached_total():
                self.relaunch(worker)  # before yielding: the worker collects while the caller trains
            yield from self.emit([batch] if batch is not None else [], [reply], sync=False, counted=True)
            self._after_yield(worker)

    def _pushed(self) -> Iterator[TensorDictBase | None]:
        engine = self.engine
        if not self.pushing:
            engine.requests.broadcast(Command.RUN_FREE)
            self.pushing = True
        while not engine.reached_total():
            if engine.schedule.free_running_due():
                self._push_free_running()
            engine.iter += 1
            batches, frames = [], 0
            for node in engine.active_workers:
                reply, batch = self.gather.next_of(node, lambda w, r: engine.ids.remap(self.fetch(w, r), w))
                if reply is None:  # it left (preempted) and was not replaced
                    continue
                batches.append(valid_part(batch).clone() if reply.frames < batch.numel() else batch)
                frames += reply.frames
            engine.frames += frames
            engine.schedule.yielded += 1
            yield from self.emit(batches, [], sync=True, counted=True)

    def _push_free_running(self) -> None:
        """Workers running free pick the weights up between two env steps, without acknowledging; each
        counts one version as we do, so a replacement starts at the new one."""
        engine = self.engine
        scheme = (engine.weights.sender_schemes or {}).get("policy")
        if scheme is not None:
            engine.weights.increment()
            engine.updating_weights(scheme.send, counted=False)

    def stop_pushing(self) -> None:
        """Stop workers that run free for iteration, taking what they pushed meanwhile (dropped)."""
        if not self.pushing:
            return
        receiver = PushedBatchReceiver(self.engine)
        receiver.stop_requested.set()
        receiver.run()
        self.pushing = False

    # ------------------------------------------------------------------ what the loops share
    def relaunch(self, worker: int) -> None:
        """Async: weights for ``worker`` if due, then its next request (replacing it if found failed)."""
        engine = self.engine
        engine.updating_weights(lambda: engine.schedule.before_relaunch(worker, started=engine.iter >= 0))
        self.gather.launch(worker, engine.random_phase())

    def _after_yield(self, worker: int | None) -> None:
        engine = self.engine
        engine.admit_rejoined()
        served = engine.active_workers if worker is None else [worker]
        engine.schedule.after_yield(served, engine.active_workers, engine.reached_total())

    def take(self, worker: int, reply) -> TensorDictBase | None:
        """The worker's batch as a private copy with collector-wide ids, or None if it went to the buffer."""
        engine = self.engine
        engine.figures.taken(worker, reply)
        if reply.written:
            self.record_times(reply)
            return None
        batch = engine.ids.remap(self.fetch(worker, reply), worker)
        if engine.output.trajectories is not None:
            ids = batch.get(TRAJ_IDS, None)  # the episodes running at its end, dropped if the worker fails or leaves
            self.running_trajs[worker] = ids[..., -1].flatten().tolist() if ids is not None else []
        return batch

    def fetch(self, worker: int, reply) -> TensorDictBase:
        """The batch ``reply`` announces (the time it takes counts as transport)."""
        engine = self.engine
        start = time.perf_counter()
        batch = self.fetched_early.pop((worker, reply.request_id), None)  # by a checkpoint
        if batch is None:
            batch = engine.requests.handles[worker].fetch_batch(reply)
        engine.progress.add_seconds("transport", time.perf_counter() - start)
        self.record_times(reply)
        return batch

    def record_times(self, reply) -> None:
        if reply.times is not None:
            env, policy = reply.times
            self.engine.progress.add_seconds("env", env)
            self.engine.progress.add_seconds("policy", policy)

    def count_frames(self, replies: list) -> int:
        engine = self.engine
        if engine.config.replay_buffer is not None:
            if engine.traits.sync:
                return engine.requested_frames_per_batch
            return sum(engine.options.frames_share(reply.worker_idx) for reply in replies)
        return sum(reply.frames for reply in replies)

    def emit(self, batches: list, replies: list, *, sync: bool, counted: bool = False):
        """Count frames, write or post-process, and yield one batch (or None with a buffer)."""
        engine = self.engine
        if not counted:
            engine.frames += self.count_frames(replies)
        if engine.config.replay_buffer is not None:
            # Each worker's batch is written as that worker's own collector would write it, so a
            # buffer that counts items along the first dim (TorchRL's) gets the frames, not W rows.
            for batch in batches:
                self.write(batch)
            yield None
            return
        if sync and batches:
            stacking = time.perf_counter()
            options = engine.options
            batch = assemble_sync(batches, options.cat_results, options.preemptive_threshold is not None)
            engine.progress.add_seconds("transport", time.perf_counter() - stacking)
        else:
            batch = batches[0] if batches else None
        yield from engine.output.deliver(batch)

    def write(self, batch: TensorDictBase) -> None:
        """One worker's batch into the replay buffer (its collected steps); the first time workers can
        write the buffer themselves, they are given its storage."""
        engine = self.engine
        batch = valid_part(batch)
        buffer = engine.config.replay_buffer
        writers = engine.options.workers_write_buffer
        if writers and engine.config.trajs_per_batch is not None:
            # The worker that sent this batch keeps its trajectories and writes them once the storage
            # is attached: here the batch only gives the storage its layout.
            if batch.numel():
                buffer.init_storage(engine.output.postprocess(batch))
        else:
            engine.output.write(buffer, batch)
        if writers and buffer.storage is not None and not self.buffer_attached:
            self.buffer_attached = True
            self.drain()
            engine.requests.broadcast(Command.ATTACH_BUFFER, buffer.storage)

    def prepare_workers_writing(self) -> None:
        """Before workers run free writing the buffer: its storage exists (allocated from a first batch)."""
        engine = self.engine
        if engine.config.replay_buffer.storage is None:
            reply = engine.requests.wait_for(0, request_batch(engine.fleet, 0, engine.random_phase()))
            self.write(self.take(0, reply))

    def forget(self, worker: int) -> None:
        """Drop what ``worker`` had in flight (it is replaced or leaves): its request, its early
        fetches, its episodes held back for complete-trajectory batches (they will never end)."""
        if self.gather is not None:
            self.gather.forget(worker)
        self.fetched_early = {key: batch for key, batch in self.fetched_early.items() if key[0] != worker}
        running = self.running_trajs.pop(worker, None)
        trajectories = self.engine.output.trajectories
        if running and trajectories is not None:
            trajectories.drop_in_flight(running)

    def drain(self) -> None:
        """Wait until in-flight rollouts have answered, so workers are idle (their batches are kept)."""
        if self.gather is not None:
            self.gather.drain()

    def drop(self) -> None:
        """Wait for the in-flight rollouts and drop their batches: they predate a change that must hold
        from the next batch on (``set_seed``). Iteration re-launches the workers."""
        if self.gather is not None:
            self.gather.drop()
        self.fetched_early.clear()
