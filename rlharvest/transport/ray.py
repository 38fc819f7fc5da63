"""The ``ray`` backend: every worker is a Ray actor running the worker loop.

* An actor (:class:`RayWorkerActor`) runs the backend's target, the worker loop, in a thread of
  its own, against a :class:`RayWorkerEndpoint`; its methods are the other end of that endpoint.
  The actor is threaded (``max_concurrency``) so that commands, replies and weights never wait for
  a rollout.
* Commands are one-way actor calls (``push``) numbered by the parent: a threaded actor may run
  calls out of order, so the endpoint hands them to the loop in their order.
* Replies come back by long polling: a thread of the parent keeps one ``pull`` call outstanding,
  which returns as soon as replies are ready (or after a second, with the worker's progress), and
  rings a pipe the worker pool waits on. A dead actor fails that call: the handle knows within
  moments, and the pool raises ``WorkerError`` naming it.
* A batch travels inside its reply (a private copy: the loop reuses its buffer for the next rollout),
  packed in one byte buffer when it is dense and on the CPU (``FlatBatch``: cheap to unpickle).
* Running free, batches are pushed unasked, so both ends bound them: an actor starts its next rollout
  only while fewer than ``_FREE_WINDOW`` of its batches wait to be pulled, and the parent pulls no
  more while that many wait to be taken. Without the bound, a parent slower than its actors pulled
  ever larger lists, each taking longer to serialise, until a poll went unanswered.
* Weights: ``ray_weights.py`` (shared memory and a direct channel on the driver's node, ``ray.put`` elsewhere).
* Actors die with their driver (Ray's ownership), and are killed (``ray.kill``) when stopped.

Ray is imported lazily: ``pip install 'rlharvest[ray]'`` provides it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from tensordict import TensorDictBase

from ..data.flat import FlatBatch, FlatUnpacker
from ..protocol import FREE_BATCH, READY, WorkerSpec
from .base import Backend, WorkerEndpoint, WorkerHandle, WorkerTarget
from .pipes import Doorbell
from .ray_weights import RayWeightLinks, WeightInboxes

__all__ = ["ActorReplayBuffer", "as_replay_buffer", "RayBackend", "RayWorkerActor", "RayWorkerEndpoint", "RayWorkerHandle", "require_ray", "ensure_ray",
           "DEFAULT_REMOTE_CONFIG"]

#: what each actor reserves unless ``remote_configs`` says otherwise: one CPU, no GPU
DEFAULT_REMOTE_CONFIG = {"num_cpus": 1}
#: concurrent calls an actor serves (commands, the long poll, weights, interrupts)
_ACTOR_CONCURRENCY = 8
#: seconds a long poll waits for replies before it returns the worker's progress anyway
_POLL_SECONDS = 1.0
#: batches of a worker running free that may wait to be pulled, and (again) to be taken by the parent
_FREE_WINDOW = 4
#: seconds between weight checks of a worker waiting for room to push its next batch
_ROOM_POLL_SECONDS = 0.005


def _pushed(reply: Any) -> bool:
    """Whether ``reply`` is a batch pushed by a worker running free (not an answer to a command)."""
    return reply is not None and reply.request_id <= FREE_BATCH


def require_ray():
    """The ``ray`` module.

    Raises:
        ImportError: when Ray is not installed, saying how to install it.
    """
    try:
        import ray
    except ImportError as err:
        raise ImportError("The Ray backend needs Ray: pip install 'rlharvest[ray]'") from err
    return ray


def ensure_ray(init_config: dict | None = None):
    """Ray, initialised with ``init_config`` if it is not yet (an initialised Ray is used as it is)."""
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(**(init_config or {}))
    return ray


class ActorReplayBuffer:
    """A replay buffer that is itself a Ray actor, written through its ``extend`` method."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def extend(self, data: TensorDictBase) -> Any:
        return require_ray().get(self.actor.extend.remote(data))

    def __getattr__(self, name: str) -> Any:
        return require_ray().get(getattr(self.actor, name).remote())


