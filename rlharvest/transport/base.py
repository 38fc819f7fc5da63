"""The process boundary: the interfaces every backend implements.

* :class:`Backend` owns the life cycle of a collector's workers: it starts them all from their
  :class:`~rlharvest.protocol.WorkerSpec`s, starts or replaces *one* by index (same identity, new
  process or node), stops one, stops all within one deadline, and names its default weight-sync
  scheme. Collectors never create processes, ranks, RPC workers or sockets themselves.
* Commands and batches travel between the parent's :class:`WorkerHandle` (one per worker) and the
  worker's :class:`WorkerEndpoint`; the worker loop (``rlharvest.worker``) serves the endpoint.
  The backend is given that loop as its target: nothing here imports it.
* Weights travel from a scheme's :class:`WeightSender` (parent) to one :class:`WeightReceiver` per
  worker, over what the backend offers them (:class:`WeightLinks`). A sender accepts a new receiver
  for one worker after start-up (``replace`` then ``attach``), so a replacement gets the current
  weights and version before it collects; a sender that is ``growable`` connects a worker added
  after start-up the same way.

One file per backend implements these: ``inprocess.py`` (threads, for tests), ``mp.py`` (worker
processes: pipes and shared memory), ``torchdist.py`` (nodes: TCP commands, a torch.distributed
group for tensors), ``rpc.py`` (nodes driven by torch RPC). docs/backends.md says how to add one.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Collection, Sequence

from tensordict import TensorDictBase

from ..errors import WorkerError, WorkerTimeoutError
from ..protocol import WorkerSpec, Written

__all__ = ["Backend", "Liveness", "receive_from", "WeightLinks", "WeightSender", "WeightReceiver", "WorkerHandle", "WorkerEndpoint",
           "WorkerTarget"]

#: ``liveness(worker) -> (alive, description)``: how waits on a worker notice that it died
Liveness = Callable[[int], "tuple[bool, str]"]
#: what a push backend runs in each worker: ``target(spec, endpoint)`` (``rlharvest.worker.run_worker``)
WorkerTarget = Callable[[WorkerSpec, "WorkerEndpoint"], None]


@dataclass
class WeightLinks:
    """What a backend offers the weight senders of its collector (subclassed by each backend).

    Attributes:
        num_workers: how many workers the backend runs.
        liveness: tells a sender waiting for an acknowledgement that its worker died.
    """

    num_workers: int
    liveness: Liveness | None = None


class WorkerHandle(ABC):
    """The parent's end of one worker (process, thread, node, RPC node)."""

    worker_idx: int

    @abstractmethod
    def send(self, message: Any) -> None:
        """Send a command message."""

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a reply is ready within ``timeout`` seconds."""

    @abstractmethod
    def recv(self) -> Any:
        """The next reply (call after ``poll`` returned True); None for a message the handle consumed."""

    @abstractmethod
    def fileno(self) -> int:
        """A descriptor that becomes readable when a reply is ready (for multiplexed waits)."""

    @property
    def pid(self) -> int | None:
        """The worker's process id when it is a process of this machine, else None."""
        return None

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the worker still runs (cheap)."""

    def exit_description(self) -> str:
        """Why the worker is gone, for error messages."""
        return "it is no longer alive"

    def exit_kind(self) -> str:
        """How the worker is gone: ``"died"`` (its process ended), or ``"heartbeat"`` (its host stopped
        answering while its connection stayed open)."""
        return "died"

    def progress(self) -> int:
        """A counter the worker advances as it works (env steps); -1 when unknown."""
        return -1

    def written(self) -> Written | None:
        """The totals the worker last advertised of what it wrote to the replay buffer
        (:meth:`WorkerEndpoint.report_written`), or None where the transport carries them only in replies."""
        return None

    def interrupt(self) -> None:
        """Ask the worker to end its current rollout early (cheap, no reply)."""

    def interrupt_mark(self) -> int:
        """The interrupt counter now: a request carrying it is stopped by any later ``interrupt()``."""
        return 0

    def left_as(self) -> str | None:
        """What a worker preempted on SIGTERM did with its rollout (``"finished"``, ``"handed back"``),
        if it said so where its exit cannot lose it (shared memory); None otherwise."""
        return None

    @abstractmethod
    def fetch_batch(self, reply: Any) -> TensorDictBase:
        """The batch a BATCH reply refers to, readable in the parent (valid until the next command)."""

    def batch_resized(self) -> None:
        """The worker's batches change size from its next one: the layout it sends then replaces the one
        kept (no other change of layout is accepted)."""

    @abstractmethod
    def terminate(self, deadline: float) -> None:
        """Make sure the worker is gone by ``deadline`` (monotonic seconds): join, terminate, kill."""


class DepartedHandle(WorkerHandle):
    """What stays in the slot of a worker that left for good: nothing of its own.

    One instance stands in for every departed worker, so a run of days with a departure every few
    minutes keeps one list entry per slot, not the handle, its pipe wrapper and its signal row
    (docs/elastic.md, "What a departed worker leaves"). It answers as a worker that is gone.
    """

    worker_idx = -1

    def send(self, message: Any) -> None:
        raise BrokenPipeError("this worker left: its slot is empty.")

    def poll(self, timeout: float = 0.0) -> bool:
        return False

    def recv(self) -> Any:
        raise EOFError("this worker left: its slot is empty.")

    def fileno(self) -> int:
        raise OSError("this worker left: its slot has no connection.")

    def is_alive(self) -> bool:
        return False

    def exit_description(self) -> str:
        return "it left (its slot is empty)"

    def fetch_batch(self, reply: Any) -> TensorDictBase:
        raise RuntimeError("this worker left: it has no batch.")

    def terminate(self, deadline: float) -> None:
        pass


#: the one handle of every departed worker's slot
DEPARTED = DepartedHandle()


class WorkerEndpoint(ABC):
    """A worker's end of its connection to the parent."""

    worker_idx: int

    @abstractmethod
    def recv(self, timeout: float) -> Any | None:
        """The next command, or None if none arrived within ``timeout``."""

    @abstractmethod
    def send(self, message: Any) -> None:
        """Send a reply."""

    @abstractmethod
    def publish_batch(self, batch: TensorDictBase) -> Any:
        """Make ``batch`` readable by the parent; returns what the BATCH reply carries."""

    def batch_buffer(self) -> TensorDictBase | None:
        """The buffer batches are published from, once there is one (rollouts may write into it)."""
        return None

    def batch_resized(self) -> None:
        """The worker's batches change size from the next one (a sync parent re-split its batch): the
        next is published afresh, its buffer or layout travelling with its reply."""

    def wait_handle(self) -> Any | None:
        """An object ``multiprocessing.connection.wait`` wakes on when a command arrives, or None."""
        return None

    def receiver_links(self) -> Any | None:
        """What the weight receivers of this worker need from the transport (a node's group), or None."""
        return None

    def before_rollout(self, idle: Callable[[], None] | None = None) -> None:
        """Called before a rollout writes into the published buffer (wait for a pending send).

        ``idle`` is called while waiting: the worker applies weight updates meanwhile, so a parent
        that waits for their acknowledgement before taking the batch does not deadlock.
        """

    def interrupted(self) -> bool:
        """Cheap per-step check: did the parent ask to stop the current rollout?"""
        return False

    def clear_interrupt(self, mark: int | None = None) -> None:
        """Forget interrupts up to ``mark`` (the parent's counter when it sent the request; None = now)."""

    def report_progress(self, steps: int) -> None:
        """Advertise progress (cheap, called once per step)."""

    def report_written(self, totals: Written) -> None:
        """Advertise what this worker wrote to the replay buffer, its totals (cheap, called once per
        write): the parent reads them without asking (:meth:`WorkerHandle.written`), running free too."""

    def announce_leaving(self, handed_back: bool) -> None:
        """Say, where the parent reads it whatever happens to the connection, that this worker leaves
        (preempted); its LEAVING message follows."""

    def on_preemption(self, preempt: Callable[[float], None]) -> None:
        """Where the worker loop does not run in its process's main thread (a Ray actor), SIGTERM is
        caught by the process, not by the loop: call ``preempt(when)`` (monotonic seconds) when it
        arrives, at once if it already did. Elsewhere nothing to do: the loop installs its handler."""

    def parent_alive(self) -> bool:
        """Whether the parent still exists."""
        return True

    def close(self) -> None:
        """Release resources; idempotent."""


