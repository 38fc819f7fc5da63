"""THE worker loop: typed commands in, typed replies out, one handler per command.

Every backend runs it. A worker builds its collector (a :class:`~rlharvest.collectors.Collector`
by default, so it runs THE rollout loop) from a :class:`WorkerSpec`, then serves commands:

* push transports (worker processes, torch.distributed nodes) call :meth:`Worker.serve`, which
  reads commands from a :class:`~rlharvest.transport.base.WorkerEndpoint` and sends replies back;
* pull transports (torch RPC) call :meth:`Worker.handle` remotely, one command per call.

A worker never dies silently: every handler's exception becomes a failure reply carrying the remote
traceback, which the parent raises as :class:`~rlharvest.errors.WorkerError`.
"""

from __future__ import annotations

import enum
import itertools
import multiprocessing.connection
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDictBase

from ._utils import unwrap
from .errors import RemoteFailure
from .transport.base import WorkerEndpoint

__all__ = ["Command", "Message", "Reply", "WorkerSpec", "Worker", "UnknownCommandError"]


class Command(enum.Enum):
    """What a parent can ask a worker to do."""

    COLLECT = "collect"                  # payload: (random, interrupt mark) -> BATCH reply
    RUN_FREE = "run_free"                # collect continuously into the replay buffer
    PAUSE = "pause"                      # stop running free (reply once no write is in flight)
    RESUME = "resume"
    SEED = "seed"                        # payload: (seed, static_seed) -> next seed
    RESET = "reset"                      # payload: None or reset kwargs
    STATE_DICT = "state_dict"
    LOAD_STATE_DICT = "load_state_dict"  # payload: state dict
    GETATTR_POLICY = "getattr_policy"    # payload: attribute name
    GETATTR_ENV = "getattr_env"          # payload: attribute name
    GETATTR_RB = "getattr_rb"            # payload: attribute name
    CASCADE = "cascade_execute"          # payload: (attr_path, args, kwargs)
    ENABLE_PROFILE = "enable_profile"    # payload: ProfileConfig
    ATTACH_BUFFER = "attach_buffer"      # payload: replay-buffer storage
    UPDATE_WEIGHTS = "update_weights"    # legacy mode: take the weights of the legacy scheme
    CLOSE = "close"


#: request ids at or below this mark unsolicited batches of a worker running free (never answered ids)
FREE_BATCH = -2


class UnknownCommandError(ValueError):
    """A message whose command is not a :class:`Command`."""


@dataclass
class Message:
    command: Command
    request_id: int
    payload: Any = None