def as_replay_buffer(buffer: Any) -> Any:
    """``buffer``, or an :class:`ActorReplayBuffer` writing into it when it is a Ray actor."""
    if buffer is not None and isinstance(buffer, require_ray().actor.ActorHandle):
        return ActorReplayBuffer(buffer)
    return buffer


# ---------------------------------------------------------------------------------------------- actor side
class RayWorkerEndpoint(WorkerEndpoint):
    """The worker loop's end inside an actor: numbered commands in, replies out, interrupts, progress."""

    def __init__(self, worker_idx: int) -> None:
        self.worker_idx = worker_idx
        self._commands: dict[int, Any] = {}
        self._next = 0
        self._lock = threading.Condition()
        self._doorbell = Doorbell()
        self._replies: collections.deque = collections.deque()
        self._replies_ready = threading.Condition()
        self._pushed_waiting = 0  # pushed batches among _replies
        self.interrupts = 0
        self._seen = 0
        self.steps = 0
        self.inboxes = WeightInboxes()
        self._preempted_at: float | None = None
        self._preempt: Callable[[float], None] | None = None

    def on_preemption(self, preempt: Callable[[float], None]) -> None:
        self._preempt = preempt
        if self._preempted_at is not None:
            preempt(self._preempted_at)

    def preempted(self, when: float) -> None:
        """The actor's process caught SIGTERM at ``when``: the loop finishes or hands back its rollout."""
        if self._preempted_at is None:
            self._preempted_at = when
        if self._preempt is not None:
            self._preempt(self._preempted_at)

    # ---- called by the actor's methods (threads of the actor)
    def put_command(self, seq: int, message: Any) -> None:
        with self._lock:
            self._commands[seq] = message
            self._lock.notify_all()
        self._doorbell.ring()

    def take_replies(self, timeout: float, pushed_limit: int) -> list:
        """The replies in order, as soon as there are any (``timeout`` s at most), with at most
        ``pushed_limit`` pushed batches: the first one beyond it ends the list."""
        def ready() -> bool:
            return bool(self._replies) and (pushed_limit > 0 or not _pushed(self._replies[0]))

        replies = []
        with self._replies_ready:
            self._replies_ready.wait_for(ready, timeout)
            while self._replies:
                if _pushed(self._replies[0]):
                    if pushed_limit <= 0:
                        break
                    pushed_limit -= 1
                    self._pushed_waiting -= 1
                replies.append(self._replies.popleft())
            self._replies_ready.notify_all()  # room for the loop's next batch
        return replies

    # ---- the worker loop's side
    def recv(self, timeout: float) -> Any | None:
        with self._lock:
            if self._next not in self._commands and timeout > 0:
                self._lock.wait_for(lambda: self._next in self._commands, timeout)
            message = self._commands.pop(self._next, None)
            if message is None:
                self._doorbell.clear()  # rung for a command still in flight (it rings again)
                return None
            self._next += 1
            return message

    def send(self, message: Any) -> None:
        with self._replies_ready:
            self._replies.append(message)
            self._pushed_waiting += _pushed(message)
            self._replies_ready.notify_all()

    def has_replies(self) -> bool:
        return bool(self._replies)

    def before_rollout(self, idle: Callable[[], None] | None = None) -> None:
        """Running free: wait while ``_FREE_WINDOW`` batches are still to be pulled, applying weight
        updates (``idle``) meanwhile; a command that arrives ends the wait (the loop answers it)."""
        while True:
            with self._replies_ready:
                if self._pushed_waiting < _FREE_WINDOW or self._next in self._commands:
                    return
                self._replies_ready.wait(_ROOM_POLL_SECONDS)
            if idle is not None:
                idle()

    def publish_batch(self, batch: TensorDictBase) -> FlatBatch | TensorDictBase:
        """A private copy (the reply is serialised when it leaves, after the next rollout may have
        begun), packed in one buffer when it can be: unpickling it in the parent is then one copy,
        not a ``torch.load`` per leaf (docs/performance.md, "Learner CPU per batch")."""
        return FlatBatch.of(batch) if FlatBatch.packable(batch) else batch.clone()

    def wait_handle(self) -> Doorbell:
        return self._doorbell

    def receiver_links(self) -> WeightInboxes:
        return self.inboxes

    def interrupted(self) -> bool:
        return self.interrupts > self._seen

    def clear_interrupt(self, mark: int | None = None) -> None:
        self._seen = self.interrupts if mark is None else mark

    def report_progress(self, steps: int) -> None:
        self.steps = steps


