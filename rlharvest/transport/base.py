"""The process boundary: the interfaces every transport implements.

Two kinds of traffic cross it:

* **commands and batches** between a collector and its workers: the parent holds one
  :class:`WorkerHandle` per worker, each worker serves one :class:`WorkerEndpoint`
  (see ``rlharvest.worker`` for the loop that serves it);
* **weights** from a weight-sync scheme's sender to its receivers: :class:`WeightSender` on the parent,
  one :class:`WeightReceiver` per worker.

Each backend (``mp.py``: pipes + shared memory; ``torchdist.py``: a torch.distributed process group;
``rpc.py``: torch RPC; ``inprocess.py``: threads, for tests) implements these in one file.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

from tensordict import TensorDictBase

__all__ = ["WeightSender", "WeightReceiver", "WorkerHandle", "WorkerEndpoint"]


class WeightSender(ABC):
    """Parent end of a weight channel to ``num_workers`` receivers."""

    num_workers: int

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

    def connection_info(self) -> Any:
        """What a pickled copy of the scheme needs to build its receivers."""
        return None

    def close(self) -> None:
        """Release resources; idempotent."""


class WeightReceiver(ABC):
    """Worker end of a weight channel."""

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

    def close(self) -> None:
        """Release resources; idempotent."""


class WorkerHandle(ABC):
    """The parent's end of one worker (process, rank, RPC node)."""

    worker_idx: int

    @abstractmethod
    def send(self, message: Any) -> None:
        """Send a command message."""

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> bool:
        """Whether a reply is ready within ``timeout`` seconds."""

    @abstractmethod
    def recv(self) -> Any:
        """The next reply (call after ``poll`` returned True)."""

    @abstractmethod
    def fileno(self) -> int:
        """A descriptor that becomes readable when a reply is ready (for multiplexed waits)."""

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the worker still runs (cheap)."""

    def exit_description(self) -> str:
        """Why the worker is gone, for error messages."""
        return "it is no longer alive"

    def progress(self) -> int:
        """A counter the worker advances as it works (env steps); -1 when unknown."""
        return -1

    def interrupt(self) -> None:
        """Ask the worker to end its current rollout early (cheap, no reply)."""

    def interrupt_mark(self) -> int:
        """The interrupt counter now: a request carrying it is stopped by any later ``interrupt()``."""
        return 0

    @abstractmethod
    def fetch_batch(self, reply: Any) -> TensorDictBase:
        """The batch a BATCH reply refers to, readable in the parent (valid until the next command)."""

    @abstractmethod
    def terminate(self, deadline: float) -> None:
        """Make sure the worker is gone by ``deadline`` (monotonic seconds): join, terminate, kill."""


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

    def parent_alive(self) -> bool:
        """Whether the parent still exists."""
        return True

    def close(self) -> None:
        """Release resources; idempotent."""
