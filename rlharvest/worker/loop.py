"""THE worker loop: typed commands in, typed replies out, one handler per command.

Every backend runs it. A worker builds its collector (a :class:`~rlharvest.collectors.Collector`
by default, so it runs THE rollout loop) from a :class:`~rlharvest.protocol.WorkerSpec`, then
serves commands:

* push transports (worker processes, threads, torch.distributed nodes) call :meth:`Worker.serve`,
  which reads commands from a :class:`~rlharvest.transport.base.WorkerEndpoint` and sends replies;
* pull transports (torch RPC) call :meth:`Worker.handle` remotely, one command per call.

What the loop needs from the collector it runs is written down in ``contract.py``; it touches nothing else.
A worker never dies silently: every handler's exception becomes a failure reply carrying the remote
traceback, which the parent raises as :class:`~rlharvest.errors.WorkerError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import multiprocessing.connection
import signal
import socket
import threading
import time
import warnings
from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDictBase

from .._utils import TRAJ_IDS, unwrap
from ..checkpoint import CHECKPOINT_KEY
from ..errors import RemoteFailure
from ..protocol import FREE_BATCH, LEAVING, READY, Command, Message, Reply, UnknownCommandError, WorkerSpec, Written
from ..transport.base import WorkerEndpoint
from .contract import ParentDuties, WorkerCollector

__all__ = ["Worker", "WorkerEnd", "run_worker"]


class WorkerEnd(str, enum.Enum):
    """Why a worker's loop ended (what :func:`run_worker` returns; ``rlharvest node`` says it)."""

    CLOSED = "closed"
    """The parent sent CLOSE: the collector shut down, or removed this worker."""
    LEFT = "left"
    """Preempted (SIGTERM): it finished or handed back its rollout and said it leaves."""
    PARENT_GONE = "parent gone"
    """The parent disappeared (its connection closed) without a word."""
    FAILED = "failed"
    """Building its collector failed (the parent was told)."""


def _is_stateless(policy: Any) -> bool:
    return isinstance(policy, torch.nn.Module) and any(
        t.is_meta for t in itertools.chain(policy.parameters(), policy.buffers()))


def _apply_env_settings(collector: WorkerCollector, spec: WorkerSpec) -> None:
    """Set in the worker's env what ``setattr_env`` set before it was built (it lasts: docs/collection.md,
    "Reconfiguring running envs").

    Raises:
        TypeError: for settings and a collector class of the user's own without ``setattr_env``.
    """
    if not spec.env_settings:
        return
    setattr_env = getattr(collector, "setattr_env", None)
    if setattr_env is None:
        raise TypeError(f"{type(collector).__name__} has no setattr_env: it cannot take the env settings "
                        f"{[name for name, _ in spec.env_settings]} its worker was given.")
    for name, value in spec.env_settings:
        setattr_env(name, value)


def _build_collector(spec: WorkerSpec, policy: Any) -> WorkerCollector:
    collector_class = unwrap(spec.collector_class)
    if spec.options is not None:  # one of rlharvest's: typed options, parsed once in the parent
        return collector_class.from_options(spec.options.in_worker(
            create_env_fn=unwrap(spec.create_env_fn), policy=policy, policy_factory=unwrap(spec.policy_factory),
            worker_idx=spec.worker_idx))
    kwargs = {name: unwrap(value) for name, value in spec.collector_kwargs.items()}
    if spec.replay_buffer is not None:
        kwargs["replay_buffer"] = spec.replay_buffer
        kwargs.setdefault("local_init_rb", True)
    return collector_class(
        unwrap(spec.create_env_fn),
        policy,
        policy_factory=unwrap(spec.policy_factory),
        worker_idx=spec.worker_idx,
        **kwargs,
    )