def _run_loop(target: WorkerTarget, spec: WorkerSpec, endpoint: RayWorkerEndpoint, outcome: dict) -> None:
    try:
        target(spec, endpoint)
    except BaseException:  # the worker loop reports its own failures; this is a failure of the loop
        outcome["failure"] = traceback.format_exc()


class RayWorkerActor:
    """The body of every worker actor: the worker loop in a thread, and the calls the parent makes.

    Args:
        target: the worker loop (``rlharvest.worker.run_worker``), run as ``target(spec, endpoint)``.
        spec: what the worker is built from.
    """

    def __init__(self, target: WorkerTarget, spec: WorkerSpec) -> None:
        import torch

        from .._utils import use_worker_scheduling

        use_worker_scheduling()
        torch.set_num_threads(max(1, int(spec.num_threads)))
        self.endpoint = RayWorkerEndpoint(spec.worker_idx)
        self._outcome: dict[str, str] = {}
        self._grace = spec.preemption_grace
        self._pulled_all = threading.Event()  # the loop ended and the parent pulled every reply
        self._leaving = False
        self._rays_handler: Any = None
        if self._grace is not None and threading.current_thread() is threading.main_thread():
            # Ray's own handler ends the process at once (SystemExit): SIGTERM is a leave instead
            self._rays_handler = signal.signal(signal.SIGTERM, self._sigterm)
        self._thread = threading.Thread(target=_run_loop, args=(target, spec, self.endpoint, self._outcome),
                                        name=f"rlharvest-worker-{spec.worker_idx}", daemon=True)
        self._thread.start()

    def _sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM (the process's main thread): the worker loop finishes or hands back its rollout and
        says goodbye; the process exits once the parent pulled it all, or at the end of the grace
        period, through Ray's own handler (:meth:`_exit_after_leaving` sends SIGTERM again)."""
        if self._leaving:
            handler, self._rays_handler = self._rays_handler, None
            if callable(handler):
                handler(signum, frame)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        self._leaving = True
        now = time.monotonic()
        self.endpoint.preempted(now)
        threading.Thread(target=self._exit_after_leaving, args=(now + float(self._grace),),
                         name="rlharvest-preempted", daemon=True).start()

    def _exit_after_leaving(self, deadline: float) -> None:
        self._pulled_all.wait(max(0.0, deadline - time.monotonic()))
        os.kill(os.getpid(), signal.SIGTERM)

    def push(self, seq: int, message: Any) -> None:
        self.endpoint.put_command(seq, message)

    def pull(self, timeout: float, pushed_limit: int) -> tuple[list, int, bool, str | None]:
        """``(replies, progress, loop running, failure of the loop)``, as soon as there are replies
        (with at most ``pushed_limit`` batches pushed by the loop running free)."""
        running = self._thread.is_alive()
        replies = self.endpoint.take_replies(timeout if running else 0.0, pushed_limit)
        more = running or bool(replies) or self.endpoint.has_replies()  # what an ended loop left is pulled too
        if not more and self._leaving:  # preempted: its goodbye reached the parent, the process may go
            self._pulled_all.set()
        return replies, self.endpoint.steps, more, self._outcome.get("failure")

    def interrupt(self, count: int) -> None:
        self.endpoint.interrupts = max(self.endpoint.interrupts, count)

    def deliver_weights(self, model_id: str, version: int, payload: list, initial: bool, timeout: float):
        """Leave weights for the loop (``payload`` is ``[ObjectRef]``: fetched by the loop, not here);
        for an update, return once it is applied (the version, or the failure that stopped it)."""
        return self.endpoint.inboxes.deliver(model_id, version, payload, initial, timeout)

    def pid(self) -> int:
        return os.getpid()

    def hello(self) -> tuple[int, str]:
        """``(pid, Ray node id)``: answered as soon as the actor exists, while its worker builds."""
        return os.getpid(), require_ray().get_runtime_context().get_node_id()


_ACTOR_CLASS: dict[str, Any] = {}


def _actor_class():
    if "class" not in _ACTOR_CLASS:
        _ACTOR_CLASS["class"] = require_ray().remote(RayWorkerActor)
    return _ACTOR_CLASS["class"]


# ---------------------------------------------------------------------------------------------- parent side
class RayWorkerHandle(WorkerHandle):
    """The parent's end of one worker actor: numbered one-way commands, replies by long polling.

    Args:
        worker_idx: the worker's index.
        actor: its Ray actor handle.
        heartbeat_timeout: seconds a long poll may stay unanswered before the actor counts as gone.
        start_timeout: seconds the first answer may take (Ray creating the actor: scheduling it,
            starting its process, importing what it runs).
        resources: the actor's ``ray.remote`` options, named when it cannot be created in time.
    """

    def __init__(self, worker_idx: int, actor: Any, heartbeat_timeout: float, start_timeout: float = 120.0,
                 resources: dict | None = None) -> None:
        self.worker_idx = worker_idx
        self.actor = actor
        self.heartbeat_timeout = heartbeat_timeout
        self.start_timeout = start_timeout
        self.resources = resources or {}
        self._seq = 0
        self._interrupts = 0
        self._progress = -1
        self._replies: collections.deque = collections.deque()
        self._unpacker = FlatUnpacker()  # batches are unpacked by the caller's thread, one at a time
        self._pushed_held = 0  # pushed batches among _replies (guarded by _taken)
        self._taken = threading.Condition()
        self._doorbell = Doorbell()
        self._gone: str | None = None
        self._start_failure: str | None = None
        #: the Ray node the actor runs on, once it answered ``hello`` (weights to it travel by shared
        #: memory when it is the driver's node)
        self.node_id: str | None = None
        self._actor_pid: int | None = None
        self._greeted = threading.Event()
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll_forever, name=f"rlharvest-ray-poll-{worker_idx}",
                                        daemon=True)
        self._poller.start()

    def _poll_forever(self) -> None:
        if not self._greet():
            return
        ray = require_ray()
        while not self._stopping.is_set():
            room = self._room_for_pushed()
            wait = _POLL_SECONDS if room else 0.0  # no room: only a heartbeat (and answers to commands)
            bound = wait + self.heartbeat_timeout
            try:
                replies, progress, running, failure = ray.get(self.actor.pull.remote(wait, room), timeout=bound)
            except ray.exceptions.GetTimeoutError:
                self._end(f"it did not answer for {bound:g} s (node unreachable?)")
                return
            except Exception as err:  # the actor died (killed, crashed, its node lost) or Ray shut down
                self._end(_describe_death(err))
                return
            self._progress = progress
            with self._taken:
                self._replies.extend(replies)
                self._pushed_held += sum(map(_pushed, replies))
            self._start_failure = self._start_failure or _start_failure(replies)
            if replies:
                self._doorbell.ring()
            if not running:  # a worker that could not be built says why (whoever notices its end)
                failure = failure or self._start_failure
                self._end("its worker loop ended" + (f" with:\n{failure}" if failure else ""))
                return

    def _room_for_pushed(self) -> int:
        """How many pushed batches the next pull may bring: waits (a poll interval at most) while
        ``_FREE_WINDOW`` of them are still to be taken by the worker pool."""
        with self._taken:
            self._taken.wait_for(lambda: self._pushed_held < _FREE_WINDOW or self._stopping.is_set(),
                                 _POLL_SECONDS)
            return max(0, _FREE_WINDOW - self._pushed_held)

    def _greet(self) -> bool:
        """Wait (up to ``start_timeout``) until Ray created the actor; learn its node. False if it never was."""
        ray = require_ray()
        try:
            self._actor_pid, self.node_id = ray.get(self.actor.hello.remote(), timeout=self.start_timeout)
            return True
        except ray.exceptions.GetTimeoutError:
            self._end(f"Ray did not create it within {self.start_timeout:g} s (can the cluster give it "
                      f"{self.resources}?)")
        except Exception as err:  # it died while being created, or Ray shut down
            self._end(_describe_death(err))
        finally:
            self._greeted.set()
        return False

    def wait_node_id(self, timeout: float) -> str | None:
        """The actor's Ray node id, waiting up to ``timeout`` for it to exist; None if it is gone."""
        self._greeted.wait(timeout)
        return self.node_id

    def _end(self, description: str) -> None:
        if self._gone is None:
            self._gone = description
        self._doorbell.ring()

    def send(self, message: Any) -> None:
        if self._gone is not None:
            raise ConnectionError(f"actor {self.worker_idx} is gone: {self._gone}")
        self.actor.push.remote(self._seq, message)
        self._seq += 1

    def poll(self, timeout: float = 0.0) -> bool:
        if not self._replies and timeout > 0 and self._gone is None:
            import select

            select.select([self._doorbell], [], [], timeout)
        return bool(self._replies)

    def recv(self) -> Any:
        with self._taken:
            reply = self._replies.popleft()
            if _pushed(reply):
                self._pushed_held -= 1
                self._taken.notify_all()
        if not self._replies:
            self._doorbell.clear()
            if self._replies:  # arrived between the two lines: keep the bell ringing
                self._doorbell.ring()
        return reply

    def fileno(self) -> int:
        return self._doorbell.fileno()

    def is_alive(self) -> bool:
        return self._gone is None

    def exit_description(self) -> str:
        return self._gone or "it is still running"

    def progress(self) -> int:
        return self._progress

    def interrupt(self) -> None:
        if self._gone is None:
            self._interrupts += 1
            self.actor.interrupt.remote(self._interrupts)

    def interrupt_mark(self) -> int:
        return self._interrupts

    def fetch_batch(self, reply: Any) -> TensorDictBase:
        value = reply.value
        return self._unpacker.unpack(value) if isinstance(value, FlatBatch) else value

    def terminate(self, deadline: float) -> None:
        """Give the worker loop until ``deadline`` to end by itself, then kill the actor and wait (a
        few seconds at most) until Ray reports it gone, so that no process outlives the call."""
        ray = require_ray()
        while self._gone is None and time.monotonic() < deadline:
            self._poller.join(min(0.05, max(0.0, deadline - time.monotonic())))
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self._poller.join(5.0)
        self._stopping.set()
        self._wait_process_gone(time.monotonic() + 5.0)
        if self._gone is None:
            self._gone = "it was stopped"
        self._doorbell.close()

    def _wait_process_gone(self, deadline: float) -> None:
        """Ray reports a killed actor dead before its process has exited: on the driver's node, wait
        (until ``deadline``) for the process itself, so that it does not outlive the shutdown."""
        if self._actor_pid is None or self.node_id is None:
            return
        with contextlib.suppress(Exception):
            if require_ray().get_runtime_context().get_node_id() != self.node_id:
                return
        while _process_running(self._actor_pid) and time.monotonic() < deadline:
            time.sleep(0.01)


