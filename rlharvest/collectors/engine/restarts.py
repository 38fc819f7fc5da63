"""When a failed worker is replaced, and what is remembered of it (docs/restarts.md).

Every collector with workers keeps one :class:`RestartPolicy` (on its :class:`~._fleet.Fleet`). A
failure the collector meets while collecting (the worker's env or policy raised, its process died,
its host stopped sending heartbeats, it made no progress for ``worker_timeout``) is handed to
:meth:`RestartPolicy.admit`, which either records it and names the worker to replace, or raises:

* with ``max_worker_restarts=0`` (the default) it raises the failure itself, unchanged: collection
  fails exactly as it did before restarts existed;
* past the limit it raises a :class:`RestartLimitError` listing the cause of every restart (worker,
  kind, time, traceback) and the failure that exceeded the limit.

The limit counts the restarts of the whole collector, not of each worker: a flaky worker and a
flaky fleet use up the same budget.

The collector's side: wherever it meets a failed worker (sending a request, waiting for a reply,
fetching a batch, delivering weights) it calls :meth:`~._fleet.Fleet.recover`, which admits the
failure here, drops what the worker had in flight and starts its replacement.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ...errors import RestartLimitError, WorkerError, WorkerTimeoutError
from .events import EventKind, FleetEvents

__all__ = ["RestartCause", "RestartLimitError", "RestartPolicy", "failure_kind"]

logger = logging.getLogger("rlharvest.restarts")

_WORKER_ERROR = f"{WorkerError.__module__}.{WorkerError.__qualname__}"
#: what a failure is, as ``RestartCause.kind`` names it
KINDS = ("exception", "died", "heartbeat", "timeout")


def failure_kind(err: WorkerError) -> str:
    """``"timeout"`` (no progress for ``worker_timeout``), ``"exception"`` (raised in the worker's env,
    policy or collector), ``"heartbeat"`` (its host stopped answering) or ``"died"`` (its process ended)."""
    if isinstance(err, WorkerTimeoutError):
        return "timeout"
    if err.remote_type is not None and err.remote_type != _WORKER_ERROR:
        return "exception"  # (a WorkerError sent back is a transport's report of a death, not user code's)
    return getattr(err, "kind", None) or "died"


@dataclass(frozen=True)
class RestartCause:
    """Why one worker was replaced (or, for the last entry of a :class:`RestartLimitError`, would have been)."""

    worker: int
    """Index of the worker that failed."""
    kind: str
    """One of ``"exception"``, ``"died"``, ``"heartbeat"``, ``"timeout"``."""
    time: float
    """Wall-clock time (``time.time()``) the failure was met."""
    message: str
    """The failure's message (its first line)."""
    traceback: str = ""
    """The remote traceback of an exception, else ``""``."""

    @classmethod
    def of(cls, err: WorkerError) -> RestartCause:
        message = str(err).split("\n\nRemote traceback:", 1)[0]
        message = message.removeprefix(f"worker {err.worker_idx}: ")
        return cls(int(err.worker_idx), failure_kind(err), time.time(), message, err.remote_traceback)

    def describe(self) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(self.time)) + f".{int(self.time * 1000) % 1000:03d}"
        text = f"[{stamp}] worker {self.worker} ({self.kind}): {self.message}"
        if self.traceback:
            text += "\n    " + self.traceback.rstrip().replace("\n", "\n    ")
        return text


