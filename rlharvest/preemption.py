"""Surviving preemption on SLURM: save at the next batch boundary when the signal comes, resume after
the requeue (docs/checkpoints.md, "Preemption on SLURM").

SLURM announces the end of a job with a signal: ``SIGTERM`` when it is preempted, requeued
(``scontrol requeue``) or cancelled, ``KillWait`` seconds before ``SIGKILL``; the signal of
``--signal=[B:]USR1@<seconds>`` that long before its time limit. :class:`PreemptionCheckpoint` only
notes the signal (a handler can run in the middle of a batch); the training loop asks
:attr:`~PreemptionCheckpoint.requested` between batches, where a checkpoint is one consistent
moment, and saves there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable, Protocol

import torch

__all__ = ["PreemptionCheckpoint"]


class Resumable(Protocol):
    """What a checkpoint is taken of and loaded into: a collector (any of rlharvest's)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> None: ...

    def shutdown(self) -> None: ...


class PreemptionCheckpoint:
    """The checkpoint file of a run that SLURM may preempt and requeue.

    Args:
        path: the checkpoint file; written atomically (a temporary file, then renamed), so a job killed
            while saving leaves the previous checkpoint intact.
        signals: the signals that announce the end of the job (their previous handlers are put back by
            :meth:`close`).
        requeue: after :meth:`save_and_exit`, ask SLURM to requeue this job (``scontrol requeue``) when
            the signal was not ``SIGTERM`` (a SIGTERM comes from a preemption or requeue that already
            puts the job back in the queue).

    Example:
        >>> with PreemptionCheckpoint("ckpt.pt") as preemption:            # doctest: +SKIP
        ...     preemption.resume(collector, learner=learner)   # nothing to do on the first run
        ...     for batch in collector:
        ...         learner.train(batch)
        ...         if preemption.requested:                    # between two batches
        ...             preemption.save_and_exit(collector, learner=learner)
    """

    def __init__(self, path: str | os.PathLike, signals: Iterable[int] = (signal.SIGUSR1, signal.SIGTERM),
                 requeue: bool = True) -> None:
        self.path = Path(path)
        self.requeue = requeue
        #: the signal received (a ``signal.Signals``), or None
        self.signal: signal.Signals | None = None
        self._previous = {sig: signal.signal(sig, self._note) for sig in signals}

    def _note(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum)  # only noted: the loop saves at its next batch boundary

    @property
    def requested(self) -> bool:
        """Whether a signal announced the end of this job."""
        return self.signal is not None

    def resume(self, collector: Resumable, **others: Any) -> bool:
        """Load the checkpoint, if there is one, into ``collector`` and into each of ``others`` (objects
        with ``load_state_dict``, saved under the same names). Returns whether one was loaded."""
        if not self.path.exists():
            return False
        checkpoint = torch.load(self.path)
        collector.load_state_dict(checkpoint["collector"])
        for name, obj in others.items():
            obj.load_state_dict(checkpoint[name])
        return True

    def save(self, collector: Resumable, **others: Any) -> None:
        """Write ``collector``'s checkpoint and ``others``' state dicts, atomically."""
        checkpoint = {"collector": collector.state_dict(), **{name: obj.state_dict() for name, obj in others.items()}}
        partial = self.path.with_name(self.path.name + ".partial")
        torch.save(checkpoint, partial)
        os.replace(partial, self.path)

    def save_and_exit(self, collector: Resumable, **others: Any) -> None:
        """:meth:`save`, shut ``collector`` down, requeue the job if asked, and exit with status 0.

        Raises:
            SystemExit: always (status 0).
        """
        self.save(collector, **others)
        collector.shutdown()
        job = os.environ.get("SLURM_JOB_ID")
        if self.requeue and job and self.signal is not signal.SIGTERM:
            subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        sys.exit(0)

    def close(self) -> None:
        """Put the previous signal handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __enter__(self) -> PreemptionCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
