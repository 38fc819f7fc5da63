"""RemoteCollectorBase: what every collector with workers shares, whatever the transport.

A collector with workers is a composition of parts (docs/architecture.md):

* a :class:`~rlharvest.collectors._fleet.Fleet` starts, replaces, adds and stops the workers, and
  decides with its :class:`~._restarts.RestartPolicy` whether a failed one is replaced
  (:meth:`Fleet.recover`); its :class:`~rlharvest.collectors._requests.WorkerRequests` sends the
  commands and matches the replies;
* a :class:`~rlharvest.collectors.broadcast.WorkerBroadcast` asks every worker what the collector
  API answers per worker (seeds, state dicts, hooks, ``map_fn``, profiling);
* weights go out through the sender schemes (``weight_update/``);
* workers join and leave through :class:`~rlharvest.collectors._elastic.ElasticWorkers` (mixed in).

This class drives them: **sync** iteration (every batch holds one rollout of every worker, ordered
by worker index), **async** iteration (first ready, re-launched before the batch is yielded),
running free, bounded shutdown. The public classes (``multi.py``, ``distributed/``) pick a backend,
build one spec per worker, and say how a worker's trajectory ids map to batch ids and how batches
are assembled.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing  # noqa: F401  (imported before our exit hook so that hook runs first)
import time
import weakref
from typing import Any, Iterator, Sequence

import torch
from tensordict import TensorDictBase

from .._utils import TRAJ_IDS
from ..checkpoint import CHECKPOINT_KEY, pack, unpack
from ..errors import WorkerError
from ..profiling import ProfileConfig
from ..protocol import Command
from ..transport.base import Backend, WeightLinks
from . import _checkpoint
from ._elastic import ElasticWorkers
from ._fleet import Fleet, Replacement
from ._requests import WorkerRequests
from ._restarts import RestartCause, RestartPolicy
from .base import BaseCollector, _argument_sets
from ._progress import ProgressMeter
from .broadcast import WorkerBroadcast
from .gather import FirstReady, Pushed, SyncStack, request_batch

__all__ = ["RemoteCollectorBase", "valid_part"]

_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_collectors() -> None:
    """At interpreter exit, close what users forgot (before multiprocessing joins its children)."""
    for collector in list(_LIVE):
        with contextlib.suppress(Exception):
            collector.shutdown(timeout=5.0, raise_on_error=False)


def _weakly(method, default: Any = None):
    """``method`` (bound) called through a weak reference to its object: ``default`` once it is gone."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return bound(*args) if bound is not None else default

    return call


def valid_part(batch: TensorDictBase) -> TensorDictBase:
    """The steps of a batch that were collected: the batch itself, or (when a rollout was cut short,
    its remaining steps having trajectory id -1) those steps, flattened."""
    ids = batch.get(TRAJ_IDS, None)
    if ids is None or not (ids == -1).any():
        return batch
    return batch[ids != -1]