class RestartPolicy:
    """Decides whether a failed worker is replaced, and keeps the causes.

    Args:
        max_restarts: replacements allowed over the collector's life (0: none, failures raise);
            a count validated by :func:`~rlharvest.config.check_restart_arguments`.
        delay: seconds to wait before each replacement starts.
        noun: how messages name a worker ("worker", "node").
        events: where restarts and preemptions are published (and logged); a log of its own by default.

    Example:
        >>> policy = RestartPolicy(max_restarts=1, delay=0.0)
        >>> policy.admit(WorkerError("the worker died: it was killed by SIGKILL.", worker_idx=1))
        1
        >>> policy.restarts_of(1), policy.causes[0].kind
        (1, 'died')
    """

    def __init__(self, max_restarts: int = 0, delay: float = 0.0, noun: str = "worker",
                 events: FleetEvents | None = None) -> None:
        self.max_restarts, self.delay = max_restarts, delay
        self.noun = noun
        self.events = events if events is not None else FleetEvents()
        self.causes: list[RestartCause] = []
        #: workers that were preempted (kind ``"preempted"``): leaves, not counted as failures
        self.leaves: list[RestartCause] = []

    @property
    def enabled(self) -> bool:
        return self.max_restarts > 0

    def history(self) -> tuple[RestartCause, ...]:
        """Why each worker was replaced, or left on a preemption, so far, oldest first."""
        return tuple(sorted([*self.causes, *self.leaves], key=lambda cause: cause.time))

    def restarts_of(self, worker: int) -> int:
        """How many times worker ``worker`` was replaced after a failure."""
        return sum(cause.worker == worker for cause in self.causes)

    def replacements_of(self, worker: int) -> int:
        """How many workers were started in place of worker ``worker`` (after failures and leaves)."""
        return self.restarts_of(worker) + sum(leave.worker == worker for leave in self.leaves)

    def record_leave(self, err: WorkerError, replaced: bool) -> int:
        """Record a preempted worker (not counted against ``max_restarts``) and return its index.

        Raises:
            WorkerError: ``err`` itself when it names no worker.
        """
        if err.worker_idx is None:
            raise err
        leave = RestartCause.of(err)
        self.leaves.append(leave)
        then = "starting a replacement" if replaced else "going on without it"
        self.events.publish(
            EventKind.PREEMPTION, f"{self.noun} {leave.worker} was preempted (not counted against "
            f"max_worker_restarts); {then}: {leave.message}", workers=(leave.worker,),
            details={"replaced": replaced, "message": leave.message}, logger=logger, level=logging.WARNING)
        return leave.worker

    def admit(self, err: WorkerError) -> int:
        """Record ``err`` and return the worker to replace, after ``delay`` seconds.

        Raises:
            WorkerError: ``err`` itself when restarts are off or it names no worker.
            RestartLimitError: when this failure is one more than ``max_restarts``.
        """
        if not self.enabled or err.worker_idx is None:
            raise err
        cause = RestartCause.of(err)
        if len(self.causes) >= self.max_restarts:
            causes = [*self.causes, cause]
            listed = "\n".join(c.describe() for c in causes)
            raise RestartLimitError(
                f"{len(causes)} {self.noun} failures, more than max_worker_restarts={self.max_restarts}; every "
                f"failure, oldest first:\n{listed}", causes, err) from err
        self.causes.append(cause)
        self.events.publish(
            EventKind.RESTART, f"restarting {self.noun} {cause.worker} (restart {len(self.causes)} of "
            f"{self.max_restarts}): {cause.kind} failure: {cause.message}", workers=(cause.worker,),
            details={"cause": cause.kind, "message": cause.message}, logger=logger, level=logging.WARNING)
        if self.delay:
            time.sleep(self.delay)
        return cause.worker

    def stats(self, num_workers: int) -> dict[str, int | str]:
        """``restarts`` (the collector's), ``worker_<i>/restarts`` and ``worker_<i>/restart_causes``."""
        stats: dict[str, int | str] = {"restarts": len(self.causes), "preemptions": len(self.leaves)}
        for worker in range(num_workers):
            causes = [c for c in self.causes if c.worker == worker]
            leaves = [c for c in self.leaves if c.worker == worker]
            stats[f"worker_{worker}/restarts"] = len(causes)
            stats[f"worker_{worker}/preemptions"] = len(leaves)
            both = sorted(causes + leaves, key=lambda c: c.time)
            stats[f"worker_{worker}/restart_causes"] = "; ".join(f"{c.kind}: {c.message}" for c in both)
        return stats