class Worker:
    """Serves one collector to a parent.

    Args:
        spec: what to build (and who this worker is).
        endpoint: the connection to the parent (None for pull transports).

    Example:
        >>> from rlharvest.collectors import Collector
        >>> from rlharvest.envs import CountingEnv
        >>> worker = Worker(WorkerSpec(0, Collector, CountingEnv, {"frames_per_batch": 4}))
        >>> reply = worker.handle(Message(Command.COLLECT, 1, False))
        >>> reply.frames
        4
    """

    def __init__(self, spec: WorkerSpec, endpoint: WorkerEndpoint | None = None) -> None:
        self.spec = spec
        self.worker_idx = spec.worker_idx
        self.endpoint = endpoint
        self.running_free = False
        self.paused = False
        self.closed = False
        self._steps = itertools.count()
        self._free_ids = itertools.count()
        self._free_frames = 0
        self._times_sent = (0.0, 0.0)  # the collector's env and policy seconds already reported
        self._written = Written()  # its totals: what it wrote into the replay buffer, and kept for it
        self._host: str | None = socket.gethostname()  # said once, in the first BATCH reply
        #: when SIGTERM arrived (monotonic seconds), or None: the worker is being preempted
        self.preempted_at: float | None = None
        #: the rollout in progress was cut short by the preemption: it is handed back, not delivered
        self._handing_back = False
        self.collector = self._build(spec)
        self.duties: ParentDuties = self.collector.for_parent
        self._handlers: dict[Command, Callable[[Any], Any]] = {
            Command.COLLECT: self._collect,
            Command.RUN_FREE: self._run_free,
            Command.PAUSE: self._pause,
            Command.RESUME: self._resume,
            Command.SEED: self._seed,
            Command.RESET: lambda kwargs: self.collector.reset(**(kwargs or {})),
            Command.STATE_DICT: self._state_dict,
            Command.LOAD_STATE_DICT: self._load_state_dict,
            Command.GETATTR_POLICY: lambda name: getattr(self.collector.policy, name),
            Command.GETATTR_ENV: lambda name: self.collector.getattr_env(name),
            Command.CASCADE: lambda call: self.collector.cascade_execute(call[0], *call[1], **call[2]),
            Command.ENABLE_PROFILE: self._enable_profile,
            Command.ATTACH_BUFFER: self._attach_buffer,
            Command.RESIZE: self._resize,
            Command.CLOSE: self._close,
        }

    def _build(self, spec: WorkerSpec) -> WorkerCollector:
        """The collector, with its weights, its policy version and its seed (a replacement's too)."""
        if spec.init_fn is not None:
            unwrap(spec.init_fn)()
        receivers = {k: _receiver_copy(s) for k, s in (spec.weight_recv_schemes or {}).items()}
        links = self.endpoint.receiver_links() if self.endpoint is not None else None
        for scheme in receivers.values():
            scheme.use_receiver_links(links)
        policy = unwrap(spec.policy)
        if "policy" in receivers and _is_stateless(policy):
            # Give the stateless policy its weights before the collector is built: a collector that
            # starts workers of its own must hand them real weights.
            scheme = receivers["policy"]
            scheme.init_on_receiver(model_id="policy", model=policy, worker_idx=spec.worker_idx)
            scheme.connect()
        collector = _build_collector(spec, policy)
        duties = collector.for_parent
        if self.endpoint is not None:
            duties.add_step_check(self._step_check)
        if spec.policy_version:
            duties.weights.set_version(spec.policy_version)
        if receivers:
            collector.register_scheme_receiver(receivers)
        seed = spec.start_seed()
        if seed is not None:
            _seed_worker(collector, seed, spec.static_seed)
        _apply_env_settings(collector, spec)
        return collector

    # ------------------------------------------------------------------ dispatch
    def handle(self, message: Message) -> Reply:
        """Run the handler of ``message`` and wrap its result (or its exception) in a Reply."""
        reply = Reply(message.request_id, self.worker_idx)
        try:
            command = message.command if isinstance(message.command, Command) else Command(message.command)
        except ValueError:
            valid = ", ".join(c.name for c in Command)
            error = UnknownCommandError(f"Unknown command {message.command!r}; valid commands: {valid}")
            reply.failure = RemoteFailure.capture(error, self.worker_idx)
            return reply
        try:
            result = self._handlers[command](message.payload)
        except BaseException as err:  # a worker reports everything, it never dies silently
            reply.failure = RemoteFailure.capture(err, self.worker_idx)
            return reply
        if isinstance(result, Reply):
            result.request_id = message.request_id
            return result
        reply.value = result
        return reply

    # ------------------------------------------------------------------ the push loop
    def serve(self, idle_timeout: float = 0.25) -> WorkerEnd:
        """Answer commands until CLOSE, a preemption's leave, or the parent disappearing; returns which."""
        endpoint = self.endpoint
        waitables = self._waitables()
        while not self.closed and self.preempted_at is None:
            if self.running_free and not self.paused:
                message = endpoint.recv(0.0)
                if message is None:
                    self._free_rollout_reported()
                    continue
            else:
                if waitables:
                    multiprocessing.connection.wait(waitables, timeout=idle_timeout)
                    self.duties.weights.poll_receivers()
                message = endpoint.recv(0.0 if waitables else idle_timeout)
                if message is None:
                    if not endpoint.parent_alive():
                        break
                    continue
            reply = self.handle(message)
            if self._handing_back:  # cut short by a preemption: no partial batch, the parent asks again
                break
            endpoint.send(reply)
        if self.preempted_at is not None and not self.closed:
            self._leave()
            return WorkerEnd.LEFT
        return WorkerEnd.CLOSED if self.closed else WorkerEnd.PARENT_GONE

    # ------------------------------------------------------------------ preemption (docs/elastic.md)
    def preempt(self, *_: Any) -> None:
        """SIGTERM: finish the rollout in progress within the grace period, then leave (:meth:`serve`)."""
        self.preempt_at(time.monotonic())

    def preempt_at(self, when: float) -> None:
        """SIGTERM arrived at ``when`` (monotonic seconds), caught by the process this loop runs in."""
        if self.preempted_at is None:
            self.preempted_at = when

    @property
    def handing_back(self) -> bool:
        """Whether a preemption cut the last rollout short: it is handed back, not delivered."""
        return self._handing_back

    def _leave(self) -> None:
        """Tell the parent this worker leaves (preempted), then end as after CLOSE."""
        handed_back = self._handing_back
        self.closed = True
        self.endpoint.announce_leaving(handed_back)  # in shared memory where there is some: never lost
        if not handed_back:
            # The batch it delivered last must have left (nodes send it after replying). Weight updates
            # are applied meanwhile: a parent waiting for their acknowledgement before it takes the
            # batch would otherwise wait for this node's send timeout (60 s), and this node for it.
            with contextlib.suppress(Exception):
                self.endpoint.before_rollout(idle=self.duties.weights.poll_receivers)
        with contextlib.suppress(Exception):
            self.endpoint.send(Reply(LEAVING, self.worker_idx, value="handed back" if handed_back else "finished"))
        self.collector.shutdown(raise_on_error=False)

    def _past_grace(self) -> bool:
        """Whether a preempted worker must stop its rollout now to leave within its grace period (half
        of it is kept for closing the env and exiting)."""
        grace = self.spec.preemption_grace or 0.0
        return self.preempted_at is not None and time.monotonic() > self.preempted_at + grace / 2

    def _waitables(self) -> list:
        own = self.endpoint.wait_handle()
        return ([own] if own is not None else []) + list(self.duties.weights.receiver_waitables())

    def _step_check(self) -> bool:
        """Between env steps: advertise progress; stop the rollout if the parent interrupted it."""
        self.endpoint.report_progress(next(self._steps))
        if self.preempted_at is not None and self._past_grace():
            self._handing_back = True
            return True
        return self.endpoint.interrupted()

    # ------------------------------------------------------------------ rollouts
    def _rollout(self, random: bool) -> tuple[TensorDictBase, int]:
        """One batch of this worker's collector, with this worker's trajectory ids, and its valid frames."""
        batch = self.duties.collect_for_parent(random)
        offset = self.spec.traj_offset
        ids = batch.get(TRAJ_IDS, None)
        if offset and ids is not None:
            ids.copy_(torch.where(ids == -1, ids, ids + offset))
        frames = batch.numel() if ids is None else int((ids != -1).sum())
        return batch, frames

    def _said_host(self) -> str | None:
        """This host's name the first time it is asked, then None (the parent keeps it)."""
        host, self._host = self._host, None
        return host

    def _new_times(self) -> tuple[float, float]:
        """Env and policy seconds of the collector since they were last reported."""
        split = self.collector.time_split()
        (env, policy), self._times_sent = self._times_sent, (split["env"], split["policy"])
        return split["env"] - env, split["policy"] - policy

    def _write(self, batch: TensorDictBase, frames: int, free_frames: int = 0) -> None:
        """Write a batch into the shared replay buffer: only its collected steps, if it was cut short;
        ``free_frames``: the steps it holds that no batch reply carries (running free)."""
        if frames < batch.numel():
            batch = batch[batch.get(TRAJ_IDS) != -1]
        if batch.numel():
            self._count(self.duties.write_to_replay_buffer(self.spec.replay_buffer, batch), free_frames)

    def _count(self, written: Written, free_frames: int = 0) -> None:
        """Add ``written`` to this worker's totals and advertise them: the parent reads them where its
        transport keeps them (running free: no reply carries them), else with the next batch reply."""
        self._written += dataclasses.replace(written, free_frames=written.free_frames + free_frames, reports=1)
        if self.endpoint is not None:
            self.endpoint.report_written(self._written)

    def _publish(self, batch: TensorDictBase) -> Any:
        """Hand the batch to the transport; let the rollout write straight into what it publishes from."""
        value = self.endpoint.publish_batch(batch)
        shared = self.endpoint.batch_buffer()
        if shared is not None and shared is not batch:
            self.duties.write_batches_into(shared, batch)
        return value

    def _collect(self, request) -> Reply:
        random, mark = request if isinstance(request, tuple) else (request, None)
        if self.endpoint is not None:
            self.endpoint.before_rollout()  # the parent took the last batch before asking again
            self.endpoint.clear_interrupt(mark)
        batch, frames = self._rollout(bool(random))
        buffer = self.spec.replay_buffer
        if buffer is not None and buffer.storage is not None:
            self._write(batch, frames)
            return Reply(0, self.worker_idx, value=self._written, frames=frames, written=True,
                         times=self._new_times(), host=self._said_host())
        if buffer is not None:  # the parent allocates the buffer's storage from this batch
            self._count(self.duties.keep_for_replay_buffer(batch))
        value = batch if self.endpoint is None else self._publish(batch)
        return Reply(0, self.worker_idx, value=value, frames=frames, times=self._new_times(), host=self._said_host())

    def _free_rollout_reported(self) -> None:
        """A rollout while running free; when it raises and batches are pushed to the parent, the
        failure is pushed in their place (the parent raises it, or replaces this worker) and the
        worker stops running free. Workers writing a replay buffer end as before."""
        try:
            self._free_rollout()
        except Exception as err:
            if self.spec.replay_buffer is not None:
                raise
            self.running_free = False
            failure = RemoteFailure.capture(err, self.worker_idx)
            self.endpoint.send(Reply(FREE_BATCH - next(self._free_ids), self.worker_idx, failure=failure))

    def _free_rollout(self) -> None:
        """One rollout while running free: written to the shared replay buffer, or pushed to the parent
        (nodes: the parent owns the buffer) as an unsolicited BATCH reply with a negative id."""
        buffer = self.spec.replay_buffer
        target = self.spec.init_random_frames
        done = buffer.write_count if buffer is not None else self._free_frames
        self.endpoint.before_rollout(idle=self.duties.weights.poll_receivers)
        self.endpoint.clear_interrupt()
        batch, frames = self._rollout(bool(target) and done < target)
        self._free_frames += frames
        if buffer is None:
            value = self._publish(batch)
            self.endpoint.send(Reply(FREE_BATCH - next(self._free_ids), self.worker_idx, value=value, frames=frames,
                                     times=self._new_times()))
            return
        # pause()/shutdown may have interrupted the rollout: then only the collected steps are written
        self._write(batch, frames if self.endpoint.interrupted() else batch.numel(), free_frames=frames)

    # ------------------------------------------------------------------ other handlers
    def _run_free(self, _) -> str:
        buffer = self.spec.replay_buffer
        if buffer is not None and buffer.storage is None:
            raise RuntimeError("Running free needs the replay buffer's storage to be attached first.")
        self.running_free, self.paused = True, False
        return "running"

    def _pause(self, _) -> str:
        self.paused = True
        return "paused"

    def _resume(self, _) -> str:
        self.paused = False
        return "resumed"

    def _seed(self, payload) -> int:
        seed, static_seed = payload
        return _seed_worker(self.collector, seed, static_seed)

    def _state_dict(self, options: dict | None) -> dict:
        """The collector's checkpoint, with what this worker adds to its batches (a replacement's
        trajectory-id offset) under ``"rlharvest_resume"`` (docs/checkpoints.md)."""
        state = self.collector.state_dict(**(options or {}))
        section = state.get(CHECKPOINT_KEY)
        if section is not None:
            section["worker"] = {"traj_offset": int(self.spec.traj_offset)}
        return state

    def _load_state_dict(self, state: dict) -> list[tuple[type, str]]:
        """Load a checkpoint; the warnings it raises (an episode that restarts) go to the parent, which
        raises them where the user sees them."""
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            self.collector.load_state_dict(state)
        worker = (state.get(CHECKPOINT_KEY) or {}).get("worker")
        if worker is not None:
            self.spec = self.spec.replacement(traj_offset=int(worker["traj_offset"]))
        return [(warning.category, str(warning.message)) for warning in raised]

    def _enable_profile(self, config) -> str:
        self.duties.enable_profile(config)
        return "profiling"

    def _attach_buffer(self, storage: TensorDictBase) -> Written:
        """Write into ``storage`` from now on; returns its totals (the trajectories that ended in the
        batch it kept counted)."""
        self.spec.replay_buffer.attach_storage(storage)
        return self._written

    def _resize(self, frames: int) -> int:
        """Rollouts of ``frames`` frames from the next one on (a sync parent re-split its batch among a
        changed number of workers, docs/elastic.md "Autoscaling"): the rollout's buffer is rebuilt and the
        transport publishes the next batch afresh (its new buffer or layout travels with its reply)."""
        if self.endpoint is not None:
            self.endpoint.before_rollout()  # the last batch has left before its buffer is let go
        collected = self.duties.resize_batches(int(frames))
        if self.endpoint is not None:
            self.endpoint.batch_resized()
        return collected

    def _close(self, _) -> str:
        self.closed = True
        self.collector.shutdown(raise_on_error=False)
        return "closed"