class Backend(ABC):
    """Starts, replaces and stops the workers of one collector.

    The collector builds one :class:`~rlharvest.protocol.WorkerSpec` per worker and keeps them;
    the backend turns specs into running workers and hands back their handles. A replacement
    (``start_one`` for an index whose worker was stopped) keeps the index and identity of the spec.

    Attributes:
        noun: how errors name one worker (``"worker"``, ``"node"``).
        handles: the current handle of every worker, by index (None once stopped).
    """

    noun = "worker"
    #: whether :meth:`grow` can add workers to a running collector
    growable = False
    #: whether a new worker can take the slot of one that left (nodes that join: ``launcher="external"``)
    refills_slots = False
    #: whether a worker can be started again at the index of one that failed or left (a preempted one
    #: is then replaced; False: nodes started elsewhere, which only leave)
    replaceable = True

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.handles: list[WorkerHandle | None] = [None] * num_workers
        #: set by :meth:`expect_replacements`: failed workers will be replaced
        self.replacements_expected = False

    def expect_replacements(self) -> None:
        """Say, before :meth:`start_all`, that failed workers will be replaced, so that a backend
        whose replacements need something prepared (torchdist and RPC ``"mp"`` nodes: a forkserver
        that has imported torch) prepares it while the first workers start, not at a failure."""
        self.replacements_expected = True

    def grow(self, count: int, options: Sequence[dict] | None = None) -> None:
        """Make room for ``count`` more workers, indices ``num_workers`` on, each then started with
        :meth:`start_one` (docs/backends.md, "Adding workers").

        Args:
            count: how many workers are added.
            options: what this backend needs to know of each new worker (Ray: its ``ray.remote``
                options), or None for its defaults.

        Raises:
            NotImplementedError: when this backend cannot add workers (``growable`` is False).
        """
        if not self.growable:
            raise NotImplementedError(f"{type(self).__name__} cannot add workers to a running collector.")
        self.handles.extend([None] * count)  # in place: weight links hold this very list
        self.num_workers += count

    def truncate(self, num_workers: int) -> None:
        """Forget the workers from index ``num_workers`` on (stopped already): undoes a :meth:`grow`
        whose workers failed to start."""
        del self.handles[num_workers:]
        self.num_workers = num_workers

    def start_all(self, specs: Sequence[WorkerSpec]) -> list[WorkerHandle]:
        """Start one worker per spec (index order); returns their handles. They answer READY once built.

        Raises:
            WorkerError: when a worker died while starting.
        """
        return [self.start_one(spec.worker_idx, spec) for spec in specs]

    @abstractmethod
    def start_one(self, index: int, spec: WorkerSpec) -> WorkerHandle:
        """Start worker ``index`` from ``spec``, or its replacement after :meth:`stop_one`.

        Returns its handle (also stored in ``handles[index]``); the worker answers READY once built.
        """

    def stop_one(self, index: int, deadline: float) -> None:
        """Make sure worker ``index`` is gone by ``deadline`` (monotonic seconds); idempotent."""
        handle = self.handles[index]
        if handle is not None:
            handle.terminate(deadline)

    def retire(self, index: int) -> None:
        """Worker ``index`` left for good (removed, or preempted and not replaced) and was stopped
        (:meth:`stop_one`): release what the backend kept for its slot. Its index stays (an empty slot:
        ``handles[index]`` is None). A backend that keeps more per slot releases it, then calls this."""
        self.handles[index] = None

    def stop_all(self, deadline: float, closing: Collection[int] = ()) -> None:
        """Make sure every worker is gone, and release what the backend holds; idempotent.

        Args:
            deadline: monotonic time by which workers in ``closing`` must have exited by themselves.
            closing: workers that acknowledged CLOSE; the others are terminated right away.
        """
        for index in range(self.num_workers):
            self.stop_one(index, max(deadline, time.monotonic() + 0.5) if index in closing else time.monotonic())

    @abstractmethod
    def default_scheme(self) -> str:
        """The weight-sync scheme collectors on this backend use by default, as a
        ``WeightSyncScheme.from_backend`` name (``"shared"``, ``"distributed"``, ``"rpc"``)."""

    @abstractmethod
    def weight_links(self) -> WeightLinks:
        """What weight senders need from this backend (channels, devices, liveness)."""

    def liveness(self, index: int) -> tuple[bool, str]:
        """``(alive, description)`` of worker ``index``, for waits outside the worker pool."""
        handle = self.handles[index]
        if handle is None:
            return False, "it was stopped"
        alive = handle.is_alive()
        return alive, ("alive" if alive else handle.exit_description())


