"""What several parts of one collector read and none owns alone: its counters against its budget
(:class:`Tally`), and whether it is open (:class:`Lifecycle`). The engine makes one of each and hands
it to the parts that read it (docs/architecture.md)."""

from __future__ import annotations

from ...config import CollectorConfig

__all__ = ["Tally", "Lifecycle"]


class Tally:
    """Frames collected and batches yielded so far, against ``total_frames``.

    Args:
        config: the collector's arguments (``total_frames``, ``init_random_frames``, the replay buffer
            whose writes count the random warm-up).

    Example:
        >>> from rlharvest.config import CollectorConfig
        >>> tally = Tally(CollectorConfig(frames_per_batch=4, total_frames=8))
        >>> tally.frames += 8
        >>> tally.reached_total(), tally.batches
        (True, 0)
    """

    def __init__(self, config: CollectorConfig) -> None:
        self.config = config
        #: frames collected so far (TorchRL's ``_frames``)
        self.frames = 0
        #: index of the last batch (-1 before the first; TorchRL's ``_iter``)
        self.iter = -1

    @property
    def batches(self) -> int:
        """Batches yielded (or written) so far."""
        return self.iter + 1

    def reached_total(self) -> bool:
        """Whether ``total_frames`` were collected (never for an endless collector)."""
        return not self.config.endless and self.frames >= self.config.total_frames

    def random_phase(self) -> bool:
        """Whether the next batch takes random actions (``init_random_frames``)."""
        return self.config.in_random_phase(self.frames)

    def frames_left(self) -> int:
        """Frames still to collect to ``total_frames`` (-1 when endless), for checkpoints."""
        config = self.config
        return -1 if config.endless else max(0, int(config.total_frames - self.frames))


class Lifecycle:
    """Whether a collector is open: closed until its workers are up, and again once it is shut down.

    Args:
        name: how messages name the collector (its class's name).

    Example:
        >>> life = Lifecycle("MultiSyncCollector")
        >>> life.check_open("iterating")
        Traceback (most recent call last):
        ...
        RuntimeError: MultiSyncCollector is shut down: iterating is not possible any more (build a new collector).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        #: closed until construction succeeds (the workers are up), and again once shut down
        self.closed = True
        #: whether iteration (or ``start()``) began: profiling cannot be enabled any more
        self.started = False

    def check_open(self, action: str) -> None:
        """Raises: RuntimeError naming ``action`` once the collector is shut down."""
        if self.closed:
            raise RuntimeError(f"{self.name} is shut down: {action} is not possible any more (build a new collector).")