def _seed_worker(collector: WorkerCollector, seed: int, static_seed: bool) -> int:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    return collector.set_seed(seed, static_seed=static_seed)


def _receiver_copy(scheme):
    """The receiver a worker builds from its parent's (sender) scheme, as unpickling would give it.

    Forked and in-process workers see the sender object itself, unpickled: make the copy here.
    """
    if not scheme.initialized_on_sender:
        return scheme
    copy = scheme.__class__.__new__(scheme.__class__)
    copy.__setstate__(scheme.__getstate__())
    return copy


def run_worker(spec: WorkerSpec, endpoint: WorkerEndpoint,
               on_ready: Callable[[], None] | None = None) -> WorkerEnd:
    """A worker's life on a push transport: build, send READY (or the failure), serve, clean up;
    returns why it ended. ``on_ready()`` is called once READY was sent.

    Every push backend runs exactly this in its worker (a process, a thread, a node); backends get
    it passed in as their target (``rlharvest.transport`` never imports the worker loop).
    """
    # SIGTERM is handled from the start: one that arrives while the worker is built is a preemption too
    early: list[float] = []
    handles_sigterm = spec.preemption_grace is not None and threading.current_thread() is threading.main_thread()
    if handles_sigterm:
        signal.signal(signal.SIGTERM, lambda *_: early.append(time.monotonic()))
    try:
        worker = Worker(spec, endpoint)
    except BaseException as err:
        endpoint.send(Reply(READY, spec.worker_idx, failure=RemoteFailure.capture(err, spec.worker_idx)))
        endpoint.close()
        return WorkerEnd.FAILED
    if handles_sigterm:
        signal.signal(signal.SIGTERM, worker.preempt)  # a preemption is a leave (docs/elastic.md)
        if early:
            worker.preempted_at = early[0]
    elif spec.preemption_grace is not None:  # a loop in a thread (a Ray actor's): its process catches SIGTERM
        endpoint.on_preemption(worker.preempt_at)
    endpoint.send(Reply(READY, spec.worker_idx, value="ready"))
    if on_ready is not None:
        on_ready()
    try:
        return worker.serve()
    finally:
        if not worker.closed:
            worker.collector.shutdown(raise_on_error=False)
        endpoint.close()