def receive_from(conn, worker: int, deadline: float, what: str, liveness: Liveness | None):
    """The next message of ``worker`` on the connection ``conn`` (a sender waiting for an acknowledgement):
    waits in slices of 0.2 s between which the worker's liveness is checked, so a dead worker ends the
    wait at once rather than at the deadline.

    Raises:
        WorkerError: when the connection breaks or the worker died (its description says how).
        WorkerTimeoutError: when nothing arrived by ``deadline`` (``time.monotonic()``).
    """
    while True:
        remaining = deadline - time.monotonic()
        try:
            if conn.poll(max(0.0, min(0.2, remaining))):
                return conn.recv()
        except (EOFError, OSError) as err:
            raise WorkerError(f"lost its weight channel while the main process waited for {what}.",
                              worker_idx=worker) from err
        if liveness is not None:
            alive, description = liveness(worker)
            if not alive:
                raise WorkerError(f"died while the main process waited for {what}: {description}.",
                                  worker_idx=worker)
        if remaining <= 0:
            raise WorkerTimeoutError(f"{what} did not arrive within the weight-sync timeout.", worker_idx=worker)


class WeightSender(ABC):
    """Parent end of a weight channel to ``num_workers`` receivers."""

    num_workers: int
    #: whether the sender serves workers its backend added after start-up (``Backend.grow``): each
    #: is then connected like a replacement, with :meth:`replace` and :meth:`attach`
    growable = False

    @abstractmethod
    def connect(self, initial: TensorDictBase | dict[int, TensorDictBase] | None) -> None:
        """One-time rendezvous with every receiver; hand over the initial weights if any."""

    @abstractmethod
    def deliver(self, payload: TensorDictBase | dict[int, TensorDictBase], version: int, worker_ids: list[int]) -> None:
        """Make ``payload`` (or the per-worker entries of a dict payload) available to ``worker_ids``."""

    @abstractmethod
    def wait_acks(self, version: int, worker_ids: list[int], timeout: float) -> None:
        """Return once every listed worker acknowledged ``version``.

        Raises:
            WorkerError: when a worker died or reported a failure.
            WorkerTimeoutError: after ``timeout`` seconds.
        """

    @abstractmethod
    def replace(self, worker: int) -> None:
        """Forget ``worker``'s receiver (its worker is gone) and open a channel for its replacement.

        Called before the replacement's spec is built: :meth:`connection_info` then describes the
        new channel.
        """

    @abstractmethod
    def attach(self, worker: int, timeout: float) -> None:
        """Rendezvous with the new receiver of ``worker`` and deliver the current weights.

        "Current" is what the last update delivered (for per-worker weights: to that worker), or the
        initial weights; the worker applies them while it is built, so before it collects.
        """

    def connection_info(self) -> Any:
        """What a pickled copy of the scheme needs to build its receivers."""
        return None

    def close(self) -> None:
        """Release resources; idempotent."""