class RemoteCollectorBase(ElasticWorkers, BaseCollector):
    """Base class of collectors whose rollouts run in workers (processes, nodes, RPC peers, actors).

    Subclass constructors call ``super().__init__()`` first (the state every such collector has),
    build their backend and worker specs, then :meth:`_start_fleet`.
    """

    _backend: Backend | None = None
    _fleet: Fleet | None = None
    _broadcast: WorkerBroadcast | None = None
    _sync: bool = True
    _supports_run_free = False
    _running_free = False
    #: async: re-launch a worker only after its batch was yielded (so automatic weight pushes that
    #: follow a yield reach it before it collects again)
    _relaunch_after_yield = False
    _shutdown_timeout = 10.0
    #: whether the pre/post-collect hooks run in the workers (False: where batches are assembled, here)
    _hooks_run_in_workers = True
    noun = "worker"

    def __init__(self) -> None:
        self._meter = ProgressMeter()
        #: how batches come back (``gather.py``), chosen once the workers are started
        self._gather: SyncStack | FirstReady | Pushed | None = None
        #: with restarts and ``trajs_per_batch``: the episodes each worker had running at its last batch
        self._running_trajs: dict[int, list[int]] = {}
        #: async, after a load: ``(worker, frames, batch)`` collected before the checkpoint, yielded first
        self._restored_batches: list[tuple[int, int, TensorDictBase]] = []
        #: async: ``{(worker, request id): batch}`` a checkpoint fetched before the iterator took it
        self._fetched_early: dict[tuple[int, int], TensorDictBase] = {}

    def _start_fleet(self, specs: Sequence, timeout: float, schemes: dict | None = None, **start: Any) -> None:
        """Start ``specs`` as this collector's workers: the fleet (with the restart policy of this
        collector's arguments and its replacement hooks), and the broadcast that talks to them.
        ``schemes``: the weight schemes feeding them (default: the sender schemes); ``start``: as
        :meth:`Fleet.start`."""
        # The parts call back into this collector weakly: a collector the user drops is collected (and
        # its workers stopped, ``__del__``) at once, not at the next cycle collection.
        hooks = Replacement(_weakly(self._before_replacement), _weakly(self._replacement_changes, {}),
                            _weakly(self._after_replacement), _weakly(self._after_leave))
        self._fleet = Fleet(self._backend, self._sender_schemes if schemes is None else schemes, timeout,
                            RestartPolicy.of(self.config, self.noun), hooks)
        self._gather = self._gather_strategy(self._fleet)
        self._broadcast = WorkerBroadcast(self._fleet, _weakly(self._drain_async), self.noun)
        self._register_live()
        self._fleet.start(specs, **start)

    def _gather_strategy(self, fleet: Fleet) -> SyncStack | FirstReady | Pushed:
        """How this collector's batches come back: one rollout of every worker (sync), or the first ready."""
        return SyncStack(fleet, self._meter) if self._sync else FirstReady(fleet, self._meter)

    def _register_live(self) -> None:
        _LIVE.add(self)

    @property
    def _requests(self) -> WorkerRequests | None:
        return self._fleet.requests if self._fleet is not None else None

    def worker_pids(self) -> list[int | None]:
        """The process id of each worker that is a process of this machine (a worker process, an
        ``"mp"`` node), None for the others (a SLURM job, a Ray actor, a thread). For monitoring,
        and for tests that inject faults (docs/restarts.md).

        Example:
            >>> collector.worker_pids()                              # doctest: +SKIP
            [41236, 41237]
        """
        requests = self._fleet.current_requests if self._fleet is not None else None
        return [handle.pid for handle in requests.handles] if requests is not None else []

    @property
    def restart_causes(self) -> tuple[RestartCause, ...]:
        """Why each worker was replaced, or left on a preemption (kind ``"preempted"``), so far, oldest
        first (docs/restarts.md, docs/elastic.md)."""
        if self._fleet is None:
            return ()
        restarts = self._fleet.restarts
        return tuple(sorted([*restarts.causes, *restarts.leaves], key=lambda cause: cause.time))

    @property
    def num_workers(self) -> int:
        """Worker slots: every index given so far, those of workers that left included."""
        return len(self._requests) if self._requests is not None else 0

    @property
    def active_workers(self) -> list[int]:
        """The indices of the workers collecting now (those that left are not there), in order."""
        return self._fleet.active if self._fleet is not None else []

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
        return self.config.in_random_phase(self._frames)

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
        if self._trajectories is not None:
            ids = batch.get(TRAJ_IDS, None)  # the episodes running at its end, dropped if the worker fails or leaves
            self._running_trajs[worker] = ids[..., -1].flatten().tolist() if ids is not None else []
        return batch

    def _fetch(self, worker: int, reply) -> TensorDictBase:
        """The batch ``reply`` announces (the time it takes counts as transport), for ``stats()``
        with the env and policy seconds the worker spent on it."""
        start = time.perf_counter()
        batch = self._fetched_early.pop((worker, reply.request_id), None)  # by a checkpoint
        if batch is None:
            batch = self._requests.handles[worker].fetch_batch(reply)
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
        batches = self._iterate_sync() if self._sync else self._iterate_async()
        self._collecting = True
        try:
            for batch in batches:
                self._collecting, self._suspended = False, True
                yield batch
                self._collecting, self._suspended = True, False
        finally:
            self._collecting = self._suspended = False
            batches.close()

    def _iterate_sync(self) -> Iterator[TensorDictBase | None]:
        while not self._reached_total():
            self._updating_weights(self._before_sync_batch)
            self._iter += 1
            random = self._random_phase()
            gathered = self._gather.gather(random)  # {worker: reply}, workers that left have none
            batches, replies = [], []
            for worker, reply in gathered.items():
                batch, reply = self._fetched(worker, reply, random)
                if reply is not None:  # None: it left (preempted) while sending, its rollout handed back
                    batches.append(batch)
                    replies.append(reply)
            yield from self._emit([b for b in batches if b is not None], replies, sync=True)
            self._after_yield(None)

    def _fetched(self, worker: int, reply, random: bool) -> tuple[TensorDictBase | None, Any]:
        """The batch of ``reply`` and the reply; when the worker fails while sending it (nodes send
        batches after replying), its replacement collects the batch again."""
        while True:
            try:
                if reply is None:
                    request_id = request_batch(self._fleet, worker, random)
                    if request_id is None:
                        return None, None
                    reply = self._requests.wait_for(worker, request_id)
                return self._handle_worker_batch(worker, reply), reply
            except WorkerError as err:
                self._fleet.recover(err)
                reply = None

    def _iterate_async(self) -> Iterator[TensorDictBase | None]:
        gather = self._gather
        while self._restored_batches and not self._reached_total():  # collected before the checkpoint
            worker, frames, batch = self._restored_batches.pop(0)
            self._iter += 1
            self._frames += frames
            yield from self._emit([batch], [None], sync=False, counted=True)
            self._after_yield(worker)
        while not self._reached_total():
            for worker in gather.idle():
                self._relaunch(worker)
            got = gather.next()
            if got is None:  # a worker failed: its batch is dropped, the loop asks its replacement again
                continue
            worker, reply = got
            try:
                batch = self._handle_worker_batch(worker, reply)
            except WorkerError as err:  # it failed while sending the batch: asked again of its replacement
                self._fleet.recover(err)
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
        self._gather.launch(worker, self._random_phase())

    def _drain_async(self) -> None:
        """Wait until in-flight rollouts have answered, so workers are idle (their batches are kept)."""
        if self._gather is not None:
            self._gather.drain()

    def _drop_async(self) -> None:
        """Wait for the in-flight rollouts and drop their batches: they predate a change that must hold
        from the next batch on (``set_seed``), as TorchRL's workers drop the batch they were collecting
        when a command arrives. Iteration re-launches the workers."""
        if self._gather is not None:
            self._gather.drop()
        self._fetched_early.clear()  # a checkpoint's early fetches of those batches

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

    # ------------------------------------------------------------------ failed workers (docs/restarts.md)
    def _before_replacement(self, worker: int) -> None:
        """Drop what ``worker`` had in flight before it is replaced: its request, and its episodes held
        back for complete-trajectory batches (they will never end)."""
        self._gather.forget(worker)
        self._fetched_early = {key: batch for key, batch in self._fetched_early.items() if key[0] != worker}
        running = self._running_trajs.pop(worker, None)
        if running and self._trajectories is not None:
            self._trajectories.drop_in_flight(running)

    def _replacement_changes(self, worker: int) -> dict:
        """What a worker replacing ``worker`` starts with besides its spec: the current policy version."""
        return {"policy_version": self._policy_version}

    def _after_replacement(self, worker: int) -> None:
        """Hook: bring the replacement of ``worker`` to where the others are."""

    def _after_leave(self, worker: int) -> None:
        """A worker left for good (preempted, not replaced): batches shrink as after remove_collectors."""
        self._resized()

    def _replace_worker(self, worker: int, **changes: Any) -> None:
        """Start a new worker in place of ``worker`` (gone or not): same index, seed and spec, the
        current weights and version, fresh trajectory ids (docs/backends.md, "Replacing a worker"),
        with ``changes`` to its spec on top."""
        self._fleet.renew(worker, **changes)

    def update_policy_weights_(self, *args, **kwargs) -> None:
        """As :meth:`BaseCollector.update_policy_weights_`; with restarts on, a worker found failed
        while the weights are delivered is replaced, and starts with them (docs/restarts.md)."""
        self._updating_weights(lambda: super(RemoteCollectorBase, self).update_policy_weights_(*args, **kwargs))

    def _updating_weights(self, update, counted: bool = True) -> None:
        """Run an automatic weight update; a worker it finds failed is replaced.

        Updates are delivered to every worker before acknowledgements are awaited, so the survivors
        have the new weights; the replacement starts with them (and, when the update ``counted`` a
        version, with the version it makes) too.
        """
        try:
            update()
        except WorkerError as err:
            if self._fleet is None or not self._fleet.restarts.enabled:
                raise
            step = 1 if counted else 0
            self._fleet.recover(err, policy_version=self._policy_version + step)
            if counted:
                BaseCollector.increment_version(self)

    # ------------------------------------------------------------------ asked of every worker (broadcast.py)
    def set_seed(self, seed: int, static_seed: bool = False) -> int:
        """Seed worker 0 with ``seed`` and worker k with what worker k-1 returned (workers that left
        are skipped); returns the last.

        Asynchronous collectors drop the batches in flight (collected before the seed): the next batch
        is the first of the seeded envs, as in TorchRL.
        """
        self._drop_async()
        seed = self._broadcast.seed(self.active_workers, seed, static_seed)
        if self._trajectories is not None:
            self._trajectories.drop_in_flight()  # the workers started fresh episodes: those never end
        return seed

    def state_dict(self, *, env_state: bool = True) -> dict:
        """A checkpoint of one consistent moment (docs/checkpoints.md): TorchRL's keys
        (``worker<i>``: each worker's own checkpoint, its env and episodes in flight included), and
        under ``"rlharvest_resume"`` the counters, the layout, the seeds, and (asynchronous
        collectors) the batches collected but not yielded yet. Rollouts in flight are waited for
        first; a ``start()`` thread is paused at its next batch boundary.

        Args:
            env_state: False leaves the envs' states and the episodes in flight out.

        Raises:
            NotImplementedError: while workers run free and write the replay buffer themselves.
        """
        if self._running_free:
            raise NotImplementedError(f"{type(self).__name__}.state_dict() while its {self.noun}s run free (start()) "
                                      "and write the replay buffer themselves: checkpoint before start() or after "
                                      "async_shutdown() (docs/checkpoints.md).")
        with self._at_batch_boundary():
            self._drain_async()
            pending = self._pending_batches()
            state = self._broadcast.state_dicts(env_state)
            state.update(frames=self._frames, iter=self._iter)
            counter = self._trajectory_counter()
            if counter is not None:
                state["traj_pool"] = {"traj_id": torch.tensor(counter.peek())}  # TorchRL's key for this counter
            if self._version_tracker:
                state["policy_version"] = self._policy_version
            state[CHECKPOINT_KEY] = _checkpoint.capture_remote(self, {"pending": pending, **self._checkpoint_extra()})
        return state

    def load_state_dict(self, state_dict: dict, **kwargs) -> None:
        """Continue from a checkpoint of :meth:`state_dict` taken by a collector built with the same
        arguments (docs/checkpoints.md); a TorchRL checkpoint restarts the episodes.

        Raises:
            CheckpointMismatchError: for a checkpoint of a newer format or of other arguments
                (number of workers, ``frames_per_batch``, a worker's env batch size).
        """
        section = _checkpoint.check_remote(self, state_dict)
        self._broadcast.load_state_dicts(state_dict)
        self._frames = state_dict["frames"]
        self._iter = state_dict["iter"]
        if "policy_version" in state_dict or section is not None:
            self._policy_version = int(state_dict["policy_version"] if section is None else section["policy_version"])
        counter = self._trajectory_counter()
        if counter is not None and "traj_pool" in state_dict:
            counter.advance_to(int(state_dict["traj_pool"]["traj_id"]))
        if section is None:
            if counter is not None and "traj_pool" in state_dict:
                self._broadcast.reset()  # episodes restart, with ids after the saved ones
            return
        _checkpoint.restore_remote(self, section)
        self._restored_batches = [(worker, frames, unpack(batch)) for worker, frames, batch in section["pending"]]
        self._restore_checkpoint_extra(section)

    def _pending_batches(self) -> list:
        """Async: the batches collected (drained) but not yielded yet, as ``[worker, frames, packed
        batch]``: the workers' envs are past them, so the checkpoint keeps them to be yielded first."""
        pending = [[worker, frames, pack(batch)] for worker, frames, batch in self._restored_batches]
        if self._sync or self._gather is None:
            return pending
        for worker, request_id in sorted(self._gather.in_flight.items()):
            reply = self._requests.peek(worker, request_id)
            if reply is None or reply.written:
                continue
            batch = self._fetched_early.get((worker, request_id))
            if batch is None:  # fetched once (some transports receive it only once), kept for the iterator
                batch = self._fetched_early[(worker, request_id)] = self._requests.handles[worker].fetch_batch(reply)
            pending.append([worker, self._frames_of(reply), pack(self._remap_traj_ids(batch.clone(), worker))])
        return pending

    def _checkpoint_extra(self) -> dict:
        """Hook: what a collector keeps for an exact resume besides its workers' states."""
        return {}

    def _restore_checkpoint_extra(self, section: dict) -> None:
        """Hook: put back what :meth:`_checkpoint_extra` captured."""

    def _trajectory_counter(self):
        """The trajectory-id counter the workers share, or None when each counts its own."""
        return None

    def reset(self, reset_idx: Sequence[bool] | None = None) -> None:
        """Reset every worker's envs, or those whose entry of ``reset_idx`` is True.

        With ``trajs_per_batch``, the trajectories held back (running, or complete but not yielded yet)
        are dropped, so later batches hold only steps collected after the reset.
        """
        if self._trajectories is not None:
            self._trajectories.flush()
        self._broadcast.reset([w for w in self.active_workers if reset_idx is None or reset_idx[w]])

    def get_distant_attr(self, attr: str) -> list[Any]:
        """The attribute at ``attr`` in every worker's collector, in worker order."""
        return self._broadcast.get_attr(attr)

    def map_fn(self, method_name: str, list_of_args: list[tuple] | None = None,
               list_of_kwargs: list[dict] | None = None) -> list[Any]:
        """Call ``method_name`` on worker ``i``'s collector with the ``i``-th arguments (one set per
        current worker, in index order: workers that left take none).

        Raises:
            ValueError: when the number of argument sets is not the number of workers.
        """
        return self._broadcast.call_each(method_name, _argument_sets(list_of_args, list_of_kwargs,
                                                                     len(self.active_workers)))

    def stats(self, workers: str = "aggregate") -> dict[str, int | float | bool]:
        """Progress as plain scalars: this collector's (``workers="aggregate"``, no worker is asked),
        each worker's as ``worker_<i>/<key>`` (``"per_worker"``), or both (``"both"``).

        Always there: ``workers``, ``workers_alive``, ``restarts`` (failed workers replaced, over the
        collector's life) and per worker ``worker_<i>/restarts`` and ``worker_<i>/restart_causes``
        (``"<kind>: <message>"`` of each, ``"; "``-separated). docs/restarts.md.

        Raises:
            ValueError: for another ``workers`` value.
        """
        if workers not in ("aggregate", "per_worker", "both"):
            raise ValueError(f"workers must be one of 'aggregate', 'per_worker' or 'both', got {workers!r}")
        stats: dict[str, int | float | bool] = super().stats() if workers != "per_worker" else {}
        requests = self._requests
        active = self.active_workers
        stats["workers"] = len(active)
        stats["workers_alive"] = sum(not requests.is_dead(w) for w in active) if requests else 0
        if self._fleet is not None:  # kept here, no worker is asked
            stats.update(self._fleet.restarts.stats(self.num_workers))
            stats["workers_removed"] = self.num_workers - len(active)
        if workers != "aggregate":
            for worker, worker_stats in zip(active, self._broadcast.worker_stats()):
                stats.update({f"worker_{worker}/{key}": value for key, value in worker_stats.items()})
        return stats

    def _set_hook(self, name: str, hook) -> None:
        """Hooks run where batches are collected: in the workers."""
        super()._set_hook(name, hook)
        if self._hooks_run_in_workers and self._broadcast is not None:
            self._broadcast.set_hook(name.strip("_"), hook)

    def getattr_policy(self, name: str) -> Any:
        return self._broadcast.getattr_policy(name)

    def getattr_env(self, name: str) -> Any:
        return self._broadcast.getattr_env(name)

    def getattr_rb(self, name: str) -> Any:
        return getattr(self.config.replay_buffer, name)

    def cascade_execute(self, attr_path: str, *args, **kwargs) -> Any:
        """Like :meth:`BaseCollector.cascade_execute`; ``workers[i].<path>`` runs inside worker i's
        collector, and ``workers.<path>`` inside every worker (a list of results)."""
        head, _, rest = attr_path.partition(".")
        if head == "workers" or head.startswith("workers["):
            if not rest:
                raise ValueError(f"{attr_path!r}: give the path to run inside the worker after 'workers[i].'")
            workers = self.active_workers if head == "workers" else [int(head[len("workers["):-1])]
            results = self._broadcast.call(rest, args, kwargs, workers)
            return results if head == "workers" else results[0]
        return super().cascade_execute(attr_path, *args, **kwargs)

    def increment_version(self) -> None:
        super().increment_version()
        if self._broadcast is not None:
            self._broadcast.increment_version()

    def _after_weights_sent(self, work: dict) -> None:
        # Workers bumped their own versions when they applied the update: only ours moves here.
        if "policy" in work:
            BaseCollector.increment_version(self)

    def forward_initial_weights(self, model_id: str, weights: TensorDictBase) -> None:
        """Initial weights received from a parent continue down to our own workers (no version bump)."""
        scheme = (self._weight_sync_schemes or {}).get(model_id)
        if scheme is not None and self._requests is not None:
            scheme.send(weights=weights)

    def _apply_profile_config(self, config: ProfileConfig) -> None:
        self._broadcast.enable_profile(config)

    def _stop_profiling(self) -> None:
        if self._broadcast is not None:
            self._broadcast.disable_profile()

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
        self._requests.broadcast(Command.RUN_FREE)
        self._running_free = True

    def _workers_can_write(self) -> bool:
        """Whether workers write the replay buffer themselves (else a thread here does)."""
        return False

    def _prepare_run_free(self) -> None:
        """Make sure workers can write to the buffer themselves."""

    def is_running(self) -> bool:
        return self._running_free or super().is_running()

    def _interrupt_background(self) -> None:
        requests = self._fleet.current_requests if self._fleet is not None else None
        if requests is not None:
            for worker in requests.active():
                requests.handles[worker].interrupt()

    def _pause_impl(self):
        if not self._supports_run_free:
            raise NotImplementedError(f"Collector pause() is not implemented for {type(self).__name__}.")
        if self._run_thread is not None:
            yield from self._pause_thread()
            return
        if not self._running_free:
            raise RuntimeError("Collector cannot be paused.")
        pool = self._requests
        for worker in pool.active():
            pool.handles[worker].interrupt()
        for worker, reply in zip(pool.active(), pool.broadcast(Command.PAUSE, timeout=30.0)):
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

    def _close_workers(self, timeout: float) -> None:
        """Ask every worker to close, then make sure each is gone, within one deadline."""
        if self._fleet is not None:
            self._fleet.stop(timeout)
        elif self._backend is not None:  # construction failed before the workers started
            self._backend.stop_all(time.monotonic())
        self._running_free = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_workers={self.num_workers}, frames={self._frames})"