def _process_running(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, waiting to be reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # gone (or no /proc: nothing to wait for)
        return False


def _start_failure(replies: list) -> str | None:
    """What a READY reply among ``replies`` reports as the reason its worker could not be built."""
    for reply in replies:
        if reply.request_id == READY and reply.failure is not None:
            return f"{reply.failure.type_name}: {reply.failure.message}"
    return None


def _describe_death(err: Exception) -> str:
    ray = require_ray()
    if isinstance(err, ray.exceptions.RayActorError):
        text = str(err).strip().splitlines()
        reason = next((line for line in text if "reason" in line.lower() or "died" in line.lower()), text[0] if text
                      else type(err).__name__)
        return f"the Ray actor died ({reason.strip()[:300]})"
    return f"its Ray call failed ({type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err) else ''})"


class RayBackend(Backend):
    """Workers as Ray actors, on whatever nodes the Ray cluster places them.

    Args:
        num_workers: how many actors.
        target: what each actor runs, ``target(spec, endpoint)`` (the worker loop).
        remote_configs: the ``ray.remote`` options of each actor (resources, runtime env, ...).
        heartbeat_timeout: seconds an actor may leave a long poll unanswered before it counts as gone.
        start_timeout: seconds Ray may take to create an actor (schedule it, start its process).

    Example:
        >>> from rlharvest.worker import run_worker
        >>> backend = RayBackend(2, run_worker, [{"num_cpus": 1}] * 2)
        >>> backend.default_scheme()
        'ray'
    """

    noun = "actor"

    def __init__(self, num_workers: int, target: WorkerTarget, remote_configs: Sequence[dict] | None = None,
                 heartbeat_timeout: float = 10.0, start_timeout: float = 120.0) -> None:
        super().__init__(num_workers)
        self.target = target
        configs = list(remote_configs) if remote_configs is not None else [DEFAULT_REMOTE_CONFIG] * num_workers
        if len(configs) != num_workers:
            raise ValueError(f"remote_configs must hold one dict per actor ({num_workers}), got {len(configs)}.")
        self.remote_configs = [dict(config) for config in configs]
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.start_timeout = float(start_timeout)

    def start_one(self, index: int, spec: WorkerSpec) -> RayWorkerHandle:
        """Create the actor of worker ``index`` (a new actor when it replaces one).

        Raises:
            ImportError: when Ray is not installed.
        """
        options = {"max_concurrency": _ACTOR_CONCURRENCY, **self.remote_configs[index]}
        # Restarting is the collector's (through the seam, with the current weights and fresh ids):
        # an actor Ray restarted by itself would start from its first spec.
        options["max_restarts"] = 0
        actor = _actor_class().options(**options).remote(self.target, spec)
        handle = self.handles[index] = RayWorkerHandle(index, actor, self.heartbeat_timeout, self.start_timeout,
                                                       self.remote_configs[index])
        return handle

    #: actors are started one by one, by index: more can be added to a running collector
    growable = True

    def grow(self, count: int, options: Sequence[dict] | None = None) -> None:
        """Make room for ``count`` more actors; ``options`` are their ``ray.remote`` options (one dict
        each; default ``DEFAULT_REMOTE_CONFIG``)."""
        configs = list(options) if options is not None else [DEFAULT_REMOTE_CONFIG] * count
        if len(configs) != count:
            raise ValueError(f"remote_configs must hold one dict per new actor ({count}), got {len(configs)}.")
        super().grow(count)
        self.remote_configs.extend(dict(config) for config in configs)

    def truncate(self, num_workers: int) -> None:
        super().truncate(num_workers)
        del self.remote_configs[num_workers:]

    def default_scheme(self) -> str:
        return "ray"

    def weight_links(self) -> RayWeightLinks:
        return RayWeightLinks(self.num_workers, self.liveness, handles=self.handles)

