"""The actor side of the ``ray`` backend (``ray.py`` has the parent side): an actor runs the worker loop
in a thread of its own against a :class:`RayWorkerEndpoint`, whose methods are the other end of the
parent's handle (commands pushed in order, replies long-polled, batches pushed within a window while
running free). Ray is imported lazily (``pip install 'rlharvest[ray]'``)."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable

from tensordict import TensorDictBase

from ..data.flat import FlatBatch
from ..protocol import FREE_BATCH, WorkerSpec
from .base import WorkerEndpoint, WorkerTarget
from .pipes import Doorbell
from .ray_weights import WeightInboxes


__all__ = ["RayWorkerActor", "RayWorkerEndpoint", "require_ray"]

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
        not a ``torch.load`` per leaf (docs/archive/performance-history.md, "Learner CPU per batch")."""
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