@dataclass
class Reply:
    request_id: int
    worker_idx: int
    value: Any = None
    failure: RemoteFailure | None = None
    #: for BATCH replies: valid frames, and whether the batch went to the replay buffer
    frames: int = 0
    written: bool = False


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its collector. Pickled once, at worker start."""

    worker_idx: int
    collector_class: Any
    create_env_fn: Any
    collector_kwargs: dict = field(default_factory=dict)
    policy: Any = None
    policy_factory: Any = None
    weight_recv_schemes: dict | None = None
    replay_buffer: Any = None
    num_threads: int = 1
    #: frames of random actions when running free (decided from the buffer's write count)
    init_random_frames: int = 0
    #: called in the worker before it builds its env and collector
    init_fn: Any = None


def _is_stateless(policy: Any) -> bool:
    return isinstance(policy, torch.nn.Module) and any(
        t.is_meta for t in itertools.chain(policy.parameters(), policy.buffers()))


def _build_collector(spec: WorkerSpec, policy: Any):
    kwargs = {name: unwrap(value) for name, value in spec.collector_kwargs.items()}
    if spec.replay_buffer is not None:
        kwargs["replay_buffer"] = spec.replay_buffer
        kwargs.setdefault("local_init_rb", True)
    collector_class = unwrap(spec.collector_class)
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
        spec: what to build.
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
        if spec.init_fn is not None:
            unwrap(spec.init_fn)()
        receivers = {k: _receiver_copy(s) for k, s in (spec.weight_recv_schemes or {}).items()}
        policy = unwrap(spec.policy)
        if "policy" in receivers and _is_stateless(policy):
            # Give the stateless policy its weights before the collector is built: a collector that
            # starts workers of its own must hand them real weights.
            scheme = receivers["policy"]
            scheme.init_on_receiver(model_id="policy", model=policy, worker_idx=spec.worker_idx)
            scheme.connect()
        self.collector = _build_collector(spec, policy)
        if endpoint is not None:
            self.collector._extra_step_checks = [self._step_check]
        if receivers:
            self.collector.register_scheme_receiver(receivers)
        self._handlers: dict[Command, Callable[[Any], Any]] = {
            Command.COLLECT: self._collect,
            Command.RUN_FREE: self._run_free,
            Command.PAUSE: self._pause,
            Command.RESUME: self._resume,
            Command.SEED: self._seed,
            Command.RESET: self._reset,
            Command.STATE_DICT: lambda _: self.collector.state_dict(),
            Command.LOAD_STATE_DICT: lambda state: self.collector.load_state_dict(state),
            Command.GETATTR_POLICY: lambda name: getattr(self.collector.policy, name),
            Command.GETATTR_ENV: lambda name: getattr(self.collector.env, name),
            Command.GETATTR_RB: lambda name: getattr(self.spec.replay_buffer, name),
            Command.CASCADE: lambda call: self.collector.cascade_execute(call[0], *call[1], **call[2]),
            Command.ENABLE_PROFILE: self._enable_profile,
            Command.ATTACH_BUFFER: self._attach_buffer,
            Command.UPDATE_WEIGHTS: self._update_weights,
            Command.CLOSE: self._close,
        }

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
    def serve(self, idle_timeout: float = 0.25) -> None:
        """Answer commands until CLOSE (or until the parent disappears)."""
        endpoint = self.endpoint
        waitables = self._waitables()
        while not self.closed:
            if self.running_free and not self.paused:
                message = endpoint.recv(0.0)
                if message is None:
                    self._free_rollout()
                    continue
            else:
                if waitables:
                    multiprocessing.connection.wait(waitables, timeout=idle_timeout)
                    self.collector._poll_receivers()
                message = endpoint.recv(0.0 if waitables else idle_timeout)
                if message is None:
                    if not endpoint.parent_alive():
                        break
                    continue
            endpoint.send(self.handle(message))

    def _waitables(self) -> list:
        waitables = []
        if hasattr(self.endpoint, "fileno"):
            waitables.append(self.endpoint)
        for scheme in (self.collector._receiver_schemes or {}).values():
            receiver = scheme.receiver_transport
            if receiver is not None and hasattr(receiver, "fileno"):
                waitables.append(receiver)
        return waitables

    def _step_check(self) -> bool:
        """Between env steps: advertise progress; stop the rollout if the parent interrupted it."""
        self.endpoint.report_progress(next(self._steps))
        return self.endpoint.interrupted()

    # ------------------------------------------------------------------ handlers
    def _collect(self, request) -> Reply:
        random, mark = request if isinstance(request, tuple) else (request, None)
        if self.endpoint is not None:
            self.endpoint.before_rollout()  # the parent took the last batch before asking again
            self.endpoint.clear_interrupt(mark)
        collector = self.collector
        batch = collector._collect_for_parent(bool(random))
        frames = _valid_frames(batch)
        buffer = self.spec.replay_buffer
        if buffer is not None and buffer.storage is not None:
            if frames < batch.numel():  # interrupted (shutdown): only the collected steps are data
                batch = batch[batch.get(("collector", "traj_ids")) != -1]
            if batch.numel():
                collector._write_buffer(buffer, batch)
            return Reply(0, self.worker_idx, frames=frames, written=True)
        if buffer is not None:  # the parent allocates the buffer's storage from this batch
            collector._keep_for_buffer(batch)
        if self.endpoint is None:
            return Reply(0, self.worker_idx, value=batch, frames=frames)
        value = self.endpoint.publish_batch(batch)
        self._adopt_published_buffer(batch)
        return Reply(0, self.worker_idx, value=value, frames=frames)

    def _adopt_published_buffer(self, batch: TensorDictBase) -> None:
        """Let the rollout write straight into the buffer the transport publishes from (zero copy)."""
        shared = getattr(self.endpoint, "batch_buffer", None)
        rollout = getattr(self.collector, "rollout", None)
        if shared is not None and shared is not batch and rollout is not None and rollout.buffer is batch:
            rollout.set_buffer(shared)

    def _free_rollout(self) -> None:
        """One rollout while running free: written to the shared replay buffer, or pushed to the parent
        (nodes: the parent owns the buffer) as an unsolicited BATCH reply with a negative id."""
        buffer = self.spec.replay_buffer
        target = self.spec.init_random_frames
        if buffer is not None:
            random = bool(target) and buffer.write_count < target
        else:
            random = bool(target) and self._free_frames < target
        self.endpoint.before_rollout(idle=self.collector._poll_receivers)
        self.endpoint.clear_interrupt()
        batch = self.collector._collect_for_parent(random)
        frames = _valid_frames(batch)
        self._free_frames += frames
        if buffer is None:
            value = self.endpoint.publish_batch(batch)
            self._adopt_published_buffer(batch)
            self.endpoint.send(Reply(FREE_BATCH - next(self._free_ids), self.worker_idx, value=value, frames=frames))
            return
        if self.endpoint.interrupted():
            # pause()/shutdown interrupted the rollout: keep only the steps that were collected
            batch = batch[batch.get(("collector", "traj_ids")) != -1]
        if batch.numel():
            self.collector._write_buffer(buffer, batch)

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
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        return self.collector.set_seed(seed, static_seed=static_seed)

    def _reset(self, payload) -> None:
        self.collector.reset(**(payload or {}))

    def _enable_profile(self, config) -> str:
        self.collector._iteration_started = False
        self.collector._profile_config = config
        self.collector._apply_profile_config(config)
        return "profiling"

    def _attach_buffer(self, storage: TensorDictBase) -> str:
        self.spec.replay_buffer.attach_storage(storage)
        return "attached"

    def _update_weights(self, _) -> int:
        scheme = (self.collector._receiver_schemes or {}).get("policy")
        if scheme is not None:
            scheme.receive(timeout=scheme.timeout)
        return int(self.collector._policy_version)

    def _close(self, _) -> str:
        self.closed = True
        self.collector.shutdown(raise_on_error=False)
        return "closed"


def _receiver_copy(scheme):
    """The receiver a worker builds from its parent's (sender) scheme, as unpickling would give it.

    With the fork start method nothing is pickled: the worker sees the sender object itself.
    """
    if not scheme.initialized_on_sender:
        return scheme
    copy = scheme.__class__.__new__(scheme.__class__)
    copy.__setstate__(scheme.__getstate__())
    return copy


def _valid_frames(batch: TensorDictBase) -> int:
    ids = batch.get(("collector", "traj_ids"), None)
    if ids is None:
        return batch.numel()
    return int((ids != -1).sum())


def run_worker(spec: WorkerSpec, endpoint: WorkerEndpoint) -> None:
    """Build a worker and serve; construction failures are reported in the READY reply."""
    try:
        worker = Worker(spec, endpoint)
    except BaseException as err:
        endpoint.send(Reply(-1, spec.worker_idx, failure=RemoteFailure.capture(err, spec.worker_idx)))
        endpoint.close()
        return
    endpoint.send(Reply(-1, spec.worker_idx, value="ready"))
    try:
        worker.serve()
    finally:
        if not worker.closed:
            worker.collector.shutdown(raise_on_error=False)
        endpoint.close()