class WeightReceiver(ABC):
    """Worker end of a weight channel."""

    #: whether received payloads are buffers reserved for this receiver (swapped in, not copied)
    zero_copy = False
    #: a lock held while an update is taken, when updates may also be taken outside the worker loop
    #: (:meth:`take_early`); None otherwise
    taking = None

    @abstractmethod
    def connect(self, timeout: float) -> TensorDictBase | None:
        """One-time rendezvous; returns the initial weights, if the sender provided any."""

    @abstractmethod
    def pending(self) -> bool:
        """Cheap check, called between env steps: is an update waiting?"""

    @abstractmethod
    def receive(self, timeout: float) -> tuple[int, TensorDictBase] | None:
        """``(version, weights)`` of the next update, or None if none arrived within ``timeout``."""

    @abstractmethod
    def ack(self, version: int) -> None:
        """Tell the sender that ``version`` is applied (and cascaded)."""

    def nack(self, failure) -> None:
        """Tell the sender that applying an update failed (a RemoteFailure)."""

    def take_early(self, apply) -> bool:
        """Let the receiver's own thread take updates that need no waiting, through ``apply(version,
        load)`` (see ``DistWeightReceiver.take_early``); None stops it. Whether this receiver can."""
        return False

    def wait_handle(self) -> Any | None:
        """An object ``multiprocessing.connection.wait`` wakes on when an update arrives, or None."""
        return None

    def close(self) -> None:
        """Release resources; idempotent."""
