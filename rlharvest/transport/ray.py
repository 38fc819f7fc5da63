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
import threading
import time
from typing import Any, Sequence

from tensordict import TensorDictBase

from ..data.flat import FlatBatch, FlatUnpacker
from ..protocol import READY, WorkerSpec
from .base import Backend, WorkerHandle, WorkerTarget
from .pipes import Doorbell
from .ray_actor import _FREE_WINDOW, RayWorkerActor, RayWorkerEndpoint, _actor_class, _pushed, require_ray
from .ray_weights import RayWeightLinks

__all__ = ["ActorReplayBuffer", "as_replay_buffer", "RayBackend", "RayWorkerActor", "RayWorkerEndpoint", "RayWorkerHandle", "require_ray", "ensure_ray",
           "DEFAULT_REMOTE_CONFIG"]

#: what each actor reserves unless ``remote_configs`` says otherwise: one CPU, no GPU
DEFAULT_REMOTE_CONFIG = {"num_cpus": 1}
#: concurrent calls an actor serves (commands, the long poll, weights, interrupts)
_ACTOR_CONCURRENCY = 8
#: seconds a long poll waits for replies before it returns the worker's progress anyway
_POLL_SECONDS = 1.0


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

