"""RemoteCollectorBase: what every collector with workers shares, whatever the transport.

Workers run the worker loop (``rlharvest.worker``); this class drives them through a
:class:`~rlharvest.collectors._pool.WorkerPool`:

* **sync** iteration: every batch holds one rollout of every worker, ordered by worker index;
* **async** iteration: first ready, re-launched before the batch is yielded;
* weights through sender schemes, running free, bounded shutdown;
* seeds chained across workers, state dicts per worker, profiling and ``cascade_execute`` forwarded
  to workers (``_worker_calls.py``);
* failed workers replaced as the restart policy allows (``_restarts.py``).

Subclasses (``multi.py``, ``distributed/``) pick a backend, build one spec per worker and start them
through a :class:`~rlharvest.collectors._fleet.Fleet`; they say how a worker's trajectory ids map to
batch ids and how batches are assembled.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing  # noqa: F401  (imported before our exit hook so that hook runs first)
import time
import weakref
from typing import Any, Iterator

import torch
from tensordict import TensorDictBase

from ..errors import WorkerError
from ..protocol import Command
from ..transport.base import Backend, WeightLinks
from ._fleet import Fleet
from ._pool import WorkerPool
from ._restarts import WorkerReplacementMixin
from ._worker_calls import WorkerCallsMixin
from .base import BaseCollector

__all__ = ["RemoteCollectorBase", "valid_part"]

_TRAJ_IDS = ("collector", "traj_ids")
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_collectors() -> None:
    """At interpreter exit, close what users forgot (before multiprocessing joins its children)."""
    for collector in list(_LIVE):
        with contextlib.suppress(Exception):
            collector.shutdown(timeout=5.0, raise_on_error=False)


def valid_part(batch: TensorDictBase) -> TensorDictBase:
    """The steps of a batch that were collected: the batch itself, or (when a rollout was cut short,
    its remaining steps having trajectory id -1) those steps, flattened."""
    ids = batch.get(_TRAJ_IDS, None)
    if ids is None or not (ids == -1).any():
        return batch
    return batch[ids != -1]


class RemoteCollectorBase(WorkerCallsMixin, WorkerReplacementMixin, BaseCollector):
    """Base class of collectors whose rollouts run in workers (processes, nodes, RPC peers).

    What is answered by asking every worker (seeds, state dicts, ``map_fn``, ...) lives in
    :class:`~._worker_calls.WorkerCallsMixin`; a failed worker met anywhere is replaced, or the
    failure raised, by :class:`~._restarts.WorkerReplacementMixin` (docs/restarts.md).
    """

    _backend: Backend | None = None
    _fleet: Fleet | None = None
    _sync: bool = True
    _supports_run_free = False
    _running_free = False
    #: async: re-launch a worker only after its batch was yielded (so automatic weight pushes that
    #: follow a yield reach it before it collects again)
    _relaunch_after_yield = False
    _shutdown_timeout = 10.0
    noun = "worker"

    def _register_live(self) -> None:
        _LIVE.add(self)

    @property
    def _pool(self) -> WorkerPool | None:
        return self._fleet.pool if self._fleet is not None else None

    @property
    def num_workers(self) -> int:
        return len(self._pool) if self._pool is not None else 0

    def weight_links(self) -> WeightLinks:
        return self._backend.weight_links()

    # ------------------------------------------------------------------ hooks for subclasses
    def _frames_of(self, reply) -> int:
        return reply.frames

    def _remap_traj_ids(self, batch: TensorDictBase, worker: int) -> TensorDictBase:
        """Map a worker's trajectory ids to collector-wide ids (identity with a shared counter)."""
        return batch

    def _before_sync_batch(self) -> None:
        """Called before each synchronous request (automatic weight pushes)."""

    def _before_relaunch(self, worker: int) -> None:
        """Called before an async worker is re-launched (automatic weight pushes)."""

    def _after_yield(self, worker: int | None) -> None:
        """Called once per yielded batch with the worker it came from (None in sync mode)."""

    def _random_phase(self) -> bool:
        target = self.config.init_random_frames
        if not target:
            return False
        buffer = self.config.replay_buffer
        if buffer is not None and hasattr(buffer, "write_count"):
            return buffer.write_count < target
        return self._frames < target

    def _assemble_sync(self, batches: list[TensorDictBase], replies: list) -> TensorDictBase:
        out = torch.stack(batches, 0)
        out.names = [None] * (out.batch_dims - 1) + ["time"]
        return out

    def _handle_worker_batch(self, worker: int, reply) -> TensorDictBase | None:
        """The worker's batch as a private copy with remapped ids, or None if it went to the buffer."""
        if reply.written:
            self._record_times(reply)
            return None
        batch = self._remap_traj_ids(self._fetch(worker, reply), worker)
        if self._trajectories is not None and self._fleet.restarts.enabled:
            ids = batch.get(_TRAJ_IDS, None)  # the episodes running at its end, dropped if the worker fails
            self._running_trajs[worker] = ids[..., -1].flatten().tolist() if ids is not None else []
        return batch

    def _fetch(self, worker: int, reply) -> TensorDictBase:
        """The batch ``reply`` announces (the time it takes counts as transport), for ``stats()``
        with the env and policy seconds the worker spent on it."""
        start = time.perf_counter()
        batch = self._pool.handles[worker].fetch_batch(reply)
        self._progress.add_seconds("transport", time.perf_counter() - start)
        self._record_times(reply)
        return batch

    def _record_times(self, reply) -> None:
        if reply.times is not None:
            env, policy = reply.times
            self._progress.add_seconds("env", env)
            self._progress.add_seconds("policy", policy)

    # ------------------------------------------------------------------ iteration
    def _iterate(self) -> Iterator[TensorDictBase | None]:
        if self._running_free:
            raise RuntimeError("The collector is running free (start()); iterate the replay buffer instead.")
        yield from (self._iterate_sync() if self._sync else self._iterate_async())

    def _iterate_sync(self) -> Iterator[TensorDictBase | None]:
        while not self._reached_total():
            self._updating_weights(self._before_sync_batch)
            self._iter += 1
            random = self._random_phase()
            replies = self._gather_sync(random)
            batches = []
            for worker in range(len(replies)):
                batch, replies[worker] = self._fetched(worker, replies[worker], random)
                batches.append(batch)
            yield from self._emit([b for b in batches if b is not None], replies, sync=True)
            self._after_yield(None)

    def _request_batch(self, worker: int, random: bool) -> int:
        """Send COLLECT to ``worker``; interrupts issued from now on stop that rollout."""
        mark = self._pool.handles[worker].interrupt_mark()
        return self._pool.send(worker, Command.COLLECT, (bool(random), mark))

    def _gather_sync(self, random: bool) -> list:
        pool = self._pool
        ids = {w: self._launch(w, random) for w in range(len(pool))}
        replies: dict[int, Any] = {}
        waiting = time.perf_counter()
        for worker in range(len(pool)):
            while worker not in replies:
                try:
                    replies[worker] = pool.wait_for(worker, ids[worker])
                except WorkerError as err:  # its batch is dropped and asked again of its replacement
                    failed = self._restart_after(err)
                    replies.pop(failed, None)
                    ids[failed] = self._launch(failed, random)
        self._progress.add_seconds("waiting", time.perf_counter() - waiting)
        return [replies[w] for w in range(len(pool))]

    def _fetched(self, worker: int, reply, random: bool) -> tuple[TensorDictBase | None, Any]:
        """The batch of ``reply`` and the reply; when the worker fails while sending it (nodes send
        batches after replying), its replacement collects the batch again."""
        while True:
            try:
                if reply is None:
                    reply = self._pool.wait_for(worker, self._launch(worker, random))
                return self._handle_worker_batch(worker, reply), reply
            except WorkerError as err:
                self._restart_after(err)
                reply = None

    def _launch(self, worker: int, random: bool) -> int:
        """:meth:`_request_batch`, replacing the worker first when it is found failed (restarts on)."""
        while True:
            try:
                return self._request_batch(worker, random)
            except WorkerError as err:
                self._restart_after(err)

    def _iterate_async(self) -> Iterator[TensorDictBase | None]:
        pool = self._pool
        running = self._async_requests
        while not self._reached_total():
            for worker in range(len(pool)):
                if worker not in running:
                    self._relaunch(worker)
            waiting = time.perf_counter()
            try:
                worker, reply = pool.wait_any(running)
            except WorkerError as err:  # its batch is dropped; the loop asks its replacement again
                self._restart_after(err)
                continue
            self._progress.add_seconds("waiting", time.perf_counter() - waiting)
            del running[worker]
            try:
                batch = self._handle_worker_batch(worker, reply)
            except WorkerError as err:  # it failed while sending the batch: asked again of its replacement
                self._restart_after(err)
                continue
            self._iter += 1
            copying = time.perf_counter()
            batch = batch.clone() if batch is not None else None  # private: the worker reuses its buffer
            self._progress.add_seconds("transport", time.perf_counter() - copying)
            self._frames += self._count_frames([reply])
            if not self._relaunch_after_yield and not self._reached_total():
                # re-launch before yielding: the worker collects while the caller trains
                self._relaunch(worker)
            yield from self._emit([batch] if batch is not None else [], [reply], sync=False, counted=True)
            self._after_yield(worker)

    def _relaunch(self, worker: int) -> None:
        """Async: weights for ``worker`` if due, then its next request (replacing it if found failed)."""
        self._updating_weights(lambda: self._before_relaunch(worker))
        self._async_requests[worker] = self._launch(worker, self._random_phase())

    def _drain_async(self) -> None:
        """Wait until in-flight async rollouts have answered, so workers are idle. Their batches are kept
        for the iterator (nothing is lost; the worker's buffer is reused only after they are taken);
        a worker that failed meanwhile is replaced (restarts on), its rollout asked again later."""
        for worker, request_id in list(self._async_requests.items()):
            try:
                self._pool.wait_arrived(worker, request_id)
            except WorkerError as err:
                self._restart_after(err)

    def _drop_async(self) -> None:
        """Wait for the in-flight async rollouts and drop their batches: they predate a change that must
        hold from the next batch on (``set_seed``), as TorchRL's workers drop the batch they were
        collecting when a command arrives. Iteration re-launches the workers."""
        self._drain_async()
        for worker, request_id in list(self._async_requests.items()):
            del self._async_requests[worker]
            try:
                self._pool.wait_for(worker, request_id)
            except WorkerError as err:
                self._restart_after(err)

    @property
    def _async_requests(self) -> dict[int, int]:
        if not hasattr(self, "_async_running"):
            self._async_running: dict[int, int] = {}
        return self._async_running

    def _count_frames(self, replies: list) -> int:
        if self.config.replay_buffer is not None:
            return self.requested_frames_per_batch if self._sync else sum(self._nominal_frames(r) for r in replies)
        return sum(self._frames_of(r) for r in replies)

    def _nominal_frames(self, reply) -> int:
        return self.requested_frames_per_batch

    def _emit(self, batches: list, replies: list, *, sync: bool, counted: bool = False):
        """Count frames, write or post-process, and yield one batch (or None with a buffer)."""
        if not counted:
            self._frames += self._count_frames(replies)
        if self.config.replay_buffer is not None:
            # Each worker's batch is written as that worker's own collector would write it, so a
            # buffer that counts items along the first dim (TorchRL's) gets the frames, not W rows.
            for batch in batches:
                self._write_to_buffer(valid_part(batch))
            yield None
            return
        if sync and batches:
            stacking = time.perf_counter()
            batch = self._assemble_sync(batches, replies)
            self._progress.add_seconds("transport", time.perf_counter() - stacking)
        else:
            batch = batches[0] if batches else None
        trajectories = self._trajectories
        if trajectories is None:
            yield self._postprocess(batch)
        else:  # zero or more batches of complete trajectories per batch collected
            yield from trajectories.batches(self._postprocess(batch))

    def _write_to_buffer(self, batch: TensorDictBase) -> None:
        if not batch.numel():
            return
        trajectories = self._trajectories
        if trajectories is None:
            self.config.replay_buffer.extend(self._postprocess(batch))
        else:  # complete trajectories only, as flat steps
            trajectories.write(self.config.replay_buffer, self._postprocess(batch))

    def _postprocess(self, batch: TensorDictBase) -> TensorDictBase:
        from .utils import split_trajectories

        if self.config.split_trajs and self.config.trajs_per_batch is None:  # trajectory batches are split already
            batch = split_trajectories(batch)
        if self.config.postproc is not None:
            batch = self.config.postproc(batch)
        return self._drop_private_keys(batch)

    # ------------------------------------------------------------------ running free
    def start(self) -> None:
        """Collect in the background into the replay buffer until :meth:`async_shutdown`.

        Workers write into an rlharvest :class:`~rlharvest.data.ReplayBuffer` themselves; any other
        buffer (a TorchRL ``ReplayBuffer``, ...) is written by a thread of this process.

        Raises:
            RuntimeError: without a replay buffer, or when already running.
        """
        if not self._supports_run_free:
            return super().start()
        if self.config.replay_buffer is None:
            raise RuntimeError("start() requires a replay_buffer to write the collected data into.")
        if not self._workers_can_write():
            self._start_thread()
            return
        self._iteration_started = True
        self._prepare_run_free()
        self._pool.broadcast(Command.RUN_FREE)
        self._running_free = True

    def _workers_can_write(self) -> bool:
        """Whether workers write the replay buffer themselves (else a thread here does)."""
        return False

    def _prepare_run_free(self) -> None:
        """Make sure workers can write to the buffer themselves."""

    def is_running(self) -> bool:
        return self._running_free or super().is_running()

    def _interrupt_background(self) -> None:
        if self._pool is not None:
            for handle in self._pool.handles:
                handle.interrupt()

    def _pause_impl(self):
        if not self._supports_run_free:
            raise NotImplementedError(f"Collector pause() is not implemented for {type(self).__name__}.")
        if self._run_thread is not None:
            yield from self._pause_thread()
            return
        if not self._running_free:
            raise RuntimeError("Collector cannot be paused.")
        pool = self._pool
        for handle in pool.handles:
            handle.interrupt()
        for worker, reply in enumerate(pool.broadcast(Command.PAUSE, timeout=30.0)):
            if reply != "paused":
                raise ValueError(f"{self.noun} {worker} answered {reply!r} to pause.")
        try:
            yield
        finally:
            pool.broadcast(Command.RESUME, timeout=30.0)

    # ------------------------------------------------------------------ shutdown
    def _check_shutdown_args(self, close_env: bool) -> None:
        if not close_env:
            raise RuntimeError(f"{type(self).__name__} always closes its workers' envs (close_env=False refused).")

    def _shutdown_impl(self, timeout: float | None, close_env: bool) -> None:
        self._close_workers(self._shutdown_timeout if timeout is None else timeout)

    def _add_workers(self, specs: list, options: list | None = None) -> None:
        """Start ``specs`` as workers after the others (:meth:`Fleet.grow`): on the current weights and
        policy version, with the hooks set since construction, seeded by continuing the chain of the
        last :meth:`set_seed` (docs/backends.md, "Adding workers").

        Raises:
            RuntimeError: after shutdown, or while running free.
        """
        if self._closed or self._fleet is None or self._pool is None:
            raise RuntimeError(f"{type(self).__name__} is shut down: it cannot add {self.noun}s.")
        if self.is_running():
            raise RuntimeError(f"{type(self).__name__} is running free (start()): add {self.noun}s before start().")
        from ._worker_args import wrap_callable

        hooks = {name.strip("_"): wrap_callable(getattr(self, name)) for name in ("_pre_collect_hook",
                 "_post_collect_hook") if getattr(self, name, None) is not None}
        specs = [spec.replacement(policy_version=self._policy_version,
                                  collector_kwargs={**spec.collector_kwargs, **hooks}) for spec in specs]
        first = len(self._fleet)
        self._fleet.grow(specs, options)  # the others' rollouts in flight go on meanwhile
        chain = getattr(self, "_seed_chain", None)
        if chain is None:
            return
        try:
            self._seed_workers([spec.worker_idx for spec in specs], *chain)
        except BaseException:  # a new worker failed at once: as if it had failed to start
            self._fleet.shrink(first)
            raise

    def _close_workers(self, timeout: float) -> None:
        """Ask every worker to close, then make sure each is gone, within one deadline."""
        if self._fleet is not None:
            self._fleet.stop(timeout)
        elif self._backend is not None:  # construction failed before the workers started
            self._backend.stop_all(time.monotonic())
        self._running_free = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_workers={self.num_workers}, frames={self._frames})"

